"""torchrun, forked from the session's preloaded interpreter, for the launches the package makes itself.

    python -m tests.support.fork_client TORCHRUN_ARGS ...     # as ``python -m torch.distributed.run ...``

The parity check, the fuzzer and the benchmarks start their own torchrun (through
:func:`megatron_pg_agg.megatron.torchrun.torchrun_command`); a test runs those commands as a user does,
so each of their ranks (and torchrun's agent) would import torch and megatron-core afresh, 5 to 10 s on
2 cores. :func:`tests.support.launching.child_env` sets ``MEGATRON_PG_AGG_TORCHRUN`` to this module and
names the session's fork server (:data:`SERVER_ENV`) and its import-time environment
(:data:`IMPORT_ENV`): the launch is then a fork of the server (tests/support/fork_server.py), with
torchrun's environment and exit status, its output relayed to this process's stdout as it comes.
Where a fork cannot stand in (a command :func:`fork_server.plan` does not take, another ``PYTHON*``/
``LD_*`` environment, no server) this process becomes the real torchrun (``exec``).

SIGTERM or SIGINT to this process stops the launch (its own session) with SIGKILL, as the package's
own timeout does to a torchrun's process group. Imports no torch: it starts in a fraction of a second.
"""
from __future__ import annotations

import json
import os
import signal
import sys

from tests.support import fork_server

SERVER_ENV = "PG_AGG_FORK_SERVER"
"""The fork server's socket path."""
IMPORT_ENV = "PG_AGG_FORK_SERVER_IMPORT_ENV"
"""The server's ``PYTHON*``/``LD_*`` variables (JSON): a launch with others must start fresh."""


def import_time_env(env) -> dict:
    """The variables a preloaded interpreter has already acted on."""
    return {k: v for k, v in env.items() if k.startswith(("PYTHON", "LD_"))}


def main(argv: list) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", *argv]
    path, planned = os.environ.get(SERVER_ENV), fork_server.plan(cmd)
    same = json.loads(os.environ.get(IMPORT_ENV, "null")) == import_time_env(os.environ)
    if not (path and planned and same and os.path.exists(path)):
        os.execv(sys.executable, cmd)
    launch = fork_server.ForkedLaunch(path, cmd, planned, dict(os.environ), os.getcwd())

    def stop(signum, _frame):
        try:
            os.killpg(launch.pid, signal.SIGKILL)  # the launch runs in its own session (fork_server._launch)
        except ProcessLookupError:
            pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    status = launch.relay(sys.stdout.fileno())
    return status if status >= 0 else 128 - status  # killed by a signal: the shell's status for it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
