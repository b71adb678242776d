"""Several Megatron-LM runs of launch/pretrain_actor.py in one launch (test batching).

    [torchrun --standalone --nproc_per_node N] -m tests.distributed.workers.megatron_lm_runs RUNS.json RESULT.json

RUNS.json is a list of ``{"name": ..., "argv": [...]}`` (``"env"``: variables for that run only;
with ``"entry": "rl"``, a run of launch/train_rl_actor.py); each run goes through the entry
point's own ``main(argv)`` (the same function ``launch/pretrain_actor.py`` or
``launch/train_rl_actor.py`` exits with), then Megatron-LM's ``destroy_global_state()`` resets its
globals for the next run and ``batch_runs.end_run`` frees its model and model-parallel groups (the
default process group stays after a run that trained, as in Megatron-LM's in-process restart; a
refusal destroys it, like the real script's exit does, and the next run's Megatron-LM
initialisation makes a new one). Importing
megatron.training costs ~10 s per process on a 2-core CPU; a run after that costs ~2-4 s. Rank 0
writes ``{name: exit status}`` to RESULT.json.

A run with ``"logprob_rows": PATH`` (RL entry) has rank 0 save, with ``torch.save``, the log-prob
rows of each collection as the collection planner hands them to its steps (``old``, ``ref``,
``rollout`` ``[N, S-1]``, the ``generation_mask`` and ``lengths``) and how often each log-prob pass
was built (``packed``: the planner's packed THD pass, ``unpacked``: Megatron-LM's
``compute_logprobs_batch``): the test compares the two passes directly.
"""
from __future__ import annotations

import contextlib
import os
from unittest import mock

from megatron_pg_agg.training import megatron_lm
from tests.support.batch_runs import announce, end_run, exit_status, run_environment, serve


def _main(entry: str):
    if entry == "rl":
        from megatron_pg_agg.training import megatron_rl  # needs megatron.rl: imported only for its runs

        return megatron_rl.main
    return megatron_lm.main


@contextlib.contextmanager
def _logprob_rows(path):
    """Record the collection planner's log-prob rows into ``path`` (rank 0), see the docstring."""
    if path is None:
        yield
        return
    import torch

    from megatron_pg_agg.training import rl_collection

    seen = {"collections": [], "packed": 0, "unpacked": 0}
    step_batches, packed, unpacked = (rl_collection.step_batches, rl_collection.packed_logprob_pass,
                                      rl_collection.make_logprob_pass)

    def record_steps(**kwargs):
        if kwargs["ref_logprobs"] is not None:  # the steps' call (the packed layout's has no reference)
            seen["collections"].append({name: kwargs[key] for name, key in (
                ("old", "old_logprobs"), ("ref", "ref_logprobs"), ("rollout", "rollout_logprobs"),
                ("generation_mask", "generation_mask"), ("lengths", "lengths"))})
        return step_batches(**kwargs)

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    with mock.patch.object(rl_collection, "step_batches", record_steps), \
            mock.patch.object(rl_collection, "packed_logprob_pass", counted("packed", packed)), \
            mock.patch.object(rl_collection, "make_logprob_pass", counted("unpacked", unpacked)):
        yield
    if os.environ.get("RANK", "0") == "0":
        torch.save(seen, path)


def run_all(runs: list) -> dict:
    status = {}
    for run in runs:
        announce(run)
        with run_environment(run):
            with _logprob_rows(run.get("logprob_rows")):
                status[run["name"]] = exit_status(_main(run.get("entry", "pretrain")), list(run["argv"]))
            from megatron.training.training import destroy_global_state

            destroy_global_state()
            end_run()
    return status


if __name__ == "__main__":
    serve(run_all)
