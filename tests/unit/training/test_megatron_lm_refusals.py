"""The Megatron-LM entry's start-up refusals (``startup_problems``, a pure function of the parsed
flags), one test per refusal: a valid CPU flag set is accepted, and each single change is refused
with one problem that names the flag to use. Each case would catch its check deleted, inverted,
or reading another flag; the baseline catches a check that refuses valid flags."""
from __future__ import annotations

import argparse

import pytest

from megatron_pg_agg.training.megatron_lm import startup_problems

VALID_CPU = dict(
    calculate_per_token_loss=True, dataloader_type="external", micro_batch_size=1, eval_iters=0,
    train_iters=10, ddp_average_in_collective=False, mtp_num_layers=None, mtp_loss_scaling_factor=0.1, spec=None,
    pg_skip_nonfinite_steps=False,
    pg_rollouts=None, distributed_backend="gloo", transformer_impl="local", gradient_accumulation_fusion=False,
    no_persist_layer_norm=True, bf16=False, fp16=False, context_parallel_size=1, sequence_parallel=False,
)


def _problems(cuda=False, megatron_core="0.16.1", **changes):
    return startup_problems(argparse.Namespace(**{**VALID_CPU, **changes}), cuda=cuda, megatron_core=megatron_core)


def test_valid_flags_are_accepted_on_cpu_and_gpu():
    assert _problems() == []
    assert _problems(cuda=True, distributed_backend="nccl", transformer_impl="transformer_engine",
                     gradient_accumulation_fusion=True, no_persist_layer_norm=False, bf16=True,
                     context_parallel_size=2, sequence_parallel=True) == []
    assert _problems(dataloader_type=None) == []  # unset: the entry sets external
    assert _problems(bf16=True) == []  # bf16 runs on CPU (the optimizer_cpu stand-in)
    assert _problems(mtp_num_layers=2) == [] and _problems(mtp_num_layers=2, megatron_core="0.19.2") == []


@pytest.mark.parametrize("changes,needles", [
    (dict(calculate_per_token_loss=False), ["--calculate-per-token-loss is missing"]),
    (dict(dataloader_type="single"), ["--dataloader-type single", "external"]),
    (dict(micro_batch_size=2), ["--micro-batch-size 2", "--micro-batch-size 1"]),
    (dict(eval_iters=5), ["--eval-iters 5", "--eval-iters 0"]),
    (dict(train_iters=None), ["--train-iters is required"]),
    (dict(ddp_average_in_collective=True), ["--ddp-average-in-collective"]),
    (dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.0), ["--mtp-loss-scaling-factor 0.0", "> 0"]),
    (dict(mtp_num_layers=1, spec=["x", "y"]), ["--spec with --mtp-num-layers", "UnboundLocalError"]),
    (dict(mtp_num_layers=1, megatron_core="0.15.3"),
     ["--mtp-num-layers", "refuses multi-token prediction with packed sequences", "0.15.3"]),
    (dict(fp16=True), ["--fp16 is not supported", "dynamic loss scale", "use --bf16"]),
    (dict(fp16=True, cuda=True, distributed_backend="nccl"), ["--fp16 is not supported"]),
    (dict(pg_skip_nonfinite_steps=True), ["--pg-skip-nonfinite-steps", "--check-for-nan-in-loss-and-grad"]),
    (dict(pg_rollouts="/nonexistent/rollouts.jsonl"), ["--pg-rollouts /nonexistent/rollouts.jsonl: no such file"]),
])
def test_each_refusal_alone(changes, needles):
    problems = _problems(**changes)
    assert len(problems) == 1, problems
    for needle in needles:
        assert needle in problems[0], (needle, problems[0])


