"""Several Megatron-LM runs of launch/pretrain_actor.py in one launch (test batching).

    [torchrun --standalone --nproc_per_node N] -m tests.distributed.workers.megatron_lm_runs RUNS.json RESULT.json

RUNS.json is a list of ``{"name": ..., "argv": [...]}`` (with ``"entry": "rl"``, a run of
launch/train_rl_actor.py); each run goes through the entry point's own ``main(argv)`` (the same
function ``launch/pretrain_actor.py`` or ``launch/train_rl_actor.py`` exits with), then Megatron-LM's
``destroy_global_state()`` resets its globals for the next run (the process group stays after a
run that trained, as in Megatron-LM's in-process restart; a refusal destroys it, like the real
script's exit does, and the next run's Megatron-LM initialisation makes a new one). Importing
megatron.training costs ~10 s per process on a 2-core CPU; a run after that costs ~2-4 s. Rank 0
writes ``{name: exit status}`` to RESULT.json.
"""
from __future__ import annotations

from megatron_pg_agg.training import megatron_lm
from tests.support.batch_runs import announce, exit_status, serve


def _main(entry: str):
    if entry == "rl":
        from megatron_pg_agg.training import megatron_rl  # needs megatron.rl: imported only for its runs

        return megatron_rl.main
    return megatron_lm.main


def run_all(runs: list) -> dict:
    status = {}
    for run in runs:
        announce(run)
        status[run["name"]] = exit_status(_main(run.get("entry", "pretrain")), list(run["argv"]))
        from megatron.training.training import destroy_global_state

        destroy_global_state()
    return status


if __name__ == "__main__":
    serve(run_all)
