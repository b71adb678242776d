"""The trainer's metrics file as the tests read it (megatron_pg_agg.training.metrics.read_runs)."""
from __future__ import annotations

from megatron_pg_agg.training.metrics import read_runs


def trainer_records(path) -> tuple[list, list]:
    """``(step records, final records)`` of every run in the file, in file order (the run-start
    records left out)."""
    runs = read_runs(str(path))
    return [r for run in runs for r in run.steps], [r for run in runs for r in run.finals]


def first_step(path) -> dict:
    """The first step record of the file."""
    return trainer_records(path)[0][0]
