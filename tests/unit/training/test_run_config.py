"""The typed run config of launch/train_actor.py: flags map into the right fields, bad combinations
are refused in one list with the documented messages, and every field of the tree is documented."""
import ast
import dataclasses
import inspect
import os
import textwrap
import typing

import pytest

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.training import run_config
from megatron_pg_agg.training.run_config import (
    DataConfig,
    OnlineConfig,
    RunConfig,
    StartupError,
    build_parser,
    parse_flags,
)


def _cfg(*argv) -> RunConfig:
    return RunConfig.from_args(build_parser().parse_args(["--rollouts", "synthetic", *map(str, argv)]))


@pytest.fixture(autouse=True)
def _supported_megatron_core(monkeypatch):
    # these tests are about the flags, not the installed megatron-core
    monkeypatch.setattr(run_config, "installed_megatron_core_version", lambda: "0.16.1")


def test_defaults_resolve_as_the_flags_document():
    cfg = _cfg()
    assert cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size == 256
    assert cfg.data == DataConfig(rollouts=None, max_tokens_per_microbatch=None, num_microbatches=2)
    assert cfg.logging.metrics_file == os.path.join("runs", "train_actor", "metrics.jsonl")
    assert cfg.parallel.calculate_per_token_loss and not cfg.model.moe.enabled
    assert cfg.virtual_pipeline_size is None
    assert cfg.loss == PGLossConfig()
    # the dataclass defaults are the flags' defaults (one exception: the data config's microbatch
    # count, which the flags set to 2 when no token cap is given): catches a default changed in
    # one place only (mutants: ffn_hidden_size, untie_embeddings_and_output_weights, batch_p2p_comm)
    assert dataclasses.replace(RunConfig(), data=cfg.data) == cfg


def test_flags_land_in_their_fields():
    cfg = _cfg("--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2, "--num-layers", 8,
               "--num-layers-per-virtual-pipeline-stage", 2, "--context-parallel-size", 1,
               "--ffn-hidden-size", 96, "--bf16", "--num-experts", 4, "--moe-router-topk", 3,
               "--expert-model-parallel-size", 2, "--moe-token-dispatcher-type", "alltoall",
               "--max-tokens-per-microbatch", 512, "--save", "ck", "--save-interval", 5, "--lr", 0.5,
               "--pg-loss-aggregation", "constant", "--pg-loss-aggregation-divisor", 64,
               "--pg-kl-coef", 0.1, "--pg-skip-nonfinite-steps", "--no-calculate-per-token-loss")
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.ep) == (2, 2, 1, 2)
    assert cfg.parallel.model_parallel_size == 4 and cfg.parallel.dp_size(8) == 2
    assert cfg.virtual_pipeline_size == 2  # 8 layers / PP 2 / 2 per virtual stage
    assert cfg.model.ffn_hidden_size == 96 and cfg.model.bf16
    assert (cfg.model.moe.num_experts, cfg.model.moe.router_topk, cfg.model.moe.token_dispatcher_type) == (
        4, 3, "alltoall")
    # a token cap sets no microbatch count
    assert (cfg.data.max_tokens_per_microbatch, cfg.data.num_microbatches) == (512, None)
    assert (cfg.checkpoint.save, cfg.checkpoint.save_interval) == ("ck", 5)
    assert cfg.logging.metrics_file == os.path.join("ck", "metrics.jsonl")
    assert cfg.training.lr == 0.5 and cfg.training.skip_nonfinite_steps
    assert (cfg.loss.mode, cfg.loss.divisor, cfg.loss.kl_coef) == ("constant", 64.0, 0.1)
    assert not cfg.parallel.calculate_per_token_loss


def test_the_config_is_frozen():
    cfg = _cfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.train_iters = 3


def test_every_problem_is_listed_in_one_refusal(tmp_path):
    cfg = _cfg("--train-iters", 0, "--save-interval", 2, "--tensor-model-parallel-size", 3,
               "--load", tmp_path / "missing", "--no-calculate-per-token-loss")
    with pytest.raises(StartupError) as err:
        cfg.validate(4, backend="gloo", te=False)
    message = str(err.value)
    assert message.startswith("refusing to start:\n- ")
    for expected in ("world size 4 is not divisible by TP x PP x CP = 3 x 1 x 1 = 3",
                     "--num-attention-heads 4 must divide --hidden-size 64 and be divisible by TP=3",
                     "calculate_per_token_loss off gives a mean of microbatch means",
                     "--save-interval needs --save and a value >= 1",
                     "--train-iters must be >= 1",
                     f"--load {tmp_path / 'missing'}: no such directory"):
        assert f"\n- {expected}" in message, message
    assert cfg.startup_problems(4, backend="gloo", te=False) == message.split("\n- ")[1:]


