"""The trainer's command line (``launch/train_actor.py``): parse, run, and map each way a run ends
to its exit status (0 done, 2 refused at start-up, 3 stopped on a non-finite step)."""
from __future__ import annotations

import sys

from .run_config import RunConfig, StartupError, build_parser
from .trainer import NonFiniteStepError, train
from .worker_process import keep_freed_memory, quiet_startup_noise, release_process_group


def main(argv=None) -> int:
    keep_freed_memory()
    quiet_startup_noise("[train]")
    namespace = build_parser().parse_args(argv)
    try:
        train(RunConfig.from_args(namespace))
    except StartupError as err:
        print(f"[train] {err}", file=sys.stderr, flush=True)  # refused before any process group
        return 2
    except NonFiniteStepError as err:
        print(f"[train] stopped: {err}", file=sys.stderr, flush=True)
        release_process_group()
        return 3
    return 0
