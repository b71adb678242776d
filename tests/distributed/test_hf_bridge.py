"""Hugging Face models through Megatron-Bridge: --hf-model / --save-hf in the trainer, on CPU.

Tiny Llama, Qwen2, Qwen3 and Qwen3-MoE models are made locally by the project's own command
(``python -m megatron_pg_agg.integrations.tiny_hf``, transformers' ``save_pretrained``). Expected
values come from transformers (its fp32 forward for the logits, its float64 forward and autograd for
the objective and gradient norm) and from the safetensors files it wrote (for the round trips); none
from megatron-core or Megatron-Bridge.

Python 3.12 with megatron-bridge only (the ``bridge`` extra); elsewhere these tests skip with the
reason, and fail instead under MEGATRON_PG_AGG_REQUIRE_BRIDGE=1 (.ci/run's 0.19.2 leg).
"""
import json
import os
import sys

import pytest

from tests.support.launching import ROOT, child_env, run, torchrun, worker

REQUIRE_BRIDGE = "MEGATRON_PG_AGG_REQUIRE_BRIDGE"
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
MODES = {"token_mean": [], "seq_mean": [], "prompt_mean": [],
         "constant": ["--pg-loss-aggregation-divisor", "7"]}
CHECKS, REFERENCE, RUNS = worker("hf_checks"), worker("hf_reference"), worker("trainer_runs")
TRAIN = ROOT / "launch" / "train_actor.py"
IDS = [3, 17, 99, 5, 64, 1, 127, 42, 8, 23, 77, 0, 64]


def _bridge_problem():
    from megatron_pg_agg.integrations.hf_folder import bridge_install_problem

    return bridge_install_problem()


