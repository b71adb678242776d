"""Collectives per training step (torch.distributed wrapped in the workers): the exact loss adds
none per microbatch or per step compared with a Megatron-LM-style token-mean loss."""
import importlib.util
import os

import pytest

from tests.support.launching import ROOT, launcher_env

# the benchmark is a script (benchmarks/ is not a package): load it from its file
_spec = importlib.util.spec_from_file_location("bench_step", ROOT / "benchmarks" / "bench_step.py")
bench_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_step)

BASELINE = "baseline (Megatron-LM token mean)"


@pytest.fixture
def launcher_environment(monkeypatch):
    """This process's environment made a launcher's (launching.launcher_env: no rendezvous variable an
    in-process test left, torchrun forked from the preloaded server): bench_step.launch hands its own
    environment to torchrun."""
    env = launcher_env()
    for name in set(os.environ) - set(env):
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("tp", [1, 2])
def test_no_collective_is_added_per_microbatch_or_per_step(tp, launcher_environment):
    counts = {m: bench_step.launch(tp, m, reps=1, count_only=True)["collectives"] for m in (2, 4)}
    for m, by_variant in counts.items():
        base = by_variant[BASELINE]
        assert base.get("all_reduce", 0) > 0
        for variant, ops in by_variant.items():
            for op, n in ops.items():
                assert n <= base.get(op, 0), (tp, m, variant, op, n, base)
    # growth with the number of microbatches is no larger than the baseline's
    for variant in counts[2]:
        for op in set(counts[4][variant]) | set(counts[4][BASELINE]):
            ours = counts[4][variant].get(op, 0) - counts[2][variant].get(op, 0)
            base = counts[4][BASELINE].get(op, 0) - counts[2][BASELINE].get(op, 0)
            assert ours <= base, (tp, variant, op, ours, base)
