"""Rank 0's per-step metrics record of the trainer: the progress line, the JSONL metrics file and
TensorBoard."""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)


class MetricsLog:
    """Rank 0's per-step record: a progress line on stderr, a JSONL file, TensorBoard if present."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str], total: int, enabled: bool):
        self.enabled, self.total = enabled, total
        self.file = None
        self.tb = None
        if not enabled:
            return
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a")
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
            for k in ("objective", "weight", "clip_fraction", "kl", "entropy", "grad_norm", "tokens_per_s")
            if record.get(k) is not None)
        # [sum, count] pairs (MoE router losses, mtp_loss): shown and written as their value
        pairs = {k: v[0] / v[1] for k, v in record.items() if isinstance(v, list) and len(v) == 2 and v[1]}
        shown += "".join(f" {k}={v:.4g}" for k, v in pairs.items())
        logger.info(f"[{bar}] {it}/{self.total} {shown}")
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb:
            for k, v in {**record, **pairs}.items():
                if isinstance(v, (int, float)) and k != "iteration":
                    self.tb.add_scalar(k, v, it)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
