"""The trainer's metrics file as the tests read it (megatron_pg_agg.training.metrics.read_runs)."""
from __future__ import annotations

from megatron_pg_agg.training.metrics import read_runs


def trainer_records(path) -> tuple[list, list]:
    """``(step records, final records)`` of every run in the file, in file order, without their
    ``run_id`` (the tests compare runs' contents; the ids are checked where they are the point:
    test_reliability.py's records tests), the run-start records left out."""
    runs = read_runs(str(path))

    def content(record: dict) -> dict:
        return {k: v for k, v in record.items() if k != "run_id"}

    return ([content(r) for run in runs for r in run.steps], [content(r) for run in runs for r in run.finals])


def first_step(path) -> dict:
    """The first step record of the file."""
    return trainer_records(path)[0][0]
