"""The shared frame of the batch workers (tests/distributed/workers/trainer_runs.py and
megatron_lm_runs.py): several runs of an entry's ``main(argv)`` in one launch.

    [torchrun ...] -m tests.distributed.workers.<worker> RUNS.json RESULT.json

RUNS.json is a list of ``{"name": ..., "argv": [...], ...}`` (``"env"``: variables set for that
run only, :func:`run_environment`); rank 0 writes ``{name: exit status}``
to RESULT.json. Each worker says how a run is made and how the next one is reset."""
from __future__ import annotations

import json
import os
import sys
from unittest import mock


def exit_status(main, argv: list) -> int:
    """``main(argv)``'s return value, or the status of the SystemExit it raised (argparse's usage
    errors: 2; Megatron-LM's ``--exit-interval``: 0)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1


def run_environment(run: dict):
    """The run's ``"env"`` ({name: value}) set in ``os.environ`` for the run, restored after it
    (a refused start's WORLD_SIZE, say): a context manager."""
    return mock.patch.dict(os.environ, run.get("env") or {})


def announce(run: dict) -> None:
    """The ``[runs] NAME`` marker the tests cut a batch's output at (``launching.split_by_run``)."""
    print(f"[runs] {run['name']}", file=sys.stderr, flush=True)


def serve(run_all) -> None:
    """Read RUNS.json (``sys.argv[1]``), ``run_all(runs) -> {name: status}``, rank 0 writes RESULT.json."""
    runs_path, result_path = sys.argv[1], sys.argv[2]
    with open(runs_path) as f:
        status = run_all(json.load(f))
    if os.environ.get("RANK", "0") == "0":
        with open(result_path, "w") as f:
            json.dump(status, f)
