"""Hugging Face models through Megatron-Bridge: --hf-model / --save-hf in the trainer, on CPU.

Tiny Llama, Qwen2, Qwen3 and Qwen3-MoE models are made locally by the project's own command
(``python -m megatron_pg_agg.integrations.bridge.tiny_hf``, transformers' ``save_pretrained``). Expected
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

from megatron_pg_agg.data.output_folder import MARKER
from tests.support.launching import ROOT, child_env, run, torchrun, worker
from tests.support.optional import REQUIRE_BRIDGE, require
from tests.support.records import first_step, trainer_records

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
TIED = "qwen3_tied"  # tie_word_embeddings (as Qwen3's small models): one weight, across PP stages too
MODES = {"token_mean": [], "seq_mean": [], "prompt_mean": [],
         "constant": ["--pg-loss-aggregation-divisor", "7"]}
POLICY_LOSSES = {f"{loss}-prompt_mean": ["--pg-policy-loss", loss, "--pg-loss-aggregation", "prompt_mean"]
                 for loss in ("gspo", "gmpo", "cispo")}
CHECKS, REFERENCE, RUNS = worker("hf_checks"), worker("hf_reference"), worker("trainer_runs")
TRAIN = ROOT / "launch" / "train_actor.py"
IDS = [3, 17, 99, 5, 64, 1, 127, 42, 8, 23, 77, 0, 64]

pytestmark = pytest.mark.optional_stack  # .ci/run: after installing the stack


def _bridge_problem():
    from megatron_pg_agg.integrations.bridge.hf_folder import bridge_install_problem

    return bridge_install_problem()


@pytest.fixture(scope="module", autouse=True)
def _bridge_installed():
    require(_bridge_problem(), REQUIRE_BRIDGE)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``{family: folder}``: tiny models made by the project's command (4 layers: PP2 with virtual stages)."""
    root = tmp_path_factory.mktemp("hf")
    made = {}
    for name in (*FAMILIES, TIED):
        out = root / name
        family, tie = (name, []) if name != TIED else ("qwen3", ["--tie-word-embeddings"])
        rc, log, _ = run([sys.executable, "-m", "megatron_pg_agg.integrations.bridge.tiny_hf", "--family", family,
                          "--seed", "3", *tie, str(out)], 120, f"tiny {name}", env=child_env())
        assert rc == 0, log[-5000:]
        made[name] = str(out)
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
    variants = {**{mode: ["--pg-loss-aggregation", mode, *extra] for mode, extra in MODES.items()}, **POLICY_LOSSES}
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
        "trained": {"argv": ["--hf-model", models["qwen3"], "--rollouts", "synthetic",
                             "--tensor-model-parallel-size", "2", "--metrics-file", str(tmp_path / "m.jsonl"),
                             "--lr", "0.01"],
                    "iterations": 2, "out": str(trained_dir)}}))
    rc, log, elapsed = run(torchrun(2, *CHECKS, spec, out), 600, "HF checks")
    assert rc == 0, log[-20000:]
    result = json.loads(out.read_text())
    for family in (*FAMILIES, TIED):
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
    assert sorted(os.listdir(trained_dir)) == [MARKER, "config.json", "generation_config.json", "model.safetensors"]
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
    if family == TIED:
        return ["TP2", "PP2"]  # the shared weight split over TP, and held by both PP stages
    names = ["1", "DP2", "EP2" if family == "qwen3_moe" else "TP2", "PP2"]
    return names + (["PP2-VPP2"] if family == "qwen3" else [])


MOE_AUX = "qwen3_moe-EP2-aux"
BRIDGE_COMMON = ["--pg-loss-aggregation", "prompt_mean", "--train-iters", "2", "--lr", "0.01"]
BRIDGE_CASES = {
    # name: (family, layout flags of both runs, flags of the trainer's run only)
    "qwen3-DP2": ("qwen3", [], []),
    "qwen3-TP2": ("qwen3", ["--tensor-model-parallel-size", "2"], []),
    "llama-DP2": ("llama", [], []),
    "qwen2-DP2": ("qwen2", [], []),
    # Megatron-Bridge's Qwen3-MoE provider sets moe_aux_loss_coeff 0.001 (and the alltoall
    # dispatcher); the trainer takes --moe-aux-loss-coeff (default 0), so its twin is given Bridge's
    "qwen3_moe-DP2": ("qwen3_moe", [], ["--moe-aux-loss-coeff", "0.001", "--moe-token-dispatcher-type", "alltoall"]),
}