def test_device_dependent_refusals_follow_backend_and_te():
    cfg = _cfg("--bf16", "--tensor-model-parallel-size", 2, "--sequence-parallel")
    cpu = cfg.startup_problems(2, backend="gloo", te=False)
    assert [p for p in cpu if "--bf16" in p] == []  # bf16 runs on CPU (the optimizer_cpu stand-in)
    assert any(p.startswith("--sequence-parallel needs Transformer Engine") for p in cpu)
    assert cfg.startup_problems(2, backend="nccl", te=True) == []


def test_the_production_flags_are_parsed_with_megatron_lm_meanings():
    """--bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather reach the typed
    config and pass; the DDP settings are Megatron-LM's (fp32 main gradients, the parameter gather
    aligned only under the interleaved schedule, one bucket without the overlap)."""
    from megatron_pg_agg.training.trainer import ddp_config

    flags = ("--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
    cfg = _cfg(*flags, "--ddp-bucket-size", 5000)
    par = cfg.parallel
    assert cfg.model.bf16 and not cfg.model.fp16
    assert (par.use_distributed_optimizer, par.overlap_grad_reduce, par.overlap_param_gather) == (True, True, True)
    assert cfg.startup_problems(2, backend="gloo", te=False) == []
    ddp = ddp_config(cfg)
    assert (ddp.use_distributed_optimizer, ddp.overlap_grad_reduce, ddp.overlap_param_gather) == (True, True, True)
    assert ddp.grad_reduce_in_fp32 and ddp.bucket_size == 5000 and not ddp.align_param_gather
    assert not ddp.average_in_collective  # the per-token contract: DP sums, the weight divides
    interleaved = _cfg(*flags, "--pipeline-model-parallel-size", 2, "--num-layers", 4,
                       "--num-layers-per-virtual-pipeline-stage", 1)
    assert ddp_config(interleaved).align_param_gather
    plain = ddp_config(_cfg())
    assert plain.bucket_size is None and not (plain.use_distributed_optimizer or plain.overlap_grad_reduce)


@pytest.mark.parametrize("flags, words", [
    (("--fp16",), ["--fp16 is not supported", "loss scale", "use --bf16"]),
    (("--fp16", "--bf16"), ["--bf16 and --fp16 exclude each other"]),
    (("--overlap-param-gather", "--overlap-grad-reduce"), ["--overlap-param-gather needs --use-distributed-optimizer"]),
    (("--overlap-param-gather", "--use-distributed-optimizer"),
     ["needs --use-distributed-optimizer and --overlap-grad-reduce"]),
    (("--ddp-bucket-size", "100"), ["--ddp-bucket-size needs --overlap-grad-reduce"]),
    (("--ddp-bucket-size", "0", "--overlap-grad-reduce"), ["a value >= 1"]),
])
def test_precision_and_ddp_combinations_megatron_lm_refuses_are_refused(flags, words):
    problems = _cfg(*flags).startup_problems(2, backend="gloo", te=False)
    joined = "\n".join(problems)
    assert all(w in joined for w in words), problems
    assert all(any(f in p for f in flags if f.startswith("--")) for p in problems), problems  # nothing else


def test_a_valid_run_passes():
    _cfg("--num-microbatches", 3).validate(2, backend="gloo", te=False)


def test_a_bad_loss_combination_is_refused_by_the_parser_and_by_from_args():
    with pytest.raises(SystemExit) as err:  # argparse's usage error, status 2
        build_parser().parse_args(["--pg-loss-aggregation", "constant"])
    assert err.value.code == 2
    namespace = build_parser().parse_args(["--rollouts", "synthetic"])
    namespace.pg_clip_eps = 2.0  # what the parser would have refused
    with pytest.raises(StartupError, match=r"refusing to start:\n- clip_eps_low must be in \(0, 1\)"):
        RunConfig.from_args(namespace)


def test_megatron_lm_data_config_reads_its_own_flag():
    import argparse

    data = DataConfig.from_megatron_lm_args(argparse.Namespace(pg_rollouts="r.jsonl", seq_length=4096))
    assert data == DataConfig(rollouts="r.jsonl", max_tokens_per_microbatch=4096)  # --seq-length caps a microbatch


def _config_classes(root=RunConfig):
    """Every dataclass in the tree under ``root`` (root included), each once."""
    found, todo = [], [root]
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):  # a dataclass, or an Optional one
            todo.extend(t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t))
    return found


