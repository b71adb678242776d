"""AReaL (1.0.x, its Megatron actor's loss path) for the audit.

Config: AReaL's own loader, ``parse_cli_args`` and ``to_structured_cfg`` into ``GRPOConfig`` (what
``load_expr_config`` does before it sets up name resolution and saves the config: left out, the audit
runs nothing), over ``--config FILE`` (an AReaL experiment YAML) and its ``key=value`` overrides; a
key AReaL does not know is refused by it.

Split, AReaL's code: the single controller's ``ppo_update`` hands each DP rank its share of the step's
prompt-group records (``TrainController._dispatch_tensors``: ``balanced_greedy_partition`` of the
groups by tokens, the same number of groups per rank; called here on one record per group, as its
grouped rollout workflow makes them); each rank's actor concatenates them (``batched_call``) and
its ``_ppo_update`` cuts them into ``actor.ppo_n_minibatches`` optimizer steps with
``split_padded_tensor_dict_into_mb_list``; the engine's ``train_batch`` cuts each rank's step by
``actor.mb_spec`` (the same splitter) and packs each micro-batch (``pack_tensor_dict``). Stock loss:
AReaL's ``grpo_loss_fn`` (PPO clip, the decoupled loss's behaviour weight, M2PO's
``_apply_m2po_masking`` per micro-batch) on each micro-batch, weighed as the engine weighs it,
``sum_i L_i w_i / W`` over the micro-batches ``i`` of every DP rank's part of the step, ``w_i =
loss_mask.count_nonzero()`` (the actor's ``loss_weight_fn``), ``W`` their sum over every rank
(``compute_total_loss_weight``'s all-reduce; the engine's factor DP cancels DDP's average): written
out here, since ``train_batch`` needs a model. DP: AReaL's own parser of ``actor.backend``
(``ModelAllocation.from_str``, e.g. ``megatron:d4p1t1`` is DP 4), or the audit's ``--dp``, which
overrides it; the splits are the configured DP and DP 1, each with the micro-batch splits. With
M2PO, DP changes which rows share a micro-batch, so the stock loss moves with it. (AReaL's SPMD mode,
``AREAL_SPMD_MODE=1``, redistributes the trajectories otherwise, ``redistribute_trajectories`` over a
process group; the audit follows the single controller, AReaL's default.)

Plug-in line: ``use_pg_agg(config, "token_mean")``: the plug-in's whole-group steps
(``whole_group_minibatches``, on each rank's records), its step weights (``prepare_step``, M2PO chosen
once per step over every rank: called here on the ranks' parts laid end to end in rank order, which is
what its gather over DP sees) and ``exact_loss_fn`` around AReaL's loss, under the same splits.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from megatron_pg_agg.audit.batch import BatchShape
from megatron_pg_agg.audit.hosts import HostConfig, HostMissing, HostRefusal, command_line
from megatron_pg_agg.audit.measure import Split, SplitRefused

__all__ = ["INSTALL", "load", "plugin", "stock"]

INSTALL = ("pip install --no-deps areal==1.0.4 mbridge==0.15.1 && pip install 'megatron_pg_agg[areal]' in a venv "
           "of its own (docs/areal.md)")
PROMPT = 8
"""Prompt tokens of every synthetic row."""


def _load_config(config, overrides: list):
    from areal.api.cli_args import GRPOConfig, parse_cli_args, to_structured_cfg  # noqa: PLC0415
    from omegaconf import OmegaConf  # noqa: PLC0415

    if not config:
        raise HostRefusal("AReaL's config: --config FILE (an AReaL experiment YAML) is required")
    try:
        cfg, _ = parse_cli_args(["--config", config, *overrides])
        return OmegaConf.to_object(to_structured_cfg(cfg, config_cls=GRPOConfig))
    except Exception as error:  # noqa: BLE001  (AReaL's and OmegaConf's own refusals, reported as they are)
        raise HostRefusal(f"AReaL's config: {error}".replace("\n", " ")) from None


def _formula(actor, dp: int) -> str:
    m2 = (f"; M2PO (actor.m2_threshold={actor.m2_threshold}) drops tokens per micro-batch and divides by the kept "
          "count" if actor.m2_threshold is not None else "")
    return (f"J_step = sum_i (w_i / W) L_i over the micro-batches of every DP rank (DP {dp}), L_i = the micro-batch's "
            "token mean (grpo_loss_fn), w_i its valid tokens: a token mean over each of "
            f"actor.ppo_n_minibatches={actor.ppo_n_minibatches} steps" + m2)


def _splits(actor, dp: int) -> list:
    """The configured ``actor.mb_spec``, twice its ``n_mbs``, half and twice its token cap; at the
    configured DP and at DP 1."""
    spec = actor.mb_spec
    specs = [("configured actor.mb_spec", spec)]
    for name, change in (("n_mbs", {"n_mbs": 2 * (spec.n_mbs or 1)}),
                         ("max_tokens_per_mb / 2", {"max_tokens_per_mb": (spec.max_tokens_per_mb or 0) // 2}),
                         ("max_tokens_per_mb x 2", {"max_tokens_per_mb": 2 * (spec.max_tokens_per_mb or 0)})):
        if "max_tokens_per_mb" in change and not spec.max_tokens_per_mb:
            continue
        specs.append((f"{name} ({', '.join(f'{k}={v}' for k, v in change.items())})",
                      dataclasses.replace(spec, **change)))
    return [Split(f"{name}, DP {d}", {"spec": s, "dp": d}) for d in dict.fromkeys([dp, 1]) for name, s in specs]


def _dp(cfg, options) -> tuple:
    """``(DP size, where it comes from)``: the audit's ``--dp``, else AReaL's own parser of ``actor.backend``."""
    if options.dp is not None:
        return options.dp, "--dp"
    from areal.api.alloc_mode import ModelAllocation  # noqa: PLC0415

    try:
        return ModelAllocation.from_str(cfg.actor.backend, name="actor").parallel.dp_size, "actor.backend"
    except Exception as error:  # noqa: BLE001  (AReaL's own refusal of the string, reported as it is)
        raise HostRefusal(f"AReaL's config: the DP size from actor.backend={cfg.actor.backend!r}: {error}; "
                          "give it with --dp N") from None


def load(config, overrides: list, argv: list, options) -> HostConfig:
    try:
        import areal.trainer.ppo.actor  # noqa: F401, PLC0415
    except ImportError as error:
        raise HostMissing(f"AReaL does not import here ({error}); to install: {INSTALL}") from None
    cfg = _load_config(config, command_line(None, overrides, argv))
    actor = cfg.actor
    dp, source = _dp(cfg, options)
    shape = BatchShape(cfg.gconfig.n_samples, cfg.train_dataset.batch_size, cfg.gconfig.max_new_tokens, options.seed)
    settings = {"actor.ppo_n_minibatches": actor.ppo_n_minibatches, "actor.mb_spec": actor.mb_spec,
                "actor.m2_threshold": actor.m2_threshold, "actor.use_decoupled_loss": actor.use_decoupled_loss,
                "gconfig.n_samples": cfg.gconfig.n_samples, "train_dataset.batch_size": cfg.train_dataset.batch_size,
                f"DP ({source})": dp}
    fix = ("use_pg_agg(config, 'token_mean') after load_expr_config in the training script "
           "(launch/areal_gsm8k_grpo.py, docs/areal.md)")
    return HostConfig(shape, _formula(actor, dp), settings, _splits(actor, dp), fix, cfg)


def _padded(batch, leaves: list) -> dict:
    """The rollout as AReaL's actor holds it: padded rows, prompt then response; ``prox_logp`` the batch's
    old log-probs (the clip's reference), ``logprobs`` (the behaviour policy's) its reference log-probs."""
    width = PROMPT + max(batch.lengths)
    rows = batch.rows
    data = {name: torch.zeros(rows, width) for name in ("loss_mask", "logprobs", "prox_logp", "advantages")}
    attention = torch.zeros(rows, width, dtype=torch.bool)
    current = []
    for i, n in enumerate(batch.lengths):
        attention[i, :PROMPT + n] = True
        data["loss_mask"][i, PROMPT:PROMPT + n] = batch.masks[i].float()
        data["prox_logp"][i, PROMPT:PROMPT + n] = batch.old_logprobs[i]
        data["logprobs"][i, PROMPT:PROMPT + n] = batch.ref_logprobs[i]
        data["advantages"][i, PROMPT:PROMPT + n] = batch.advantages[i]
        current.append(torch.cat([torch.zeros(PROMPT), leaves[i], torch.zeros(width - PROMPT - n)]))
    data.update(input_ids=attention.long(), attention_mask=attention, _current=torch.stack(current),
                _row=torch.arange(rows).unsqueeze(1).expand(rows, width).clone(),
                pg_agg_group=torch.tensor(batch.group_ids).unsqueeze(1).expand(rows, width).clone())
    return data


def _loss(actor):
    from areal.trainer.ppo.actor import grpo_loss_fn  # noqa: PLC0415

    return functools.partial(grpo_loss_fn, eps_clip=actor.eps_clip, eps_clip_higher=actor.eps_clip_higher,
                             c_clip=actor.c_clip, m2_threshold=actor.m2_threshold,
                             use_decoupled_loss=actor.use_decoupled_loss)


def _group_records(data: dict, batch) -> list:
    """One record per prompt group (AReaL's grouped rollout workflow's), rows of ``data`` in order."""
    bounds = [i for i in range(batch.rows + 1) if i in (0, batch.rows) or batch.group_ids[i] != batch.group_ids[i - 1]]
    return [{k: v[a:b] for k, v in data.items()} for a, b in zip(bounds, bounds[1:])]


def _ranks(data: dict, batch, dp: int) -> list:
    """Each DP rank's batch: AReaL's dispatch of the group records (``_dispatch_tensors``), concatenated
    as the rank's actor does (``concat_batch``)."""
    from areal.infra.controller.train_controller import _dispatch_tensors  # noqa: PLC0415
    from areal.utils.data import concat_batch  # noqa: PLC0415

    try:
        shards, _ = _dispatch_tensors(_group_records(data, batch), dp)
    except ValueError as error:  # AReaL's refusal: the groups do not divide among the ranks
        raise SplitRefused(f"AReaL's dispatch over DP {dp}: {error}") from None
    return [concat_batch(shard)[0] for shard in shards]


