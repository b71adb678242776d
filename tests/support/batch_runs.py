"""The shared frame of the batch workers (tests/distributed/workers/trainer_runs.py and
megatron_lm_runs.py): several runs of an entry's ``main(argv)`` in one launch.

    [torchrun ...] -m tests.distributed.workers.<worker> RUNS.json RESULT.json

RUNS.json is a list of ``{"name": ..., "argv": [...], ...}`` (``"env"``: variables set for that
run only, :func:`run_environment`); rank 0 writes ``{name: exit status}``
to RESULT.json. Each worker says how a run is made and how the next one is reset."""
from __future__ import annotations

import gc
import json
import os
import sys
from unittest import mock

THREADS_VARIABLE = "PG_AGG_TEST_THREADS"
"""A run's ``"env"`` variable: where :func:`end_run` writes the rank's thread count."""


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


def release_run() -> None:
    """Free the finished run's model and process groups before the next run builds its own.

    On gloo every process group keeps 3 threads until it is destroyed and no object holds it;
    without this a worker kept every run's groups (49 threads per trainer run of a TP2 layout,
    thousands after a batch). So: every group but the default one is destroyed (Megatron-LM's
    runs keep the default group, as its in-process restart does, and make their model-parallel
    groups anew each time; torch lists the groups only in its private ``_world``), megatron-core's
    module caches are emptied (they pin the model, :mod:`megatron_pg_agg.megatron.parallel` says
    how), and the model's reference cycles (module, DDP hooks, buckets) are collected now rather
    than at some later full collection."""
    import torch.distributed as dist  # noqa: PLC0415 (the frame itself imports no torch)
    from torch.distributed.distributed_c10d import _world  # noqa: PLC0415

    from megatron_pg_agg.megatron.parallel import release_module_caches  # noqa: PLC0415

    if dist.is_initialized():
        for group in list(_world.pg_map):
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
    release_module_caches()
    gc.collect()


def end_run() -> None:
    """After each run: :func:`release_run`, then, with ``PG_AGG_TEST_THREADS=PREFIX`` in the run's
    ``"env"``, this rank's thread count (``/proc/self/task``, Linux) written to ``PREFIX.rankR``
    (tests/distributed/test_harness_threads.py)."""
    release_run()
    share_argument_docstrings()
    prefix = os.environ.get(THREADS_VARIABLE)
    if prefix:
        with open(f"{prefix}.rank{os.environ.get('RANK', '0')}", "w") as f:
            f.write(str(len(os.listdir("/proc/self/task"))))


def share_argument_docstrings() -> None:
    """Let the next runs of this process reuse the field docstrings Megatron-LM's ``parse_args`` read.

    Why: from core_v0.16 ``parse_args`` builds its flags from megatron-core's config dataclasses and
    reads each field's docstring by parsing the dataclass's source (``ArgumentGroupFactory.
    _get_field_docstrings``: ``inspect.getsource`` + ``ast.parse`` of each class and its bases,
    about 1 s of CPU per call on 2 cores), the same every time in one process. A batch worker
    parses once per run; after the first run this keeps each class's result (a copy is handed
    out, as the original returns a fresh dict). Test harness only: an entry parses once per process.
    No-op before Megatron-LM's training side is imported or on a release without the factory."""
    module = sys.modules.get("megatron.training.argument_utils")
    factory = getattr(module, "ArgumentGroupFactory", None)
    original = getattr(factory, "_get_field_docstrings", None)
    if original is None or hasattr(original, "__wrapped__"):
        return
    read = {}

    def field_docstrings(self, src_cfg_class):
        if src_cfg_class not in read:
            read[src_cfg_class] = original(self, src_cfg_class)
        return dict(read[src_cfg_class])

    field_docstrings.__wrapped__ = original
    factory._get_field_docstrings = field_docstrings


def announce(run: dict) -> None:
    """The ``[runs] NAME`` marker the tests cut a batch's output at (``launching.split_by_run``), in one
    write to fd 2: ``print`` writes the text and its newline apart, and another rank's line landing
    between them (rank 0's refusal, say) became part of the marker's name and was lost from its run."""
    sys.stderr.flush()
    os.write(2, f"[runs] {run['name']}\n".encode())


def serve(run_all) -> None:
    """Read RUNS.json (``sys.argv[1]``), ``run_all(runs) -> {name: status}``, rank 0 writes RESULT.json."""
    runs_path, result_path = sys.argv[1], sys.argv[2]
    with open(runs_path) as f:
        status = run_all(json.load(f))
    if os.environ.get("RANK", "0") == "0":
        with open(result_path, "w") as f:
            json.dump(status, f)
