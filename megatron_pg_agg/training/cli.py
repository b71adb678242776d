"""The trainer's command line: parse, run, and map each way a run ends to its exit status (0 done,
2 refused at start-up, 3 stopped on a non-finite step). Under torchrun the shell sees torchrun's own
status (1) and its ChildFailedError report after the project's line. The main job's command
(``launch/train_actor.py``) is :mod:`megatron_pg_agg.online.cli`, which hands this one the online
job for runs without ``--rollouts``."""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

from .logs import ALL_RANKS, current_rank, setup_logging
from .run_config import RunConfig, StartupError, parse_flags
from .worker_process import keep_freed_memory, quiet_startup_noise, release_process_group, verbose_requested

logger = logging.getLogger(__name__)


def main(argv=None, *, online_job: Optional[Callable[[RunConfig], dict]] = None) -> int:
    """Run the trainer on ``argv``'s flags. A run without ``--rollouts`` runs ``online_job`` (the main
    job's, passed by :mod:`megatron_pg_agg.online.cli`; called after megatron-core's start-up noise is
    quieted); without one it is refused at start-up (exit 2)."""
    keep_freed_memory()
    setup_logging("[train]")
    quiet_startup_noise(verbose=verbose_requested(argv), outside_info=True)
    namespace = parse_flags(argv)  # before megatron-core is imported: --help and usage errors come at once
    # imported only now: the trainer imports megatron.core, whose start-up warnings
    # quiet_startup_noise must be in place for
    from .trainer import NonFiniteStepError, train  # noqa: PLC0415

    try:
        cfg = RunConfig.from_args(namespace)
        if cfg.online is None:
            train(cfg)
        elif online_job is None:
            raise StartupError("no --rollouts: the online main job runs through launch/train_actor.py "
                               "(megatron_pg_agg.online.cli.main); this command line trains on --rollouts FILE")
        else:
            online_job(cfg)
    except StartupError as err:
        # every rank reaches the same refusal (the checks read the same flags, files and gathered
        # names), so rank 0 alone prints it; every rank exits 2
        logger.error(str(err))
        release_process_group()
        _let_rank_0_speak_first()
        return 2
    except NonFiniteStepError as err:
        logger.error(f"stopped: {err}", extra=ALL_RANKS)
        release_process_group()
        return 3
    return 0


RANK_0_HEAD_START_S = 10.0
"""How long a rank other than 0 waits before it exits with a refusal (torchrun ends it sooner)."""


def _let_rank_0_speak_first() -> None:
    """Under torchrun the first rank to exit makes it stop the others: were it a silent rank, rank
    0 could be stopped before its refusal is printed. So the other ranks wait for torchrun to stop
    them once rank 0 has exited (at most :data:`RANK_0_HEAD_START_S`, then exit 2 themselves)."""
    if current_rank() != 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(RANK_0_HEAD_START_S)
