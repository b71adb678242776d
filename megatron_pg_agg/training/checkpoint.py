"""The trainer's checkpoints: one file per rank under ``iter_XXXXXXX/`` and a ``latest`` marker
written last, so an interrupted save never replaces a usable checkpoint."""
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
        "optimizer": optimizer.state_dict(),
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
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state