@pytest.fixture(scope="module")
def trainer_runs(models, rollouts, tmp_path_factory):
    """Every trainer run of the module in two launches (1 and 2 ranks; workers/trainer_runs.py):
    ``{name: {"run": the run, "records": its metrics records, "log": its launch's output}}``.

    Iteration 1 of every family x layout x mode, and of every policy loss on Qwen3 (DP2, TP2);
    Qwen3-MoE with the router aux loss (2 iterations); the runs Megatron-Bridge's loop is compared
    with (Qwen3, DP2 and TP2, 2 iterations); three refused starts (status 2: missing and extra
    tensors, shape conflicts)."""
    tmp = tmp_path_factory.mktemp("trainer_runs")
    runs = {1: [], 2: []}

    def add(name, family, layout, variant, flags, iterations=1):
        nproc, layout_flags = LAYOUTS[layout]
        runs[nproc].append({"name": name, "family": family, "layout": layout, "mode": variant, "argv": [
            "--hf-model", models[family], "--rollouts", rollouts, "--train-iters", str(iterations), *flags,
            *layout_flags, "--metrics-file", str(tmp / f"{name}.jsonl")]})

    for family in (*FAMILIES, TIED):
        for layout in _layouts(family):
            for mode, extra in MODES.items():
                add(f"{family}-{layout}-{mode}", family, layout, mode, ["--pg-loss-aggregation", mode, *extra])
    for layout in ("DP2", "TP2"):  # every policy loss, on the Qwen3 model
        for variant, flags in POLICY_LOSSES.items():
            add(f"qwen3-{layout}-{variant}", "qwen3", layout, variant, flags)
    add(MOE_AUX, "qwen3_moe", "EP2", "aux", ["--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type",
                                              "alltoall", "--pg-loss-aggregation", "seq_mean"], iterations=2)
    for case, (family, flags, trainer_flags) in BRIDGE_CASES.items():
        runs[2].append({"name": f"bridge-twin-{case}", "argv": [
            "--hf-model", models[family], "--rollouts", rollouts, *BRIDGE_COMMON, *flags, *trainer_flags,
            "--metrics-file", str(tmp / f"bridge-twin-{case}.jsonl")]})
    bad = _bad_folders(models, tmp)
    for name, (flags, _) in REFUSED.items():
        folder = models["qwen3"] if name == "refused-conflicts" else bad[name.split("-")[1]]
        runs[2].append({"name": name, "expect": 2, "argv": [
            "--hf-model", folder, "--rollouts", rollouts, *flags, "--metrics-file", str(tmp / f"{name}.jsonl")]})
    done = {}
    for nproc, batch in runs.items():
        spec, status = tmp / f"runs{nproc}.json", tmp / f"status{nproc}.json"
        spec.write_text(json.dumps(batch))
        rc, log, elapsed = run(torchrun(nproc, *RUNS, spec, status), 900, f"HF runs on {nproc} rank(s)")
        assert rc == 0, log[-20000:]
        assert json.loads(status.read_text()) == {r["name"]: r.get("expect", 0) for r in batch}, log[-20000:]
        print(f"{len(batch)} HF trainer runs on {nproc} rank(s): {elapsed:.1f}s")
        for r in batch:
            path = tmp / f"{r['name']}.jsonl"
            done[r["name"]] = {"run": r, "records": trainer_records(path)[0] if path.exists() else [], "log": log}
    return done


