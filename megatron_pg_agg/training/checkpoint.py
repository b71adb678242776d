"""The trainer's checkpoints: one file per rank and the run record under ``iter_XXXXXXX/``, and a
``latest`` marker written last, so an interrupted save never replaces a usable checkpoint.

A rank's file holds its model chunks' ``state_dict()`` (cut by TP/PP/EP, the same on every DP and
CP replica), its RNG states, the loop's counters, and its optimizer state **in model space**: for
every parameter this rank's optimizer holds, the range ``[start, end)`` of the flattened parameter it
owns (the whole parameter without the distributed optimizer; this rank's shard with it) and, over
that range, the fp32 main value and the inner optimizer's per-parameter state (torch Adam's
``exp_avg``, ``exp_avg_sq`` and ``step``; empty before the first step). The file says nothing of
buckets, DP size or precision, so a resume may change those (:mod:`~megatron_pg_agg.training.resume`
checks the rest at start-up): each rank of the new run reads the files of the ranks with its own
TP/PP coordinates and assembles its own ranges from theirs (:func:`load_checkpoint`).

Why not megatron-core's own formats: ``DistributedOptimizer.save_parameter_state`` gathers only
``param``/``exp_avg``/``exp_avg_sq`` and its load fails on torch's Adam (the fallback without
Transformer Engine or apex), whose state also holds ``step`` (``KeyError: 'step'``, 0.16.1); its
state dict (``optimizer.state_dict()``) is bucket space, tied to one DP size and bucket layout. The
parameters must be current when saved (:func:`~megatron_pg_agg.megatron.model.gather_parameters`,
``--overlap-param-gather``).
"""
from __future__ import annotations

import json
import os
import random

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_pg_agg.data.atomic_files import atomic_write

from .resume import RUN_RECORD, iteration_folder, latest_iteration


def save_checkpoint(directory: str, iteration: int, model, optimizer, rank: int, extra: dict,
                    record: dict) -> str:
    """Per-rank files and rank 0's run record (``record``, :func:`~.resume.run_record`, with every
    rank's coordinates added) under ``iter_XXXXXXX/``; ``latest`` is rewritten (atomically, by
    rank 0) only after every rank's file is complete, so a kill mid-save leaves the previous
    checkpoint usable."""
    path = iteration_folder(directory, iteration)
    os.makedirs(path, exist_ok=True)
    state = {
        "iteration": iteration,
        "model": [chunk.state_dict() for chunk in model],
        "optimizer": optimizer_pieces(model, optimizer),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        **extra,
    }
    atomic_write(os.path.join(path, f"rank_{rank:05d}.pt"), lambda f: torch.save(state, f))
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, _coordinates())
    if rank == 0:
        text = json.dumps({**record, "iteration": iteration, "ranks": ranks}, indent=1)
        atomic_write(os.path.join(path, RUN_RECORD), lambda f: f.write(text), text=True)
    dist.barrier()
    if rank == 0:
        atomic_write(os.path.join(directory, "latest"), lambda f: f.write(f"{iteration}\n"), text=True)
    dist.barrier()
    return path


def load_checkpoint(directory: str, model, optimizer, rank: int) -> dict:
    """Restore this rank's state from the checkpoint ``latest`` names; {} when there is none.

    The model's tensors come from a rank of the checkpoint with this rank's TP/PP/EP coordinates
    (this rank's own file when the layout is the same); then every parameter this rank's optimizer
    holds is set from the fp32 main values of the checkpoint (the whole parameter, and the main
    copy over this rank's range), and Adam's state over this rank's range, assembled from the files
    of this rank's TP/PP coordinates (:func:`assemble`). The run record was checked at start-up."""
    iteration = latest_iteration(directory)
    if iteration is None:
        return {}
    path = iteration_folder(directory, iteration)
    with open(os.path.join(path, RUN_RECORD)) as f:
        ranks = json.load(f)["ranks"]
    here = _coordinates()
    peers = [r for r, c in enumerate(ranks) if (c["tp"], c["pp"]) == (here["tp"], here["pp"])]
    same = [r for r in peers if _same_coordinates(ranks[r], here, ("ep", "dp", "cp"))] or \
        [r for r in peers if ranks[r]["ep"] == here["ep"]]
    files = {r: _load(path, r) for r in peers}
    source = files[same[0]]
    for chunk, sd in zip(model, source["model"]):
        chunk.load_state_dict(sd)
    pieces = {}
    for r in peers:
        for key, piece in files[r]["optimizer"].items():
            pieces.setdefault(key, []).append({**piece, "ep": ranks[r]["ep"]})
    _restore_optimizer(model, optimizer, pieces, ep=here["ep"])
    torch.set_rng_state(source["rng"]["torch"])
    random.setstate(source["rng"]["python"])
    return source


def _same_coordinates(a: dict, b: dict, keys) -> bool:
    return all(a[k] == b[k] for k in keys)


