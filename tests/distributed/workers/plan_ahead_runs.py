"""Trainer runs for tests/distributed/test_plan_ahead.py: tests.distributed.workers.trainer_runs,
with a run's ``PG_TEST_FAIL_PLAN_AT=K`` making the planner raise, on every rank, a rollout-file
error (naming a file and line) for the K-th plan the run asks for (0-based: iteration K of a run
started at 0), and a run that raises recorded as ``"TypeName: message"`` instead of a status.
Test-only: the library has no hook for this.

    torchrun --standalone --nproc_per_node N -m tests.distributed.workers.plan_ahead_runs RUNS.json RESULT.json
"""
from __future__ import annotations

import os

from megatron_pg_agg.data.rollout_files import RolloutFormatError
from megatron_pg_agg.online.cli import main
from megatron_pg_agg.training import trainer
from tests.distributed.workers.trainer_runs import _fresh_rendezvous
from tests.support.batch_runs import announce, exit_status, run_environment, serve

_plan_step = trainer.plan_step
_calls = {"n": 0}


def _failing_plan_step(*args, **kwargs):
    at, n = os.environ.get("PG_TEST_FAIL_PLAN_AT"), _calls["n"]
    _calls["n"] += 1
    if at is not None and n == int(at):
        raise RolloutFormatError("rollouts.jsonl", "is -1; expected an integer >= 0", line=12, field="step")
    return _plan_step(*args, **kwargs)


trainer.plan_step = _failing_plan_step  # the trainer's plan(iteration) looks plan_step up in its module


def run_all(runs: list) -> dict:
    status = {}
    agent = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    for index, run in enumerate(runs):
        if index and "RANK" in os.environ:
            _fresh_rendezvous(agent, index)
        announce(run)
        _calls["n"] = 0
        with run_environment(run):
            try:
                status[run["name"]] = exit_status(main, list(run["argv"]))
            except Exception as err:  # noqa: BLE001 - the test reads what the run raised
                status[run["name"]] = f"{type(err).__name__}: {err}"
    return status


if __name__ == "__main__":
    serve(run_all)
