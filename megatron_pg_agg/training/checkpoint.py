"""The trainer's checkpoints: one file per rank under ``iter_XXXXXXX/`` and a ``latest`` marker
written last, so an interrupted save never replaces a usable checkpoint.

With ``--use-distributed-optimizer`` each rank's optimizer state is its shard: for each
distributed optimizer of the chain, its torch optimizer's ``state_dict()`` (Adam's moments and
step over this rank's shard of the main parameters) and the fp32 main-parameter shards of 16-bit
parameters (``--bf16``; an fp32 run's shards are views of the parameters saved with the model).
megatron-core's own ``save_parameter_state`` gathers only ``param``/``exp_avg``/``exp_avg_sq``
and its load fails on torch's Adam (the fallback without Transformer Engine or apex), whose state
also holds ``step`` (``KeyError: 'step'``, megatron-core 0.16.1). Like the rest of the file, a
shard is restored on the same layout. The parameters must be current when saved
(:func:`~megatron_pg_agg.megatron.model.gather_parameters`, ``--overlap-param-gather``)."""
from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

from megatron_pg_agg.data.atomic_files import atomic_write


def save_checkpoint(directory: str, iteration: int, model, optimizer, rank: int, extra: dict) -> str:
    """Per-rank files under ``iter_XXXXXXX/``; ``latest`` is rewritten (atomically, by rank 0) only
    after every rank's file is complete, so a kill mid-save leaves the previous checkpoint usable."""
    path = os.path.join(directory, f"iter_{iteration:07d}")
    os.makedirs(path, exist_ok=True)
    state = {
        "iteration": iteration,
        "model": [chunk.state_dict() for chunk in model],
        "optimizer": _sharded_state(optimizer) if _sharded(model) else optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        **extra,
    }
    atomic_write(os.path.join(path, f"rank_{rank:05d}.pt"), lambda f: torch.save(state, f))
    dist.barrier()
    if rank == 0:
        atomic_write(os.path.join(directory, "latest"), lambda f: f.write(f"{iteration}\n"), text=True)
    dist.barrier()
    return path


def load_checkpoint(directory: str, model, optimizer, rank: int) -> dict:
    """Restore this rank's state from the checkpoint ``latest`` names; {} when there is none."""
    latest = os.path.join(directory, "latest")
    if not os.path.exists(latest):
        return {}
    with open(latest) as f:
        iteration = int(f.read().strip())
    path = os.path.join(directory, f"iter_{iteration:07d}", f"rank_{rank:05d}.pt")
    # tensors, numbers, strings and tuples only (no pickled code runs on load)
    state = torch.load(path, map_location="cpu", weights_only=True)
    for chunk, sd in zip(model, state["model"]):
        chunk.load_state_dict(sd)
    if _sharded(model):
        _load_sharded_state(optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state


def _sharded(model) -> bool:
    """Whether the optimizer over ``model`` is megatron-core's distributed optimizer."""
    return bool(model[0].ddp_config.use_distributed_optimizer)


def _distributed_optimizers(optimizer) -> list:
    """The distributed optimizers of megatron-core's (chained) optimizer, in order."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _sharded_state(optimizer) -> list:
    """This rank's shard of the optimizer state (the module docstring says what and why)."""
    return [{"inner": opt.optimizer.state_dict(),
             "main": [[p.detach().clone() for p in group] for group in opt.shard_fp32_from_float16_groups]}
            for opt in _distributed_optimizers(optimizer)]


def _load_sharded_state(optimizer, states: list) -> None:
    """Restore :func:`_sharded_state` in place."""
    for opt, saved in zip(_distributed_optimizers(optimizer), states):
        opt.optimizer.load_state_dict(saved["inner"])
        for group, values in zip(opt.shard_fp32_from_float16_groups, saved["main"]):
            for param, value in zip(group, values):
                param.data.copy_(value)
