"""The resume's start-up check (megatron_pg_agg/training/resume.py) and the assembly of a rank's
optimizer ranges from saved pieces (training/checkpoint.assemble), on the host. The runs themselves:
tests/distributed/test_resume.py."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_pg_agg.training.resume import run_record, with_checkpoint_settings
from megatron_pg_agg.training.run_config import RunConfig, StartupError, build_parser


def _cfg(*argv) -> RunConfig:
    return RunConfig.from_args(build_parser().parse_args(["--rollouts", "synthetic", *map(str, argv)]))


def _checkpoint(tmp_path, *argv, world=2, record=True):
    """A checkpoint folder whose run record is that of ``argv`` on ``world`` ranks."""
    folder = tmp_path / "iter_0000002"
    folder.mkdir(parents=True)
    (tmp_path / "latest").write_text("2\n")
    if record:
        (folder / "run.json").write_text(json.dumps({**run_record(_cfg(*argv), world), "iteration": 2, "ranks": []}))
    return str(tmp_path)


def _problems(load, *argv, world=2):
    return _cfg(*argv, "--load", load).startup_problems(world, backend="gloo", te=False)


def test_what_may_change_starts(tmp_path):
    load = _checkpoint(tmp_path, "--use-distributed-optimizer", "--num-microbatches", "3")
    for argv, world in ((["--bf16"], 2), ([], 1), (["--use-distributed-optimizer"], 4),
                        (["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "999"], 2)):
        assert _problems(load, *argv, world=world) == [], argv


def test_each_fixed_flag_is_named_with_both_values_in_one_line(tmp_path):
    load = _checkpoint(tmp_path)
    (problem,) = _problems(load, "--tensor-model-parallel-size", "2", "--pg-loss-aggregation", "constant",
                           "--pg-loss-aggregation-divisor", "64", "--hidden-size", "128")
    for needle in ("--tensor-model-parallel-size 2 (checkpoint: 1)", "--hidden-size 128 (checkpoint: 64)",
                   "--pg-loss-aggregation constant (checkpoint: token_mean)",
                   "--pg-loss-aggregation-divisor 64.0 (checkpoint: (not given))", "docs/trainer.md"):
        assert needle in problem, (needle, problem)


def test_the_optimizer_settings_follow_megatron_lms_rule(tmp_path):
    load = _checkpoint(tmp_path, "--lr", "0.001", "--clip-grad", "1.0")
    (problem,) = _problems(load, "--lr", "0.002", "--clip-grad", "0.5")
    assert "--lr 0.002 (checkpoint: 0.001)" in problem and "--clip-grad 0.5 (checkpoint: 1.0)" in problem
    assert _problems(load, "--lr", "0.002", "--override-opt_param-scheduler") == []
    assert _problems(load, "--lr", "0.002", "--use-checkpoint-opt_param-scheduler") == []
    (both,) = _problems(load, "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    assert "say opposite things" in both
    kept = with_checkpoint_settings(_cfg("--lr", "0.002", "--weight-decay", "0.1",
                                         "--use-checkpoint-opt_param-scheduler", "--load", load))
    assert (kept.training.lr, kept.training.weight_decay, kept.training.clip_grad) == (0.001, 0.0, 1.0)
    flags = with_checkpoint_settings(_cfg("--lr", "0.002", "--override-opt_param-scheduler", "--load", load))
    assert flags.training.lr == 0.002


def test_a_checkpoint_without_its_record_is_refused_and_none_yet_starts_fresh(tmp_path):
    legacy = _checkpoint(tmp_path / "old", record=False)
    (problem,) = _problems(legacy)
    assert "run.json is missing" in problem
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _problems(str(empty)) == []
    with pytest.raises(StartupError, match="refusing to start:"):
        _cfg("--tensor-model-parallel-size", "2", "--load", _checkpoint(tmp_path / "tp")).validate(
            2, backend="gloo", te=False)


def test_assemble_joins_ranges_takes_replicas_and_names_a_gap():
    from megatron_pg_agg.training.checkpoint import assemble

    full = torch.arange(10, dtype=torch.float32)
    shards = [{"start": 0, "end": 4, "param": full[0:4], "state": {"m": -full[0:4]}},
              {"start": 4, "end": 10, "param": full[4:10], "state": {"m": -full[4:10]}}]
    assert torch.equal(assemble(shards, "param", 0, 10), full)
    assert torch.equal(assemble(shards, "m", 3, 7, like=torch.zeros(4)), -full[3:7])  # across the boundary
    replicas = [{"start": 0, "end": 10, "param": full, "state": {}}] * 2
    assert torch.equal(assemble(replicas, "param", 2, 9), full[2:9])
    step = torch.tensor(5.0)
    assert assemble(shards, "step", 4, 10, like=step) == 5.0
    with pytest.raises(ValueError, match="stop at element 4"):
        assemble(shards[:1], "param", 0, 10)