def _by_step(per_rank: list, key: str) -> list:
    """``[step][rank]`` from ``[rank][step]``; every rank has the same number of steps."""
    if len({len(steps) for steps in per_rank}) != 1:
        raise SplitRefused(f"{key}: the DP ranks have different numbers of optimizer steps "
                           f"({[len(steps) for steps in per_rank]})")
    return [list(step) for step in zip(*per_rank)]


def _step_objective(parts: list, spec, loss) -> torch.Tensor:
    """The engine's ``train_batch`` on one step, ``parts`` its part on each DP rank: AReaL's split and
    packing per rank, ``sum_i L_i w_i / W`` with ``W`` over every rank's micro-batches."""
    from areal.utils.data import pack_tensor_dict, split_padded_tensor_dict_into_mb_list  # noqa: PLC0415

    packed = [pack_tensor_dict(mb) for part in parts for mb in split_padded_tensor_dict_into_mb_list(part, spec).mbs]
    weights = [mb["loss_mask"].count_nonzero() for mb in packed]
    total = 0
    for mb, w in zip(packed, weights):
        if w == 0:  # the engine's micro-batch of weight 0 adds nothing
            continue
        logp = mb.pop("_current")
        total = total + loss(logp, torch.zeros_like(logp), mb) * w / sum(weights)
    return total


