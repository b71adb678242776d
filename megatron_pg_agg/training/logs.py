"""Output of the two entries: ``logging`` loggers under ``megatron_pg_agg``, shown on rank 0.

Modules log through ``logging.getLogger(__name__)``. An entry point calls :func:`setup_logging`
once with its prefix (``[train]``, ``[pg]``): one stderr handler on the package's logger, with a
rank-0 filter in the manner of megatron-core's ``log_single_rank`` (every rank reaches the same
conclusions, so one rank speaks). A record logged with ``extra=ALL_RANKS`` passes on every rank.
Used as a library, without :func:`setup_logging`, the package adds no handler: the application's
logging configuration decides.
"""
from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

PACKAGE_LOGGER = "megatron_pg_agg"
ALL_RANKS = {"all_ranks": True}
"""``extra=`` of a record every rank shows (a refusal or a stop, printed where it happened)."""


def current_rank() -> int:
    """The global rank: the process group's once it exists, else the launcher's ``RANK``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankZeroFilter(logging.Filter):
    """Passes rank 0's records, and every rank's records marked ``all_ranks``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, "all_ranks", False)) or current_rank() == 0


class _StderrHandler(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is when a record is emitted (a test's capture,
    a redirected stream), not on the one that was current at set-up."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def setup_logging(prefix: str) -> logging.Logger:
    """Route the package's records at INFO and above to stderr as ``<prefix> <message>``, rank 0
    only; calling it again replaces the handler (and the prefix)."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))
    handler.addFilter(RankZeroFilter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # Megatron-LM configures the root logger its own way
    return logger