@pytest.fixture(scope="module", autouse=True)
def _bridge_installed():
    problem = _bridge_problem()
    if problem is not None:
        if os.environ.get(REQUIRE_BRIDGE) == "1":
            pytest.fail(f"{REQUIRE_BRIDGE}=1 but {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``{family: folder}``: tiny models made by the project's command (4 layers: PP2 with virtual stages)."""
    root = tmp_path_factory.mktemp("hf")
    made = {}
    for family in FAMILIES:
        out = root / family
        rc, log, _ = run([sys.executable, "-m", "megatron_pg_agg.integrations.tiny_hf", "--family", family,
                          "--seed", "3", str(out)], 120, f"tiny {family}", env=child_env())
        assert rc == 0, log[-5000:]
        made[family] = str(out)
    return made


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    """The built-in synthetic rollouts (vocabulary 128) as a rollout file: the runs and the reference read it."""
    from megatron_pg_agg.data.rollout_files import write_rollouts
    from megatron_pg_agg.data.synthetic import synthetic_rollouts

    return str(write_rollouts(tmp_path_factory.mktemp("rollouts") / "steps.jsonl",
                              synthetic_rollouts(vocab_size=128, seed=1234)))


@pytest.fixture(scope="module")
def reference(models, rollouts, tmp_path_factory):
    """``{family: {mode: {objective, weight, grad_norm}}}`` from transformers in float64."""
    tmp = tmp_path_factory.mktemp("reference")
    spec, out = tmp / "spec.json", tmp / "out.json"
    variants = {mode: ["--pg-loss-aggregation", mode, *extra] for mode, extra in MODES.items()}
    spec.write_text(json.dumps({"models": models, "rollouts": rollouts, "variants": variants}))
    rc, log, _ = run([sys.executable, *REFERENCE, str(spec), str(out)], 600, "transformers reference",
                     env=child_env())
    assert rc == 0, log[-10000:]
    return json.loads(out.read_text())


def test_load_export_and_logits_against_transformers(models, tmp_path):
    """Each family on DP2 / TP2 (EP2 for MoE) / PP2: the exported tensors equal the folder's own
    (names and values: a wrong mapping, a dropped shard or a transposed QKV cannot pass), the
    logits equal transformers' fp32 forward; then the trainer's own setup and steps on TP2, and the
    HF folder it writes gives in transformers the logits megatron-core gave."""
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    trained_dir = tmp_path / "trained_hf"
    spec.write_text(json.dumps({
        "models": models, "ids": IDS,
        "trained": {"argv": ["--hf-model", models["qwen3"], "--tensor-model-parallel-size", "2",
                             "--metrics-file", str(tmp_path / "m.jsonl"), "--lr", "0.01"],
                    "iterations": 2, "out": str(trained_dir)}}))
    rc, log, elapsed = run(torchrun(2, *CHECKS, spec, out), 600, "HF checks")
    assert rc == 0, log[-20000:]
    result = json.loads(out.read_text())
    for family in FAMILIES:
        layouts = result["checks"][family]
        assert set(layouts) == {"DP2", "EP2" if family == "qwen3_moe" else "TP2", "PP2"}
        for layout, got in layouts.items():
            assert got["names_equal"], (family, layout, got)
            assert got["export_max_abs"] <= 1e-6, (family, layout, got)
        assert layouts["DP2"]["logits_max_abs"] <= 1e-5, (family, layouts["DP2"])
    import torch
    from transformers import AutoModelForCausalLM

    trained = result["trained"]
    model = AutoModelForCausalLM.from_pretrained(str(trained_dir), dtype=torch.float32)
    with torch.no_grad():
        expected = model(torch.tensor([IDS])).logits[0]
    after = torch.tensor(trained["logits"])
    err = float((after - expected).abs().max())
    # the weights moved (lr 0.01, 2 Adam steps): the source folder's logits differ by far more
    source = AutoModelForCausalLM.from_pretrained(models["qwen3"], dtype=torch.float32)
    with torch.no_grad():
        moved = float((source(torch.tensor([IDS])).logits[0] - after).abs().max())
    assert err <= 1e-5 and moved > 1e-2, (err, moved)
    assert sorted(os.listdir(trained_dir)) == ["config.json", "generation_config.json", "model.safetensors"]
    print(f"HF checks: {elapsed:.1f}s; " + "; ".join(
        f"{f} logits {result['checks'][f]['DP2']['logits_max_abs']:.1e}" for f in FAMILIES)
        + f"; trained export vs megatron-core logits {err:.1e} (moved {moved:.2f})")


LAYOUTS = {
    "1": (1, []),
    "DP2": (2, []),
    "TP2": (2, ["--tensor-model-parallel-size", "2"]),
    "EP2": (2, ["--expert-model-parallel-size", "2"]),
    "PP2": (2, ["--pipeline-model-parallel-size", "2"]),
    "PP2-VPP2": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
}


def _layouts(family: str) -> list:
    names = ["1", "DP2", "EP2" if family == "qwen3_moe" else "TP2", "PP2"]
    return names + (["PP2-VPP2"] if family == "qwen3" else [])


def test_iteration_one_equals_the_transformers_float64_reference(models, rollouts, reference, tmp_path):
    """Every family x layout x mode: iteration 1's objective, weight and pre-clip gradient norm
    against transformers in float64 on the same rollout file. 2 launches (1 and 2 ranks)."""
    runs = {1: [], 2: []}
    for family in FAMILIES:
        for layout in _layouts(family):
            nproc, flags = LAYOUTS[layout]
            for mode, extra in MODES.items():
                name = f"{family}-{layout}-{mode}"
                runs[nproc].append({"name": name, "family": family, "layout": layout, "mode": mode, "argv": [
                    "--hf-model", models[family], "--rollouts", rollouts, "--train-iters", "1",
                    "--pg-loss-aggregation", mode, *extra, *flags, "--metrics-file", str(tmp_path / f"{name}.jsonl")]})
    worst = {}
    for nproc, batch in runs.items():
        spec, status = tmp_path / f"runs{nproc}.json", tmp_path / f"status{nproc}.json"
        spec.write_text(json.dumps(batch))
        rc, log, elapsed = run(torchrun(nproc, *RUNS, spec, status), 900, f"HF runs on {nproc} rank(s)")
        assert rc == 0, log[-20000:]
        assert json.loads(status.read_text()) == {r["name"]: 0 for r in batch}, log[-20000:]
        print(f"{len(batch)} HF runs on {nproc} rank(s): {elapsed:.1f}s")
    for batch in runs.values():
        for r in batch:
            family, layout, mode = r["family"], r["layout"], r["mode"]
            record = [json.loads(line) for line in open(tmp_path / f"{r['name']}.jsonl")][0]
            ref = reference[family][mode]
            assert record["iteration"] == 1 and record["weight"] == ref["weight"], (r["name"], record, ref)
            obj_err = abs(record["objective"] - ref["objective"]) / max(abs(ref["objective"]), 1e-2)
            norm_err = abs(record["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
            assert obj_err <= 2e-6 and norm_err <= 2e-5, (r["name"], obj_err, norm_err, record, ref)
            key = (family, layout)
            worst[key] = (max(worst.get(key, (0, 0))[0], obj_err), max(worst.get(key, (0, 0))[1], norm_err))
    for (family, layout), (obj_err, norm_err) in sorted(worst.items()):
        print(f"{family} {layout}: objective {obj_err:.1e}, grad_norm {norm_err:.1e} (worst over the 4 modes)")


def test_acceptance_command_trains_qwen3_and_writes_an_hf_folder(models, rollouts, reference, tmp_path):
    """The issue's command: 2 ranks, prompt_mean, --save-hf (every iteration and at the end)."""
    metrics, out = tmp_path / "metrics.jsonl", tmp_path / "qwen3-trained"
    rc, log, elapsed = run(torchrun(2, TRAIN, "--hf-model", models["qwen3"], "--rollouts", rollouts,
                                    "--pg-loss-aggregation", "prompt_mean", "--save-hf", out, "--save-hf-interval", 1,
                                    "--train-iters", 2, "--metrics-file", metrics), 300, "HF acceptance command")
    assert rc == 0, log[-20000:]
    first = json.loads(open(metrics).readline())
    ref = reference["qwen3"]["prompt_mean"]
    assert first["weight"] == ref["weight"]
    assert abs(first["objective"] - ref["objective"]) <= 2e-6 * max(abs(ref["objective"]), 1e-2)
    assert log.count("wrote the HF folder") == 2, log[-5000:]  # after iterations 1 and 2, none twice
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert leftovers == [], leftovers
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.model_type == "qwen3" and next(model.parameters()).dtype == torch.float32
    print(f"HF acceptance command: {elapsed:.1f}s")


def test_bad_folders_and_conflicting_flags_are_refused(models, tmp_path):
    """Exit 2 naming the file and the tensor (missing and extra weights: Megatron-Bridge alone would
    warn and train a random tensor), the flag and both values (shape conflicts, all at once), or
    the reason (not a causal LM, no safetensors)."""
    import torch
    from safetensors.torch import load_file, save_file

    bad = {}
    for kind in ("missing", "extra"):
        folder = tmp_path / kind
        folder.mkdir()
        for name in os.listdir(models["qwen3"]):
            (folder / name).write_bytes((open(os.path.join(models["qwen3"], name), "rb")).read())
        tensors = load_file(folder / "model.safetensors")
        if kind == "missing":
            del tensors["model.layers.1.self_attn.k_norm.weight"]
        else:
            tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(3)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        bad[kind] = folder
    not_lm = tmp_path / "encoder"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(open(os.path.join(models["qwen3"], "config.json")).read())
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    cases = [
        (2, ["--hf-model", bad["missing"], "--pipeline-model-parallel-size", "2"],
         ["the weights lack 1 tensor(s)", "model.layers.1.self_attn.k_norm.weight", "model.safetensors"], []),
        (1, ["--hf-model", bad["extra"]],
         ["model.layers.0.mlp.extra_proj.weight (in model.safetensors)", "belong to no parameter"], []),
        # every conflict at once; an explicit flag equal to the config's value is none (the heads)
        (1, ["--hf-model", models["qwen3"], "--num-layers", "2", "--hidden-size", "32", "--vocab-size", "256",
             "--num-attention-heads", "4"],
         ["--num-layers 2 disagrees", "num_layers = 4", "--hidden-size 32 disagrees", "hidden_size = 64",
          "--vocab-size 256 disagrees", "vocab_size = 128"], ["--num-attention-heads"]),
        (1, ["--hf-model", not_lm], ["not a causal LM", "BertModel"], []),
        (1, ["--hf-model", no_weights], ["no safetensors weights", "pytorch_model.bin"], []),
        (1, ["--save-hf", tmp_path / "x"], ["--save-hf needs --hf-model"], []),
    ]
    for nproc, argv, words, absent in cases:
        cmd = torchrun(nproc, TRAIN, *argv, "--metrics-file", tmp_path / "m.jsonl") if nproc > 1 else \
            [sys.executable, str(TRAIN), *map(str, argv), "--metrics-file", str(tmp_path / "m.jsonl")]
        rc, log, _ = run(cmd, 300, f"refused {argv[:2]}")
        assert rc != 0 and "refusing to start" in log, (argv, log[-5000:])
        if nproc == 1:
            assert rc == 2, (argv, rc)
        for word in words:
            assert word in log, (word, log[-5000:])
        refusal = log[log.index("refusing to start"):]
        for word in absent:
            assert word not in refusal, (word, refusal[:3000])


BRIDGE_TRAIN = ROOT / "launch" / "train_bridge_actor.py"


def test_megatron_bridge_loop_equals_the_trainer(models, rollouts, reference, tmp_path):
    """launch/train_bridge_actor.py (Megatron-Bridge's own pretrain loop, optimizer and scheduler,
    with the project's forward step) against the trainer, on DP2 and TP2, 2 iterations of
    prompt_mean: the same objective, weight and grad norm (the second iteration also checks that
    both took the same Adam step); iteration 1 also against transformers in float64."""
    common = ["--hf-model", models["qwen3"], "--rollouts", rollouts, "--pg-loss-aggregation", "prompt_mean",
              "--train-iters", "2", "--lr", "0.01"]
    layouts = {"DP2": [], "TP2": ["--tensor-model-parallel-size", "2"]}
    trainer_runs = [{"name": f"trainer-{name}", "argv": [*common, *flags, "--metrics-file",
                                                          str(tmp_path / f"trainer-{name}.jsonl")]}
                    for name, flags in layouts.items()]
    spec, status = tmp_path / "runs.json", tmp_path / "status.json"
    spec.write_text(json.dumps(trainer_runs))
    rc, log, _ = run(torchrun(2, *RUNS, spec, status), 600, "trainer runs")
    assert rc == 0 and json.loads(status.read_text()) == {r["name"]: 0 for r in trainer_runs}, log[-20000:]
    for name, flags in layouts.items():
        metrics = tmp_path / f"bridge-{name}.jsonl"
        rc, log, elapsed = run(torchrun(2, BRIDGE_TRAIN, *common, *flags, "--metrics-file", metrics), 600,
                               f"Bridge loop {name}")
        assert rc == 0, log[-20000:]
        bridge = [json.loads(line) for line in open(metrics)]
        trainer = [r for r in map(json.loads, open(tmp_path / f"trainer-{name}.jsonl")) if not r.get("final")]
        assert [r["iteration"] for r in bridge] == [r["iteration"] for r in trainer] == [1, 2]
        for b, t in zip(bridge, trainer):
            assert b["weight"] == t["weight"] and b["rollout_step"] == t["rollout_step"], (b, t)
            obj_err = abs(b["objective"] - t["objective"]) / max(abs(t["objective"]), 1e-2)
            norm_err = abs(b["grad_norm"] - t["grad_norm"]) / t["grad_norm"]
            assert obj_err <= 1e-6 and norm_err <= 1e-5, (name, b, t)
        ref = reference["qwen3"]["prompt_mean"]
        assert bridge[0]["weight"] == ref["weight"]
        assert abs(bridge[0]["objective"] - ref["objective"]) <= 2e-6 * max(abs(ref["objective"]), 1e-2)
        assert abs(bridge[0]["grad_norm"] - ref["grad_norm"]) <= 2e-5 * ref["grad_norm"]
        print(f"Bridge loop {name}: {elapsed:.1f}s; vs trainer objective "
              f"{max(abs(b['objective'] - t['objective']) for b, t in zip(bridge, trainer)):.1e}, grad_norm "
              f"{max(abs(b['grad_norm'] - t['grad_norm']) / t['grad_norm'] for b, t in zip(bridge, trainer)):.1e}")