def _members(parts: list) -> list:
    return [i for part in parts for i in part["_row"][:, 0].tolist()]


def stock(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from areal.api.cli_args import MicroBatchSpec  # noqa: PLC0415
    from areal.utils.data import split_padded_tensor_dict_into_mb_list  # noqa: PLC0415

    actor = config.host.actor
    steps = MicroBatchSpec(n_mbs=actor.ppo_n_minibatches)
    per_rank = [split_padded_tensor_dict_into_mb_list(rank, steps).mbs
                for rank in _ranks(_padded(batch, leaves), batch, split.settings["dp"])]
    objectives, members = [], []
    for parts in _by_step(per_rank, "actor.ppo_n_minibatches"):
        members.append(_members(parts))
        objectives.append(_step_objective(parts, split.settings["spec"], _loss(actor)))
    return objectives, members


def plugin(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from areal.utils.data import concat_padded_tensors  # noqa: PLC0415

    from megatron_pg_agg.integrations.areal.loss import (  # noqa: PLC0415
        exact_loss_fn,
        prepare_step,
        take_rows,
        whole_group_minibatches,
    )

    actor = config.host.actor
    ranks = _ranks(_padded(batch, leaves), batch, split.settings["dp"])
    per_rank = [[take_rows(rank, rows) for rows in whole_group_minibatches(rank, actor.ppo_n_minibatches)]
                for rank in ranks]
    objectives, members = [], []
    for parts in _by_step(per_rank, "actor.ppo_n_minibatches"):
        step = prepare_step(concat_padded_tensors(parts), mode="token_mean", divisor=None,
                            m2_threshold=actor.m2_threshold)
        ends = torch.tensor([0] + [p["attention_mask"].shape[0] for p in parts]).cumsum(0).tolist()
        parts = [take_rows(step, list(range(a, b))) for a, b in zip(ends, ends[1:])]
        members.append(_members(parts))
        objectives.append(_step_objective(parts, split.settings["spec"], exact_loss_fn(_loss(actor))))
    return objectives, members
