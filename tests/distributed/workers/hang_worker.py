"""The trainer with one rank that hangs (alive, never reaching a collective), for
tests/distributed/test_reliability.py. Test-only: the library has no hook for this.

    torchrun --nproc_per_node 2 -m tests.distributed.workers.hang_worker <train_actor flags>

Rank 1 sleeps for an hour where it would plan its first step; rank 0 goes on into the step and
waits in its first collective with rank 1, which must fail after --distributed-timeout-minutes.
"""
import os
import sys
import time

from megatron_pg_agg.training import cli, trainer

_plan_step = trainer.plan_step


def _hanging_plan_step(*args, **kwargs):
    if os.environ.get("RANK") == "1":
        print("[hang_worker] rank 1 hangs before its first step", file=sys.stderr, flush=True)
        time.sleep(3600)
    return _plan_step(*args, **kwargs)


trainer.plan_step = _hanging_plan_step  # train_step looks plan_step up in its module's namespace

if __name__ == "__main__":
    sys.exit(cli.main())
