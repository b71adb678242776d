"""AReaL (1.0.x, its Megatron actor's loss path) for the audit.

Config: AReaL's own loader, ``parse_cli_args`` and ``to_structured_cfg`` into ``GRPOConfig`` (what
``load_expr_config`` does before it sets up name resolution and saves the config: left out, the audit
runs nothing), over ``--config FILE`` (an AReaL experiment YAML) and its ``key=value`` overrides; a
key AReaL does not know is refused by it.

Split, AReaL's code: the actor's ``_ppo_update`` cuts the rank's batch into
``actor.ppo_n_minibatches`` optimizer steps with ``split_padded_tensor_dict_into_mb_list``; the
engine's ``train_batch`` cuts each step by ``actor.mb_spec`` (the same splitter) and packs each
micro-batch (``pack_tensor_dict``). Stock loss: AReaL's ``grpo_loss_fn`` (PPO clip, the decoupled
loss's behaviour weight, M2PO's ``_apply_m2po_masking`` per micro-batch) on each micro-batch, weighed
as the engine weighs it, ``L_i w_i / W`` with ``w_i = loss_mask.count_nonzero()`` (the actor's
``loss_weight_fn``) and ``W`` their sum: written out here, since ``train_batch`` needs a model. One DP
rank: AReaL sums ``W`` over the DP ranks, so the DP size changes which rows a rank splits, not the
formula; the audit does not enumerate it.

Plug-in line: ``use_pg_agg(config, "token_mean")``: the plug-in's whole-group steps
(``whole_group_minibatches``), its step weights (``prepare_step``, M2PO chosen once per step) and
``exact_loss_fn`` around AReaL's loss, under the same micro-batch splits.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from megatron_pg_agg.audit.batch import BatchShape
from megatron_pg_agg.audit.hosts import HostConfig, HostMissing, HostRefusal, command_line
from megatron_pg_agg.audit.measure import Split

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


def _formula(actor) -> str:
    m2 = (f"; M2PO (actor.m2_threshold={actor.m2_threshold}) drops tokens per micro-batch and divides by the kept "
          "count" if actor.m2_threshold is not None else "")
    return (f"J_step = sum_i (w_i / W) L_i, L_i = the micro-batch's token mean (grpo_loss_fn), w_i its valid tokens: "
            f"a token mean over each of actor.ppo_n_minibatches={actor.ppo_n_minibatches} steps" + m2)


def _splits(actor) -> list:
    spec = actor.mb_spec
    splits = [Split("configured actor.mb_spec", {"spec": spec})]
    for name, change in (("n_mbs", {"n_mbs": 2 * (spec.n_mbs or 1)}),
                         ("max_tokens_per_mb / 2", {"max_tokens_per_mb": (spec.max_tokens_per_mb or 0) // 2}),
                         ("max_tokens_per_mb x 2", {"max_tokens_per_mb": 2 * (spec.max_tokens_per_mb or 0)})):
        if "max_tokens_per_mb" in change and not spec.max_tokens_per_mb:
            continue
        new = dataclasses.replace(spec, **change)
        splits.append(Split(f"{name} ({', '.join(f'{k}={v}' for k, v in change.items())})", {"spec": new}))
    return splits


def load(config, overrides: list, argv: list, options) -> HostConfig:
    try:
        import areal.trainer.ppo.actor  # noqa: F401, PLC0415
    except ImportError as error:
        raise HostMissing(f"AReaL does not import here ({error}); to install: {INSTALL}") from None
    cfg = _load_config(config, command_line(None, overrides, argv))
    actor = cfg.actor
    shape = BatchShape(cfg.gconfig.n_samples, cfg.train_dataset.batch_size, cfg.gconfig.max_new_tokens, options.seed)
    settings = {"actor.ppo_n_minibatches": actor.ppo_n_minibatches, "actor.mb_spec": actor.mb_spec,
                "actor.m2_threshold": actor.m2_threshold, "actor.use_decoupled_loss": actor.use_decoupled_loss,
                "gconfig.n_samples": cfg.gconfig.n_samples, "train_dataset.batch_size": cfg.train_dataset.batch_size}
    fix = ("use_pg_agg(config, 'token_mean') after load_expr_config in the training script "
           "(launch/areal_gsm8k_grpo.py, docs/areal.md)")
    return HostConfig(shape, _formula(actor), settings, _splits(actor), fix, cfg)


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


def _step_objective(step: dict, spec, loss) -> torch.Tensor:
    """The engine's ``train_batch`` on one step: AReaL's split and packing, ``sum_i L_i w_i / W``."""
    from areal.utils.data import pack_tensor_dict, split_padded_tensor_dict_into_mb_list  # noqa: PLC0415

    packed = [pack_tensor_dict(mb) for mb in split_padded_tensor_dict_into_mb_list(step, spec).mbs]
    weights = [mb["loss_mask"].count_nonzero() for mb in packed]
    total = 0
    for mb, w in zip(packed, weights):
        if w == 0:  # the engine's micro-batch of weight 0 adds nothing
            continue
        logp = mb.pop("_current")
        total = total + loss(logp, torch.zeros_like(logp), mb) * w / sum(weights)
    return total


def stock(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from areal.api.cli_args import MicroBatchSpec  # noqa: PLC0415
    from areal.utils.data import split_padded_tensor_dict_into_mb_list  # noqa: PLC0415

    actor = config.host.actor
    data = _padded(batch, leaves)
    steps = split_padded_tensor_dict_into_mb_list(data, MicroBatchSpec(n_mbs=actor.ppo_n_minibatches)).mbs
    objectives, members = [], []
    for step in steps:
        members.append(step["_row"][:, 0].tolist())
        objectives.append(_step_objective(step, split.settings["spec"], _loss(actor)))
    return objectives, members


def plugin(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from megatron_pg_agg.integrations.areal.loss import (  # noqa: PLC0415
        exact_loss_fn,
        prepare_step,
        take_rows,
        whole_group_minibatches,
    )

    actor = config.host.actor
    data = _padded(batch, leaves)
    objectives, members = [], []
    for rows in whole_group_minibatches(data, actor.ppo_n_minibatches):
        step = prepare_step(take_rows(data, rows), mode="token_mean", divisor=None, m2_threshold=actor.m2_threshold)
        members.append(list(rows))
        objectives.append(_step_objective(step, split.settings["spec"], exact_loss_fn(_loss(actor))))
    return objectives, members