def test_every_field_of_the_tree_has_a_docstring():
    classes = _config_classes()
    assert {c.__name__ for c in classes} >= {"RunConfig", "ModelConfig", "MoEConfig", "ParallelConfig",
                                             "PGLossConfig", "DataConfig", "TrainingConfig",
                                             "CheckpointConfig", "LoggingConfig", "OnlineConfig"}
    for cls in classes:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        documented = {
            stmt.target.id for stmt, after in zip(body, body[1:] + [None])
            if isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
            and after.value.value.strip()
        }
        missing = {f.name for f in dataclasses.fields(cls)} - documented
        assert not missing, f"{cls.__name__}: fields without a docstring: {sorted(missing)}"


@pytest.mark.parametrize("flags,world,expected", [
    (["--tensor-model-parallel-size", 0], 2, "--tensor-model-parallel-size must be >= 1"),
    (["--pipeline-model-parallel-size", 0], 2, "--pipeline-model-parallel-size must be >= 1"),
    (["--context-parallel-size", 0], 2, "--context-parallel-size must be >= 1"),
    (["--pipeline-model-parallel-size", 2], 3, "world size 3 is not divisible by TP x PP x CP = 1 x 2 x 1 = 2"),
    (["--num-layers", 3, "--pipeline-model-parallel-size", 2], 2,
     "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--num-layers-per-virtual-pipeline-stage", 1], 2,
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2"),
    (["--num-layers", 6, "--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 2], 2,
     "3 layers per pipeline stage are not divisible by --num-layers-per-virtual-pipeline-stage 2"),
    (["--num-layers", 4, "--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1,
      "--batch-p2p-comm"], 2, "the interleaved pipeline with --batch-p2p-comm on gloo"),
    (["--no-calculate-per-token-loss"], 2, "calculate_per_token_loss off gives a mean of microbatch means"),
    (["--num-attention-heads", 3], 2, "--num-attention-heads 3 must divide --hidden-size 64"),
    (["--vocab-size", 127, "--tensor-model-parallel-size", 2, "--sequence-parallel"], 2,
     "--vocab-size 127 must be divisible by TP=2"),
    (["--context-parallel-size", 2], 2, "--context-parallel-size > 1 needs Transformer Engine"),
    (["--save-interval", 2], 2, "--save-interval needs --save and a value >= 1"),
    (["--train-iters", 0], 2, "--train-iters must be >= 1"),
    (["--rollouts", "/nonexistent/steps.jsonl"], 2, "--rollouts /nonexistent/steps.jsonl: no such file"),
    (["--mtp-num-layers", 0], 2, "--mtp-num-layers 0 must be >= 1"),
    (["--mtp-num-layers", 1, "--mtp-loss-scaling-factor", 0], 2, "--mtp-loss-scaling-factor 0.0 must be > 0"),
    (["--mtp-loss-scaling-factor", 0.2], 2, "--mtp-loss-scaling-factor needs --mtp-num-layers"),
])
def test_each_trainer_refusal_alone(flags, world, expected):
    """One flag change, one problem, with the text that names the flag (the TE-dependent and
    --load/--bf16 ones are covered above). Each case catches its check deleted or reading another
    field; te=True where the case is not about TE, so only the change itself can refuse. The size-0
    cases also catch a divisibility check dividing by the size before it is refused."""
    about_te = expected.startswith("--context-parallel-size > 1")
    problems = _cfg(*flags).startup_problems(world, backend="gloo", te=not about_te)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_mtp_is_refused_on_megatron_core_0_15_with_the_reason(monkeypatch):
    """megatron-core 0.15 asserts MTP on packed sequences: the trainer refuses --mtp-num-layers
    there at start-up, naming why and the installed release; 0.16 accepts it. Catches the release
    check reading another range than the mtp_loss patch's."""
    assert _cfg("--mtp-num-layers", 2).startup_problems(2, backend="gloo", te=True) == []
    monkeypatch.setattr(run_config, "installed_megatron_core_version", lambda: "0.15.3")
    (problem,) = _cfg("--mtp-num-layers", 2).startup_problems(2, backend="gloo", te=True)
    assert "refuses multi-token prediction with packed sequences" in problem and "0.15.3" in problem
    assert _cfg().startup_problems(2, backend="gloo", te=True) == []  # no MTP: 0.15 is fine


def _save_hf_problems(tmp_path, out, *extra):
    """The start-up problems of an --hf-model run (its folder under tmp_path/models/qwen) saving to ``out``."""
    model = tmp_path / "models" / "qwen"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text("{}")
    cfg = _cfg("--save-hf", out, *extra)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_model=str(model)))
    return cfg.startup_problems(2, backend="gloo", te=True)


