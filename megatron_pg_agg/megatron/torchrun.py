"""The command that starts torchrun for the launches the package makes itself: the parity check's and
the fuzzer's layouts (:mod:`megatron_pg_agg.parity`) and the benchmarks' workers.

``python -m torch.distributed.run`` of this interpreter, unless ``MEGATRON_PG_AGG_TORCHRUN`` holds another
command (shell words) that takes torchrun's own arguments: a site's wrapper around torchrun, or the test
harness's client of its preloaded interpreter (tests/support/fork_client.py), which forks each rank from
a process that has already imported torch and megatron-core instead of paying those imports again.
"""
from __future__ import annotations

import os
import shlex
import sys

__all__ = ["TORCHRUN_ENV", "torchrun_command"]

TORCHRUN_ENV = "MEGATRON_PG_AGG_TORCHRUN"
"""The environment variable that replaces ``python -m torch.distributed.run`` (shell words)."""


def torchrun_command() -> list:
    """The argv prefix that torchrun's arguments (``--standalone --nproc_per_node N PROGRAM ...``) follow."""
    value = os.environ.get(TORCHRUN_ENV, "").strip()
    return shlex.split(value) if value else [sys.executable, "-m", "torch.distributed.run"]
