"""Several trainer runs (launch/train_actor.py's ``main``) in one launch (test batching).

    [torchrun --standalone --nproc_per_node N] -m tests.distributed.workers.trainer_runs RUNS.json RESULT.json

RUNS.json is a list of ``{"name": ..., "argv": [...]}`` (``"env"``: variables for that run only).
Each run goes through the command line's own ``main(argv)`` (what ``launch/train_actor.py`` exits
with): its checks, process group, model, steps and close, which destroys the process group; the
next run makes a new one on a new rendezvous port (a new group on torchrun's own store would read
the old group's keys). Importing torch and megatron-core costs most of a 2-core launch; a run
after that costs ~1 s. Rank 0 writes ``{name: exit status}`` to RESULT.json.

After each run its model and process groups are freed (``batch_runs.end_run``, which also
records the rank's thread count for tests/distributed/test_harness_threads.py).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch

from megatron_pg_agg.online.cli import main
from megatron_pg_agg.training import trainer
from tests.support.batch_runs import announce, end_run, exit_status, run_environment, serve
from tests.support.whole_grads import whole_named_grads, whole_named_params

GRADS_VARIABLE = "PG_AGG_TEST_GRADS"


def _dumping_gradients(optimizer_step):
    """``trainer._optimizer_step`` that first writes the step's whole gradient (see the docstring);
    the original's own, once (a forked launch may run this module again in the same process)."""
    optimizer_step = getattr(optimizer_step, "_dumps_from", optimizer_step)

    def dumping_optimizer_step(s, result, pg_weight, key):
        prefix = os.environ.get(GRADS_VARIABLE)
        if prefix:
            grads = whole_named_grads(s.model)
            torch.save(grads, f"{prefix}.iter{s.state.iteration + 1}.rank{s.rank}.pt")
            if s.state.iteration == 0:  # the initial weights, for a reference of this layout
                torch.save(whole_named_params(s.model), f"{prefix}.weights.rank{s.rank}.pt")
        return optimizer_step(s, result, pg_weight, key)

    dumping_optimizer_step._dumps_from = optimizer_step
    return dumping_optimizer_step


def run_all(runs: list) -> dict:
    status = {}
    agent = (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
    for index, run in enumerate(runs):
        if index and "RANK" in os.environ:
            _fresh_rendezvous(agent, index)
        announce(run)
        with run_environment(run):
            status[run["name"]] = exit_status(main, list(run["argv"]))
            end_run()
    return status


def _fresh_rendezvous(agent: tuple, index: int) -> None:
    """Rank 0 picks a free port for run ``index`` and shares it through torchrun's store; rank 0
    then hosts the run's own store there (as a launch without torchrun's agent would)."""
    from torch.distributed import TCPStore

    from megatron_pg_agg.megatron.parallel import free_port

    store = TCPStore(agent[0], int(agent[1]), is_master=False, timeout=timedelta(seconds=120))
    key = f"trainer_runs/{index}/port"
    if os.environ["RANK"] == "0":
        store.set(key, str(free_port()))
    os.environ["MASTER_PORT"] = store.get(key).decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


if __name__ == "__main__":
    trainer._optimizer_step = _dumping_gradients(trainer._optimizer_step)
    serve(run_all)