def test_save_hf_refuses_an_occupied_path_or_an_input_at_start_up(tmp_path):
    """--save-hf is checked before any training: a user's folder, a file, the source model, a
    checkpoint folder or the metrics file under it is refused by name, and nothing is touched.
    Catches the check dropped from startup_problems or given the wrong paths."""
    assert _save_hf_problems(tmp_path, tmp_path / "new") == []
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (problem,) = _save_hf_problems(tmp_path, mine)
    assert problem.startswith(f"--save-hf {mine} is a folder that is not empty (notes.txt)")
    (tmp_path / "file").write_text("keep")
    assert "is a file, not a folder" in _save_hf_problems(tmp_path, tmp_path / "file")[0]
    for out in (tmp_path / "models" / "qwen", tmp_path / "models" / "qwen" / "out", tmp_path / "models"):
        assert any("--hf-model" in p and "would replace it" in p for p in _save_hf_problems(tmp_path, out)), out
    (ckpt,) = _save_hf_problems(tmp_path, tmp_path / "ck" / "hf", "--save", tmp_path / "ck")
    assert ckpt.startswith(f"--save-hf {tmp_path / 'ck' / 'hf'} is inside --save {tmp_path / 'ck'}")
    (ckpt,) = _save_hf_problems(tmp_path, tmp_path / "new", "--metrics-file", tmp_path / "new" / "m.jsonl")
    assert "contains --metrics-file" in ckpt
    assert (mine / "notes.txt").read_text() == "keep" and (tmp_path / "file").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["file", "mine", "models"]


# ----------------------------------------------------------------------------- the online run


def _online(*argv) -> RunConfig:
    """The config of the trainer's own default: no --rollouts, online GRPO on the reach task."""
    return RunConfig.from_args(build_parser().parse_args([str(a) for a in argv]))


def test_without_rollouts_the_run_is_online_and_its_defaults_are_the_dataclasses():
    cfg = _online()
    assert cfg.online == OnlineConfig() and cfg.data.rollouts is None
    assert (cfg.online.prompts_per_step, cfg.online.group_size, cfg.online.updates_per_batch) == (64, 8, 4)
    assert cfg.data.plan_ahead is False  # iteration k + 1's rollouts come from iteration k's weights
    assert cfg.startup_problems(2, backend="gloo", te=False) == []
    offline = _online("--rollouts", "synthetic")
    assert offline.online is None and offline.data.rollouts is None and offline.data.plan_ahead is True
    assert dataclasses.replace(offline, online=OnlineConfig(), data=cfg.data) == cfg
    assert _online("--rollouts", "steps.jsonl").data.rollouts == "steps.jsonl"
    flags = _online("--prompts-per-step", 16, "--group-size", 4, "--updates-per-batch", 2, "--warmup-steps", 0,
                    "--warmup-lr", 0.01, "--no-advantage-std").online
    assert flags == OnlineConfig(prompts_per_step=16, group_size=4, updates_per_batch=2, warmup_steps=0,
                                 warmup_lr=0.01, advantage_std=False)


OFFLINE_WAY = "pass scored rollouts: --rollouts FILE (or --rollouts synthetic)"