def test_iteration_one_equals_the_transformers_float64_reference(trainer_runs, reference):
    """Every family x layout x mode (and every policy loss on Qwen3): iteration 1's objective,
    weight and pre-clip gradient norm against transformers in float64 on the same rollout file."""
    worst = {}
    checked = [r for r in trainer_runs.values() if r["run"].get("family") and r["run"]["name"] != MOE_AUX]
    assert len(checked) == 16 + 4 * 3 * 4 + 4 + 2 * 4 + 2 * 3
    for done in checked:
        family, layout, mode = done["run"]["family"], done["run"]["layout"], done["run"]["mode"]
        record, ref = done["records"][0], reference[family][mode]
        assert record["iteration"] == 1 and record["weight"] == ref["weight"], (done["run"]["name"], record, ref)
        # the objective against max(|J|, 0.5): its terms have |A| ~ 1 and may cancel to a small J
        obj_err = abs(record["objective"] - ref["objective"]) / max(abs(ref["objective"]), 0.5)
        norm_err = abs(record["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
        assert obj_err <= 1e-6 and norm_err <= 2e-5, (done["run"]["name"], obj_err, norm_err, record, ref)
        key = (family, layout)
        worst[key] = (max(worst.get(key, (0, 0))[0], obj_err), max(worst.get(key, (0, 0))[1], norm_err))
    for (family, layout), (obj_err, norm_err) in sorted(worst.items()):
        print(f"{family} {layout}: objective {obj_err:.1e}, grad_norm {norm_err:.1e} (worst over its runs)")


def test_a_moe_checkpoint_trains_with_megatrons_router_aux_loss(trainer_runs):
    """Qwen3-MoE with --moe-aux-loss-coeff on DP2 x EP2: the moe_aux_loss patch keeps the router loss
    at Megatron's strength (it refuses a step without its factor), reported as [sum, count] pairs
    over 4 MoE layers x 2 microbatches x 2 DP ranks, near 1 for a balanced router (coefficient x
    E x sum f P ~ 1 at uniform routing), as for a model built from flags."""
    done = trainer_runs[MOE_AUX]
    # the one run of its launch with the alltoall dispatcher
    assert "experts=4 top2 EP=2 dispatcher=alltoall" in done["log"], done["log"][-5000:]
    assert len(done["records"]) == 2
    for r in done["records"]:
        total, count = r["moe_aux_loss"]
        assert count == 4 * 2 * 2 and 0.9 < total / count < 1.5, r
        assert r["grad_norm"] > 0 and not r["skipped"]
    shown = [round(r["moe_aux_loss"][0] / r["moe_aux_loss"][1], 4) for r in done["records"]]
    print(f"HF MoE aux loss per iteration {shown}")


def test_acceptance_command_trains_qwen3_and_writes_an_hf_folder(models, rollouts, reference, tmp_path):
    """The issue's command: 2 ranks, prompt_mean, --save-hf (every iteration and at the end)."""
    metrics, out = tmp_path / "metrics.jsonl", tmp_path / "qwen3-trained"
    source = tmp_path / "qwen3-with-tokenizer"
    source.mkdir()
    for name in os.listdir(models["qwen3"]):
        (source / name).write_bytes(open(os.path.join(models["qwen3"], name), "rb").read())
    (source / "tokenizer_config.json").write_text('{"model_max_length": 256}')  # copied to every written folder
    rc, log, elapsed = run(torchrun(2, TRAIN, "--hf-model", source, "--rollouts", rollouts,
                                    "--pg-loss-aggregation", "prompt_mean", "--save-hf", out, "--save-hf-interval", 1,
                                    "--train-iters", 2, "--metrics-file", metrics), 300, "HF acceptance command")
    assert rc == 0, log[-20000:]
    first = first_step(metrics)
    ref = reference["qwen3"]["prompt_mean"]
    assert first["weight"] == ref["weight"]
    assert abs(first["objective"] - ref["objective"]) <= 1e-6 * max(abs(ref["objective"]), 0.5)
    assert log.count("wrote the HF folder") == 2, log[-5000:]  # after iterations 1 and 2, none twice
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert leftovers == [], leftovers
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 256}'
    assert sorted(os.listdir(out)) == [MARKER, "config.json", "generation_config.json", "model.safetensors",
                                       "tokenizer_config.json"]
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.model_type == "qwen3" and next(model.parameters()).dtype == torch.float32
    print(f"HF acceptance command: {elapsed:.1f}s")


def _bad_folders(models, tmp) -> dict:
    """Copies of the Qwen3 folder with one tensor missing and one extra, a non-causal-LM folder and
    one with only a .bin checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    bad = {}
    for kind in ("missing", "extra"):
        folder = tmp / kind
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
    bad["not_lm"] = tmp / "encoder"
    bad["not_lm"].mkdir()
    (bad["not_lm"] / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    bad["no_weights"] = tmp / "no-weights"
    bad["no_weights"].mkdir()
    (bad["no_weights"] / "config.json").write_text(open(os.path.join(models["qwen3"], "config.json")).read())
    (bad["no_weights"] / "pytorch_model.bin").write_bytes(b"")
    return {k: str(v) for k, v in bad.items()}


REFUSED = {
    # name: (what the run is given, what the refusal must name)
    "refused-missing": (["--pipeline-model-parallel-size", "2"],
                        ["the weights lack 1 tensor(s)", "model.layers.1.self_attn.k_norm.weight",
                         "(looked in ['model.safetensors'])"]),
    "refused-extra": ([], ["model.layers.0.mlp.extra_proj.weight (in model.safetensors)", "belong to no parameter"]),
    # every conflict at once; an explicit flag equal to the config's value is none (the heads)
    "refused-conflicts": (["--num-layers", "2", "--hidden-size", "32", "--vocab-size", "256",
                           "--num-attention-heads", "4"],
                          ["--num-layers 2 disagrees", "num_layers = 4", "--hidden-size 32 disagrees",
                           "hidden_size = 64", "--vocab-size 256 disagrees", "vocab_size = 128"]),
}


def test_bad_folders_and_conflicting_flags_are_refused(models, trainer_runs, tmp_path):
    """Exit 2 naming the file and the tensor (missing and extra weights: Megatron-Bridge alone would
    warn and train a random tensor), the flag and both values (shape conflicts, all at once), or
    the reason (not a causal LM, no safetensors, a family whose attention the trainer does not
    implement). The first three ran in the trainer batch (status
    2 each, checked there); the others stop before Megatron-Bridge builds a model."""
    log = trainer_runs["refused-missing"]["log"]
    for name, (_, words) in REFUSED.items():
        for word in words:
            assert word in log, (name, word, log[-5000:])
    assert "--num-attention-heads 4 disagrees" not in log
    bad = _bad_folders(models, tmp_path)
    import transformers

    gemma2 = tmp_path / "gemma2"  # a family Megatron-Bridge maps, with sliding-window attention
    transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=32)).save_pretrained(gemma2)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    source_files = {n: open(os.path.join(models["qwen3"], n), "rb").read() for n in os.listdir(models["qwen3"])}
    cases = [
        (["--hf-model", gemma2], ["family 'gemma2' uses sliding-window attention", "THD core attention"]),
        (["--hf-model", bad["not_lm"]], ["not a causal LM", "BertModel"]),
        (["--hf-model", bad["no_weights"]], ["no safetensors weights", "pytorch_model.bin"]),
        (["--save-hf", tmp_path / "x"], ["--save-hf needs --hf-model"]),
        # a user's folder, a file, and the source model itself: refused before any training
        (["--hf-model", models["qwen3"], "--save-hf", mine], [f"--save-hf {mine} is a folder that is not empty"]),
        (["--hf-model", models["qwen3"], "--save-hf", mine / "notes.txt"], ["is a file, not a folder"]),
        (["--hf-model", models["qwen3"], "--save-hf", models["qwen3"]],
         [f"--save-hf {models['qwen3']} is --hf-model {models['qwen3']}: the output would replace it"]),
    ]
    for argv, words in cases:
        rc, out, _ = run([sys.executable, str(TRAIN), "--rollouts", "synthetic", *map(str, argv), "--metrics-file",
                          str(tmp_path / "m.jsonl")],
                         300, f"refused {argv[:2]}", env=child_env())
        assert rc == 2 and "refusing to start" in out, (argv, rc, out[-5000:])
        for word in words:
            assert word in out, (word, out[-5000:])
    assert (mine / "notes.txt").read_text() == "my notes" and os.listdir(mine) == ["notes.txt"]
    assert {n: open(os.path.join(models["qwen3"], n), "rb").read() for n in os.listdir(models["qwen3"])} == source_files
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


BRIDGE_TRAIN = ROOT / "launch" / "train_bridge_actor.py"


def test_megatron_bridge_loop_equals_the_trainer(models, rollouts, reference, trainer_runs, tmp_path):
    """launch/train_bridge_actor.py (Megatron-Bridge's own pretrain loop, optimizer and scheduler,
    with the project's forward step) against the trainer, every family on DP2 and Qwen3 on TP2, 2
    iterations of prompt_mean: the same objective, weight and grad norm (the second iteration also
    checks that both took the same Adam step); iteration 1 of the dense models also against
    transformers in float64 (the MoE run has Bridge's router aux loss, which the reference lacks)."""
    for name, (family, flags, _) in BRIDGE_CASES.items():
        metrics = tmp_path / f"bridge-{name}.jsonl"
        rc, log, elapsed = run(torchrun(2, BRIDGE_TRAIN, "--hf-model", models[family], "--rollouts", rollouts,
                                        *BRIDGE_COMMON, *flags, "--metrics-file", metrics), 600, f"Bridge loop {name}")
        assert rc == 0, log[-20000:]
        bridge = [json.loads(line) for line in open(metrics)]
        trainer = trainer_runs[f"bridge-twin-{name}"]["records"]
        assert [r["iteration"] for r in bridge] == [r["iteration"] for r in trainer] == [1, 2]
        for b, t in zip(bridge, trainer):
            assert b["weight"] == t["weight"] and b["rollout_step"] == t["rollout_step"], (b, t)
            obj_err = abs(b["objective"] - t["objective"]) / max(abs(t["objective"]), 0.5)
            norm_err = abs(b["grad_norm"] - t["grad_norm"]) / t["grad_norm"]
            assert obj_err <= 1e-6 and norm_err <= 1e-5, (name, b, t)
        ref = reference[family]["prompt_mean"]
        assert bridge[0]["weight"] == ref["weight"]
        assert abs(bridge[0]["objective"] - ref["objective"]) <= 1e-6 * max(abs(ref["objective"]), 0.5)
        if family != "qwen3_moe":
            assert abs(bridge[0]["grad_norm"] - ref["grad_norm"]) <= 2e-5 * ref["grad_norm"]
        print(f"Bridge loop {name}: {elapsed:.1f}s; vs trainer objective "
              f"{max(abs(b['objective'] - t['objective']) for b, t in zip(bridge, trainer)):.1e}, grad_norm "
              f"{max(abs(b['grad_norm'] - t['grad_norm']) / t['grad_norm'] for b, t in zip(bridge, trainer)):.1e}")


def test_readme_command_3_prints_the_projects_lines_and_the_documented_outside_ones(models, tmp_path):
    """README command 3's trainer as a user starts it (a real torchrun, fresh processes, every
    warning on): each line is the trainer's own (``[train] ``) or one of the documented outside
    lines (worker_process.OUTSIDE_LINES, docs/hf-models.md); no traceback, ERROR or config dump.
    With --verbose the outside lines come back (Megatron-Bridge's import probe, the DDP config).
    Catches a new library message, or the quiet switch lost on this path."""
    import re

    from megatron_pg_agg.training.worker_process import OUTSIDE_LINES

    env = child_env()
    env.pop("PYTHONWARNINGS", None)
    out_dir = tmp_path / "trained"
    rc, out, _ = run(torchrun(2, TRAIN, "--hf-model", models["qwen3"], "--rollouts", "synthetic",
                              "--pg-loss-aggregation", "prompt_mean",
                              "--train-iters", 2, "--save-hf", out_dir, "--metrics-file", tmp_path / "m.jsonl"),
                     400, "README command 3, quiet", env=env, fresh=True)
    assert rc == 0, out[-20000:]
    allowed = [re.compile(pattern) for pattern, _ in OUTSIDE_LINES]
    foreign = [line for line in out.splitlines() if line.strip() and not line.startswith("[train] ")
               and not any(p.match(line) for p in allowed)]
    assert not foreign, foreign[:20]
    assert "[train] done: 2 iterations" in out and "wrote the HF folder" in out
    rc, loud, _ = run([sys.executable, str(TRAIN), "--hf-model", str(models["qwen3"]), "--rollouts", "synthetic",
                       "--train-iters", "1",
                       "--verbose", "--metrics-file", str(tmp_path / "v.jsonl")], 400, "README command 3, verbose",
                      env=env, fresh=True)
    assert rc == 0, loud[-20000:]
    assert "FP8GlobalStateManager" in loud and "DistributedDataParallelConfig" in loud, loud[-5000:]
