"""What a checkpoint fixes, and the start-up check of a resume against it (host only, before any
process group or model exists).

Every checkpoint holds ``iter_XXXXXXX/run.json`` (:func:`run_record`, written by rank 0): the
settings its state depends on and the coordinates of each rank's file. ``--load`` compares them
with the run's flags (:func:`resume_problems`), and a resume either continues exactly or is refused:

- **fixed** (refused when changed): TP, PP, the virtual pipeline, CP, EP, the model's shape and the
  loss mode (and constant's divisor). A model's tensors are cut by TP/PP/EP and a CP or expert
  layout is not resharded here; a changed objective is not a continuation.
- **honoured**: the data-parallel size, the distributed optimizer on or off, ``--ddp-bucket-size``,
  the overlaps and the precision (``--bf16`` on or off). The optimizer state is saved in model
  space (each rank's range of each parameter: fp32 main value, Adam's moments and step) and each
  rank of the new run assembles its own ranges from the files of the same TP/PP/EP coordinates
  (:mod:`~megatron_pg_agg.training.checkpoint`). The main parameters always come from the fp32
  values, so fp32 -> bf16 rounds them once, as a bf16 run started from them would, and bf16 ->
  fp32 continues from the bf16 run's fp32 main parameters, not its rounded weights.
- **the optimizer's settings** ``--lr``, ``--weight-decay``, ``--clip-grad``: Megatron-LM's rule
  (``OptimizerParamScheduler._check_and_set``). A value that differs from the checkpoint's is
  refused unless ``--override-opt_param-scheduler`` (the flags win) or
  ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's values win) says which; not both.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

RUN_RECORD = "run.json"
"""The file of each ``iter_XXXXXXX/`` folder that says what the checkpoint fixes."""
FORMAT = 2
"""The checkpoint format of :mod:`~megatron_pg_agg.training.checkpoint` this module reads (1: the files
before the run record, per-rank optimizer state on the same layout only)."""

FIXED = (
    ("--tensor-model-parallel-size", lambda cfg: cfg.parallel.tp),
    ("--pipeline-model-parallel-size", lambda cfg: cfg.parallel.pp),
    ("--num-layers-per-virtual-pipeline-stage", lambda cfg: cfg.parallel.num_layers_per_virtual_pipeline_stage),
    ("--context-parallel-size", lambda cfg: cfg.parallel.cp),
    ("--expert-model-parallel-size", lambda cfg: cfg.parallel.ep),
    ("--num-layers", lambda cfg: cfg.model.num_layers),
    ("--hidden-size", lambda cfg: cfg.model.hidden_size),
    ("--ffn-hidden-size", lambda cfg: cfg.model.ffn_hidden_size),
    ("--num-attention-heads", lambda cfg: cfg.model.num_attention_heads),
    ("--vocab-size", lambda cfg: cfg.model.vocab_size),
    ("--max-position-embeddings", lambda cfg: cfg.model.max_position_embeddings),
    ("--untie-embeddings-and-output-weights", lambda cfg: cfg.model.untie_embeddings_and_output_weights),
    ("--num-experts", lambda cfg: cfg.model.moe.num_experts),
    ("--mtp-num-layers", lambda cfg: cfg.model.mtp_num_layers),
    ("--pg-loss-aggregation", lambda cfg: cfg.loss.mode),
    ("--pg-loss-aggregation-divisor", lambda cfg: cfg.loss.divisor),
)
"""(flag, value of a run config) of every setting a resume must keep (the module docstring says why)."""

HONOURED = (
    ("--bf16", lambda cfg: cfg.model.bf16),
    ("--use-distributed-optimizer", lambda cfg: cfg.parallel.use_distributed_optimizer),
    ("--ddp-bucket-size", lambda cfg: cfg.parallel.ddp_bucket_size),
)
"""Recorded and allowed to change, beside the data-parallel size (:func:`run_record`'s own entry)."""

OPTIMIZER = (("--lr", "lr"), ("--weight-decay", "weight_decay"), ("--clip-grad", "clip_grad"))
"""(flag, TrainingConfig field) of the settings under Megatron-LM's rule."""
OVERRIDE_FLAG = "--override-opt_param-scheduler"
USE_CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"


def run_record(cfg, world_size: int) -> dict:
    """What a checkpoint of ``cfg`` on ``world_size`` ranks fixes and honours (rank 0 adds the ranks'
    coordinates when it saves)."""
    return {
        "format": FORMAT,
        "world_size": world_size,
        "data_parallel_size": cfg.parallel.dp_size(world_size),
        "fixed": {flag: value(cfg) for flag, value in FIXED},
        "honoured": {flag: value(cfg) for flag, value in HONOURED},
        "optimizer": {flag: getattr(cfg.training, field) for flag, field in OPTIMIZER},
    }


def latest_iteration(directory: str) -> Optional[int]:
    """The iteration ``latest`` names in a checkpoint directory; None when there is none yet."""
    path = os.path.join(directory, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return int(f.read().strip())


def iteration_folder(directory: str, iteration: int) -> str:
    return os.path.join(directory, f"iter_{iteration:07d}")


def read_run_record(directory: str) -> Optional[dict]:
    """The run record of the checkpoint ``latest`` names; None when there is no checkpoint yet.
    A checkpoint without one (format 1) raises ValueError, naming what to do."""
    iteration = latest_iteration(directory)
    if iteration is None:
        return None
    path = os.path.join(iteration_folder(directory, iteration), RUN_RECORD)
    if not os.path.exists(path):
        raise ValueError(f"--load {directory}: iteration {iteration} was written before checkpoints recorded their "
                         f"layout and precision ({RUN_RECORD} is missing), so a resume could not be checked; "
                         "finish that run with the megatron_pg_agg release that wrote it")
    with open(path) as f:
        return json.load(f)


def resume_problems(cfg, world_size: int) -> list:
    """Every reason to refuse resuming ``cfg.checkpoint.load`` with ``cfg`` on ``world_size`` ranks:
    one line naming each fixed flag that changed (its value and the checkpoint's), and one for the
    optimizer's settings under Megatron-LM's rule. Empty when the run may resume (or starts fresh)."""
    load = cfg.checkpoint.load
    if not load or not os.path.isdir(load):
        return []
    try:
        record = read_run_record(load)
    except ValueError as err:
        return [str(err)]
    if record is None:
        return []
    problems = []
    changed = [f"{flag} {_shown(value(cfg))} (checkpoint: {_shown(record['fixed'].get(flag))})"
               for flag, value in FIXED if _changed(value(cfg), record["fixed"].get(flag))]
    if changed:
        problems.append(f"--load {load} fixes what this run changes: {', '.join(changed)}. A resume keeps the "
                        "tensor, pipeline, context and expert layout, the model's shape and the loss mode; the "
                        "data-parallel size, precision, distributed optimizer and bucket size may change "
                        "(docs/trainer.md, Resume)")
    problems.extend(_optimizer_problems(cfg, record))
    return problems


def _optimizer_problems(cfg, record: dict) -> list:
    ckpt = cfg.checkpoint
    if ckpt.override_opt_param_scheduler and ckpt.use_checkpoint_opt_param_scheduler:
        return [f"{OVERRIDE_FLAG} and {USE_CHECKPOINT_FLAG} say opposite things: give one"]
    if ckpt.override_opt_param_scheduler or ckpt.use_checkpoint_opt_param_scheduler:
        return []
    differ = [f"{flag} {getattr(cfg.training, field)} (checkpoint: {record['optimizer'][flag]})"
              for flag, field in OPTIMIZER if _changed(getattr(cfg.training, field), record["optimizer"][flag])]
    if not differ:
        return []
    return [f"--load {cfg.checkpoint.load}: {', '.join(differ)}; as in Megatron-LM, add {OVERRIDE_FLAG} to "
            f"train with the flags' values or {USE_CHECKPOINT_FLAG} to keep the checkpoint's"]


def with_checkpoint_settings(cfg):
    """``cfg`` with the optimizer's settings of its ``--load`` checkpoint when
    ``--use-checkpoint-opt_param-scheduler`` asks for them (else ``cfg`` itself)."""
    if not (cfg.checkpoint.load and cfg.checkpoint.use_checkpoint_opt_param_scheduler):
        return cfg
    record = read_run_record(cfg.checkpoint.load)
    if record is None:
        return cfg
    values = {field: record["optimizer"][flag] for flag, field in OPTIMIZER}
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, **values))


def _changed(ours, theirs) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return ours is None or theirs is None or float(ours) != float(theirs)
    return ours != theirs


def _shown(value) -> str:
    return "(not given)" if value is None or value is False else "(given)" if value is True else str(value)