@pytest.mark.parametrize("changes,fix", [
    (dict(distributed_backend="nccl"), "--distributed-backend gloo"),
    (dict(transformer_impl="transformer_engine"), "--transformer-impl local"),
    (dict(gradient_accumulation_fusion=True), "--no-gradient-accumulation-fusion"),
    (dict(no_persist_layer_norm=False), "--no-persist-layer-norm"),
    (dict(context_parallel_size=2), "--context-parallel-size 1"),
    (dict(sequence_parallel=True), "no --sequence-parallel"),
])
def test_each_cpu_requirement_alone(changes, fix):
    """On CPU the needs are one problem listing exactly the fixes that apply; with CUDA none apply."""
    problems = _problems(**changes)
    assert len(problems) == 1 and problems[0].startswith("on CPU (no CUDA) Megatron-LM needs: "), problems
    listed = problems[0].removeprefix("on CPU (no CUDA) Megatron-LM needs: ").rstrip(".").split("; ")
    assert len(listed) == 1 and listed[0].startswith(fix), listed
    assert _problems(cuda=True, **changes) == []


def test_every_problem_is_listed_at_once():
    """Several bad flags: every one is reported in the same refusal (none hides another)."""
    problems = _problems(calculate_per_token_loss=False, micro_batch_size=4, eval_iters=1, fp16=True,
                         sequence_parallel=True, context_parallel_size=2)
    assert len(problems) == 5
    assert "--fp16 is not supported" in problems[3]
    assert "--context-parallel-size 1" in problems[-1] and "no --sequence-parallel" in problems[-1]


def test_mtp_with_learned_positions_is_refused_before_megatron_lm_parses():
    from megatron_pg_agg.training.megatron_lm import argv_problems

    (problem,) = argv_problems(["--num-layers", "2", "--mtp-num-layers", "1"])
    assert "--mtp-num-layers 1 with --position-embedding-type learned_absolute (Megatron-LM's default)" in problem
    assert "add --position-embedding-type rope" in problem
    (given,) = argv_problems(["--mtp-num-layers=2", "--position-embedding-type=learned_absolute"])
    assert "--position-embedding-type learned_absolute:" in given
    for ok in (["--mtp-num-layers", "1", "--position-embedding-type", "rope"],
               ["--mtp-num-layers", "1", "--position-embedding-type", "none"], ["--num-layers", "2"]):
        assert argv_problems(ok) == [], ok


@pytest.mark.parametrize("argv,needles", [
    (["--softmax-type", "learnable", "--tensor-model-parallel-size", "2"],
     ["--softmax-type learnable with --tensor-model-parallel-size 2", "#7452", "finding 8", "#7530"]),
    (["--softmax-type=learnable", "--tensor-model-parallel-size=4"], ["--tensor-model-parallel-size 4", "finding 8"]),
    (["--experimental-attention-variant", "gated_delta_net"],
     ["--experimental-attention-variant gated_delta_net", "#7452", "finding 11"]),
    (["--use-megatron-fsdp"], ["--use-megatron-fsdp", "#7452", "finding 12"]),
    (["--use-torch-fsdp2"], ["--use-torch-fsdp2:", "scale_gradients", "W/(DP*CP) times too large"]),
])
def test_megatron_cores_known_silent_bugs_are_refused_from_the_raw_flags(argv, needles):
    """Megatron-LM #7452's findings our paths can meet (docs/failure-modes.md), refused before
    Megatron-LM parses: one problem each, naming the flag, the issue and the finding."""
    from megatron_pg_agg.training.megatron_lm import argv_problems

    (problem,) = argv_problems(["--num-layers", "2", *argv])
    for needle in needles:
        assert needle in problem, (needle, problem)


@pytest.mark.parametrize("argv", [
    ["--softmax-type", "learnable"], ["--softmax-type", "learnable", "--tensor-model-parallel-size", "1"],
    ["--softmax-type", "off-by-one", "--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2"],
])
def test_the_known_bugs_need_their_whole_combination(argv):
    from megatron_pg_agg.training.megatron_lm import argv_problems

    assert argv_problems(["--num-layers", "2", *argv]) == []
