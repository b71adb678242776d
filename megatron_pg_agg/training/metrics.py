"""Rank 0's per-step metrics record of the trainer: the progress line, the JSONL metrics file and
TensorBoard.

The JSONL file is appended to by every run that names it, so each run is marked: a run opens with
a ``{"event": "run_start", "run_id": ...}`` record (the command line, the model, the versions, the
first iteration), and every record it writes after (each step's, and the ``"final"`` one) carries
the same ``run_id``. A resumed run (``--load``) keeps the run id its checkpoint holds. Read a file
of several runs with :func:`read_runs` (docs/flags.md#records)."""
from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger(__name__)


class MetricsLog:
    """Rank 0's per-step record: a progress line on stderr, a JSONL file, TensorBoard if present."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str], total: int, enabled: bool,
                 run_start: Optional[dict] = None):
        """``run_start``: the run's start record (:func:`run_start_record`), written first; its
        ``run_id`` is added to every later record."""
        self.enabled, self.total = enabled, total
        self.file = None
        self.tb = None
        self.run_id = run_start["run_id"] if run_start else None
        if not enabled:
            return
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a")
            if run_start:
                self.write(run_start)
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  (optional)

                self.tb = SummaryWriter(tensorboard_dir)
            except ImportError:
                logger.warning("tensorboard is not installed: --tensorboard-dir ignored")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        it = record["iteration"]
        width = 24
        done = int(width * it / self.total)
        bar = "#" * done + "-" * (width - done)
        shown = " ".join(
            f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}"
            for k in ("accuracy", "response_length", "objective", "weight", "clip_fraction", "kl", "entropy",
                      "grad_norm", "tokens_per_s")
            if record.get(k) is not None)
        # [sum, count] pairs (MoE router losses, mtp_loss): shown and written as their value
        pairs = {k: v[0] / v[1] for k, v in record.items() if isinstance(v, list) and len(v) == 2 and v[1]}
        shown += "".join(f" {k}={v:.4g}" for k, v in pairs.items())
        logger.info(f"[{bar}] {it}/{self.total} {shown}")
        self.write(record)
        if self.tb:
            for k, v in {**record, **pairs}.items():
                if isinstance(v, (int, float)) and k != "iteration":
                    self.tb.add_scalar(k, v, it)

    def write(self, record: dict) -> None:
        """One record in the JSONL file (with the run id), flushed."""
        if self.file:
            self.file.write(json.dumps({**record, "run_id": self.run_id} if self.run_id else record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


def new_run_id() -> str:
    """A run id: the UTC start time and 6 random hex digits (sortable, unique in practice)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def run_start_record(run_id: str, *, argv: list, model: str, start_iteration: int, extra: dict) -> dict:
    """The record a run opens with: the id, the command line, the model, the first iteration,
    the versions of this package, megatron-core, torch and Python, and ``extra``."""
    import platform  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from megatron_pg_agg.versions import PACKAGE_VERSION, installed_megatron_core_version  # noqa: PLC0415

    return {"event": "run_start", "run_id": run_id, "start_iteration": start_iteration, "argv": list(argv),
            "model": model, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": {"megatron_pg_agg": PACKAGE_VERSION, "megatron_core": installed_megatron_core_version(),
                         "torch": torch.__version__, "python": platform.python_version()}, **extra}


@dataclass
class Run:
    """One run's records in a metrics file."""

    run_id: Optional[str]
    """None for records written before runs were marked (a file from an older version)."""
    starts: list = field(default_factory=list)
    """Its ``run_start`` records: one per start (a resumed run adds one, same id)."""
    steps: list = field(default_factory=list)
    """Its per-step records, in file order."""
    finals: list = field(default_factory=list)
    """Its ``"final"`` records (one per start that finished)."""


def read_runs(path: str) -> list:
    """The runs of a metrics JSONL file, in order of their first record: each :class:`Run` with its
    start, step and final records (a resumed run is one Run). Records without a run id (older
    files) form one Run with ``run_id`` None."""
    runs: dict = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            run = runs.setdefault(record.get("run_id"), Run(record.get("run_id")))
            if record.get("event") == "run_start":
                run.starts.append(record)
            elif record.get("final"):
                run.finals.append(record)
            else:
                run.steps.append(record)
    return list(runs.values())