def _load(path: str, rank: int) -> dict:
    # tensors, numbers, strings and tuples only (no pickled code runs on load); mmap: a peer's
    # file is read only where its ranges are used
    return torch.load(os.path.join(path, f"rank_{rank:05d}.pt"), map_location="cpu", weights_only=True, mmap=True)


def _coordinates() -> dict:
    """This rank's place in the layout (what :func:`load_checkpoint` matches files by)."""
    return {"tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "ep": parallel_state.get_expert_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank(),
            "cp": parallel_state.get_context_parallel_rank()}


# ----------------------------------------------------------------------------- optimizer state in model space


def optimizer_pieces(model, optimizer) -> dict:
    """``{chunk/name: {"start", "end", "numel", "expert", "param", "state"}}``: this rank's range of
    every parameter its optimizer holds, with the fp32 main value and the inner optimizer's state
    over it (the module docstring)."""
    pieces = {}
    for key, param, (start, end), main, state in _held_parameters(model, optimizer):
        pieces[key] = {"start": start, "end": end, "numel": param.numel(),
                       "expert": not getattr(param, "allreduce", True),
                       "param": main.detach().float().reshape(-1).clone(),
                       "state": {k: v.detach().reshape(-1).clone() if v.dim() else v.detach().clone()
                                 for k, v in state.items() if torch.is_tensor(v)}}
    return pieces


def _restore_optimizer(model, optimizer, pieces: dict, *, ep: int) -> None:
    """Set every held parameter, its main copy and its Adam state from ``pieces`` (all the matching
    files' pieces of each key)."""
    for key, param, (start, end), main, state in _held_parameters(model, optimizer):
        found = [p for p in pieces.get(key, []) if not p["expert"] or p["ep"] == ep]
        if not found or found[0]["numel"] != param.numel():
            raise ValueError(f"the checkpoint has no optimizer state for {key} of {param.numel()} elements")
        whole = assemble(found, "param", 0, param.numel())
        param.data.copy_(whole.view_as(param))  # rounds once to a 16-bit parameter
        main.data.copy_(whole[start:end].view_as(main))
        names = found[0]["state"].keys()
        state.clear()
        state.update({name: _shaped(assemble(found, name, start, end, like=found[0]["state"][name]), main)
                      for name in names})


def _shaped(value: torch.Tensor, main: torch.Tensor) -> torch.Tensor:
    """A per-element state shaped like its main parameter (a scalar as it is)."""
    return value.view_as(main) if value.dim() else value


def assemble(pieces: list, name: str, start: int, end: int, like=None) -> torch.Tensor:
    """The values of ``name`` over ``[start, end)`` of a flattened parameter from saved ranges
    (``{"start", "end", "param", "state"}``; replicas may overlap and hold equal values). A
    per-parameter scalar (Adam's ``step``) is taken as it is. ValueError when a part is missing."""
    if like is not None and like.dim() == 0:
        return like.clone()
    out = torch.empty(end - start, dtype=torch.float32)
    covered = start
    for piece in sorted(pieces, key=lambda p: p["start"]):
        lo, hi = max(piece["start"], covered), min(piece["end"], end)
        if lo > covered:
            break
        if hi > lo:
            values = piece["param"] if name == "param" else piece["state"][name]
            out[lo - start:hi - start] = values[lo - piece["start"]:hi - piece["start"]].float()
            covered = hi
    if covered < end:
        raise ValueError(f"the checkpoint's ranges of {name} stop at element {covered} of [{start}, {end})")
    return out if like is None else out.to(like.dtype)


def _held_parameters(model, optimizer):
    """``(key, model parameter, (start, end), main parameter, inner optimizer state)`` of every
    parameter this rank's optimizer holds a part of, in a fixed order."""
    names = {id(p): f"{i}/{_plain_name(n)}" for i, chunk in enumerate(model) for n, p in chunk.named_parameters()}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param, rng, main in _main_parameters(opt):
            yield names[id(param)], param, rng, main, opt.optimizer.state[main]


def _main_parameters(opt):
    """``(model parameter, (start, end), main parameter)`` of one megatron-core optimizer: the
    distributed optimizer's shards (``model_param_group_index_map``, the range from its gbuf map),
    the mixed-precision optimizer's fp32 copies, or the fp32 optimizer's own parameters."""
    if hasattr(opt, "model_param_group_index_map"):
        for param, (group, order) in opt.model_param_group_index_map.items():
            rng = opt._get_model_param_range_map(param)["param"]
            yield param, (rng.start, rng.end), opt.optimizer.param_groups[group]["params"][order]
    elif hasattr(opt, "fp32_from_float16_groups"):
        for halves, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for param, main in zip(halves, mains):
                yield param, (0, param.numel()), main
        for group in opt.fp32_from_fp32_groups:
            for param in group:
                yield param, (0, param.numel()), param
    else:
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                yield param, (0, param.numel()), param


def _plain_name(name: str) -> str:
    """A parameter's name without the wrappers' ``module.`` prefixes (DDP, Float16Module)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name