@pytest.mark.parametrize("flags,world,expected", [
    (["--tensor-model-parallel-size", 2], 2, "--tensor-model-parallel-size=2: the online sampler needs 1"),
    (["--pipeline-model-parallel-size", 2], 2, "--pipeline-model-parallel-size=2: the online sampler needs 1"),
    (["--num-experts", 2, "--expert-model-parallel-size", 2], 2, "--expert-model-parallel-size 2: the expert "
                                                                  "dispatch is a collective inside every forward"),
    (["--mtp-num-layers", 1], 2, "--mtp-num-layers: the warm-up's forward-only log-prob passes"),
    (["--pg-kl-coef", 0.1], 2, "--pg-kl-coef > 0: the online rollouts have no reference log-probs"),
    (["--pg-rollout-correction", "token_mask"], 2, "--pg-rollout-correction: the online rollouts have no "
                                                   "rollout_logprobs"),
    (["--vocab-size", 64], 2, "--vocab-size 64: the reach task's token ids need at least 100"),
    (["--max-position-embeddings", 16], 2, "--max-position-embeddings 16: the reach task's sequences need 34"),
])
def test_what_cannot_run_online_is_refused_naming_the_offline_way(flags, world, expected):
    (problem,) = _online(*flags).startup_problems(world, backend="gloo", te=True)
    assert problem.startswith(expected) and problem.endswith(OFFLINE_WAY), problem
    # the same flags offline: nothing refused
    assert _online("--rollouts", "synthetic", *flags).startup_problems(world, backend="gloo", te=True) == []


def test_the_production_flags_run_online():
    """bf16, the distributed optimizer and both overlaps are not refused online (the sampler's
    parameters are gathered first: megatron_pg_agg.online.grpo.OnlineRun._sample)."""
    cfg = _online("--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
    assert cfg.online is not None and cfg.startup_problems(2, backend="gloo", te=False) == []


@pytest.mark.parametrize("flags,world,expected", [
    (["--prompts-per-step", 7], 2, "--prompts-per-step 7 does not split evenly over 2 DP ranks"),
    (["--group-size", 1], 2, "--group-size must be >= 2 (group-relative advantages), --prompts-per-step and "
                             "--updates-per-batch >= 1"),
    (["--prompts-per-step", 2, "--group-size", 2, "--num-microbatches", 3], 2,
     "1 prompts x 2 samples per DP rank cannot fill --num-microbatches 3"),
    (["--warmup-lr", 0], 2, "--warmup-steps must be >= 0 and --warmup-lr > 0"),
])
def test_bad_online_settings_are_refused(flags, world, expected):
    assert _online(*flags).startup_problems(world, backend="gloo", te=True) == [expected]


def test_online_flags_with_rollouts_are_refused():
    with pytest.raises(StartupError, match="--group-size, --prompts-per-step only act"):
        RunConfig.from_args(parse_flags(["--rollouts", "synthetic", "--prompts-per-step", "8", "--group-size", "4"]))
    # left at their defaults they are not in the way
    assert RunConfig.from_args(parse_flags(["--rollouts", "synthetic"])).online is None


def test_help_says_what_the_trainer_does_and_every_default():
    text = build_parser().format_help()
    flat = " ".join(text.split())
    for words in ("online GRPO on the built-in verifiable task", "--rollouts FILE trains offline",
                  "per-token advantages and old log-probs", "docs/rollout-format.md",
                  "token ids are integers below --vocab-size", "--rollouts synthetic replays"):
        assert words in flat, words
    for action in build_parser()._actions:
        if action.dest == "help":
            continue
        help_text = " ".join(build_parser()._get_formatter()._expand_help(action).split()) if action.help else ""
        shown = build_parser()._get_formatter()._get_help_string(action) or ""
        assert "default" in shown.lower(), (action.option_strings, help_text)
    assert "(default: 64)" in flat and "(default: none, online GRPO on the reach task)" in flat


def test_a_moe_model_takes_the_cuda_fusions():
    """The trainer's MoE settings with the fusions a GPU turns on (Megatron-LM's defaults without
    Transformer Engine): megatron-core accepts the config. Control: the bias-activation fusion left
    on beside add_bias_linear=False is refused (ValueError), which is what a GPU MoE run hit."""
    from megatron_pg_agg.megatron.model import device_settings, transformer_config
    from megatron_pg_agg.training.trainer import moe_settings

    moe = moe_settings(_cfg("--num-experts", 4, "--moe-router-topk", 2, "--rollouts", "synthetic"))
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
    gpu = device_settings(cuda=True, te=False)
    assert gpu["bias_activation_fusion"] is True
    assert transformer_config(**shape, **{**gpu, **moe}).bias_activation_fusion is False
    with pytest.raises(ValueError):
        transformer_config(**shape, **{**gpu, **moe, "bias_activation_fusion": True})
