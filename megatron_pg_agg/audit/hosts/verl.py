"""verl (0.9.x, Megatron engine) for the audit.

Config: verl's own Hydra composition, as ``verl.trainer.main_ppo`` does it: ``ppo_megatron_trainer``
from verl's installed ``trainer/config`` (``--config FILE``: a YAML of a user's, composed from its own
folder) with the Hydra ``key=value`` overrides; a key verl does not know is refused by Hydra. The
actor's config is verl's ``McoreActorConfig`` through verl's ``omega_conf_to_dataclass`` (its checks).

Split, all verl's code: the rollout's rows (``data.train_batch_size`` prompts x ``rollout.n``) go
through the trainer's ``_balance_batch`` (``trainer.balance_batch``) on a trainer holding the config,
``DataProto.chunk`` over the DP ranks, each rank's ``tu.make_iterator`` (mini-batches of
``ppo_mini_batch_size x rollout.n / DP`` rows, ``shuffle``, one epoch) as ``train_mini_batch`` does,
and the engine's ``prepare_micro_batches`` (``ppo_micro_batch_size_per_gpu`` or, with
``use_dynamic_bsz``, ``ppo_max_token_len_per_gpu``). Each rank's mini-batch is laid out as verl's
trainer hands it to the engine (``left_right_2_no_padding``, the response fields jagged: the v1
layout, where each micro-batch is padded to its own longest response).

Stock loss: verl's ``ppo_loss`` (``workers/utils/losses.py``: the registered policy loss and
``agg_loss`` with the step's ``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``) per micro-batch on the log-probs; the Megatron engine multiplies each by the
micro-batch count and megatron-core's schedule divides by it, DDP averages over DP: a step's J is
the sum over micro-batches and ranks over DP.

Plug-in line: ``actor.policy_loss.loss_mode=pg_agg`` with ``actor_rollout_ref.pg_agg.mode=token_mean``:
the plug-in's ``VerlPGLoss`` over the same steps and micro-batches, its step weights prepared on the
step's rows (in a run they are gathered over DP: tests/distributed/test_verl.py).
"""
from __future__ import annotations

import os
import types

import torch

from megatron_pg_agg.audit.batch import BatchShape
from megatron_pg_agg.audit.hosts import HostConfig, HostMissing, HostRefusal, command_line
from megatron_pg_agg.audit.measure import Split

__all__ = ["INSTALL", "load", "plugin", "stock"]

INSTALL = "pip install --no-deps verl==0.9.1 && pip install 'megatron_pg_agg[verl]' (docs/verl.md)"
PROMPT = 16
"""Prompt tokens of every synthetic row (verl's dynamic batching counts the whole sequence)."""
ACTOR = "actor_rollout_ref.actor"


def _compose(config, overrides: list):
    import verl  # noqa: PLC0415
    from hydra import compose, initialize_config_dir  # noqa: PLC0415
    from hydra.core.global_hydra import GlobalHydra  # noqa: PLC0415
    from hydra.errors import HydraException  # noqa: PLC0415
    from omegaconf.errors import OmegaConfBaseException  # noqa: PLC0415

    folder, name = os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), "ppo_megatron_trainer"
    if config:
        folder, name = os.path.dirname(os.path.abspath(config)), os.path.splitext(os.path.basename(config))[0]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=folder, version_base=None):
            return compose(config_name=name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as error:
        raise HostRefusal(f"verl's Hydra config: {error}".replace("\n", " ")) from None


def _dp(cfg) -> int:
    mega = cfg.actor_rollout_ref.actor.megatron
    model = mega.tensor_model_parallel_size * mega.pipeline_model_parallel_size * mega.context_parallel_size
    return max(1, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node // model)


def _formula(actor, n: int) -> str:
    mode, factor = actor.loss_agg_mode, actor.loss_scale_factor
    step = f"a mini-batch of ppo_mini_batch_size x rollout.n = {actor.ppo_mini_batch_size * n} rows"
    if mode == "token-mean":
        return f"J_step = sum_t m_t l_t / (valid tokens of the step): a token mean over {step}"
    if mode == "seq-mean-token-sum-norm":
        divisor = (f"loss_scale_factor {factor}" if factor
                   else "each micro-batch's padded width (loss_scale_factor unset)")
        return f"J_step = sum_s (sum_t m_t l_t) / {actor.ppo_mini_batch_size * n} / {divisor} over {step}"
    return f"verl's agg_loss {mode!r} (core_algos.agg_loss) over {step}"


def _scale(cfg, max_rows: int) -> int:
    """The smallest factor dividing ``data.train_batch_size`` and ``ppo_mini_batch_size`` that brings the rollout
    to at most ``max_rows`` responses with every DP rank still holding whole mini-batch rows (1: none needed)."""
    prompts, mini = cfg.data.train_batch_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    n, dp = cfg.actor_rollout_ref.rollout.n, _dp(cfg)
    for factor in range(1, mini + 1):
        fits = prompts % factor == 0 and mini % factor == 0 and (mini // factor * n) % dp == 0
        if fits and (prompts // factor * n <= max_rows):
            return factor
    return 1


def _splits(actor, dp: int) -> list:
    mbs, cap = actor.ppo_micro_batch_size_per_gpu or 1, actor.ppo_max_token_len_per_gpu
    splits = []
    for d in dict.fromkeys([dp, 1]):
        dyn = Split(f"dynamic {cap} tokens, DP {d}", {"dynamic": True, "mbs": mbs, "cap": cap, "dp": d})
        if actor.use_dynamic_bsz:
            splits.append(dyn)
        for m in dict.fromkeys([mbs, max(1, mbs // 2), 2 * mbs]):
            splits.append(Split(f"micro-batch {m}, DP {d}", {"dynamic": False, "mbs": m, "cap": cap, "dp": d}))
        if not actor.use_dynamic_bsz:
            splits.append(dyn)
    return splits


def load(config, overrides: list, argv: list, options) -> HostConfig:
    try:
        from verl.utils.config import omega_conf_to_dataclass  # noqa: PLC0415
    except ImportError as error:
        raise HostMissing(f"verl does not import here ({error}); to install: {INSTALL}") from None
    overrides = command_line(None, overrides, argv)
    cfg = _compose(config, overrides)
    factor = _scale(cfg, options.max_rows)
    if factor > 1:  # verl's loader again, with the two prompt counts divided
        mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size // factor
        cfg = _compose(config, [*overrides, f"data.train_batch_size={cfg.data.train_batch_size // factor}",
                                f"{ACTOR}.ppo_mini_batch_size={mini}"])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    n, dp = cfg.actor_rollout_ref.rollout.n, _dp(cfg)
    shape = BatchShape(n, cfg.data.train_batch_size, cfg.data.max_response_length, options.seed)
    settings = {f"{ACTOR}.{k}": getattr(actor, k) for k in (
        "loss_agg_mode", "loss_scale_factor", "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz",
        "ppo_max_token_len_per_gpu", "ppo_epochs", "shuffle")}
    settings.update({"actor_rollout_ref.rollout.n": n, "data.train_batch_size": cfg.data.train_batch_size,
                     "trainer.balance_batch": cfg.trainer.balance_batch, "DP": dp})
    if factor > 1:
        settings["audited at"] = f"1/{factor} of the prompts (data.train_batch_size, ppo_mini_batch_size; --max-rows)"
    fix = (f"{ACTOR}.policy_loss.loss_mode=pg_agg {ACTOR}.loss_agg_mode=token-mean  (docs/verl.md; or "
           "+actor_rollout_ref.pg_agg.mode=seq_mean|prompt_mean|constant)")
    return HostConfig(shape, _formula(actor, n), settings, _splits(actor, dp), fix,
                      types.SimpleNamespace(cfg=cfg, actor=actor, n=n))


def _steps(config: HostConfig, batch, dp: int) -> list:
    """``steps[k][rank]`` = the rank's rows of optimizer step k, as verl's trainer and workers make them."""
    from omegaconf import OmegaConf  # noqa: PLC0415
    from verl import DataProto  # noqa: PLC0415
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: PLC0415
    from verl.utils import tensordict_utils as tu  # noqa: PLC0415

    width = max(batch.lengths)
    response = torch.tensor([[1] * n + [0] * (width - n) for n in batch.lengths])
    attention = torch.cat([torch.ones(batch.rows, PROMPT, dtype=torch.int64), response], dim=1)
    data = DataProto.from_dict(tensors={"attention_mask": attention, "response_mask": response,
                                        "row": torch.arange(batch.rows)},
                               non_tensors={"uid": [f"p{g}" for g in batch.group_ids]})
    if config.host.cfg.trainer.balance_batch:
        trainer = object.__new__(RayPPOTrainer)  # only what _balance_batch reads
        trainer.config, trainer.use_critic = config.host.cfg, False
        trainer.actor_rollout_wg = types.SimpleNamespace(_dispatch_info={"actor": list(range(dp))})
        trainer._balance_batch(data, metrics={})
    actor = config.host.actor
    per_rank = actor.ppo_mini_batch_size * config.host.n // dp
    ranks = []
    for rank, share in enumerate(data.chunk(dp)):
        rows = tu.get_tensordict({"row": share.batch["row"]})
        loader = tu.make_iterator(rows, mini_batch_size=per_rank, epochs=1, seed=42 + rank,
                                  dataloader_kwargs={"shuffle": bool(OmegaConf.select(config.host.cfg,
                                                                                      f"{ACTOR}.shuffle"))})
        ranks.append([mini["row"].tolist() for mini in loader])
    return [list(step) for step in zip(*ranks)]


def _mini_batch(batch, rows: list, split: Split, *, dp: int, tokens: int, global_rows: int):
    """The rank's mini-batch as verl's trainer hands it to the engine (the jagged v1 layout)."""
    from tensordict import TensorDict  # noqa: PLC0415
    from verl.utils import tensordict_utils as tu  # noqa: PLC0415
    from verl.workers.utils.padding import left_right_2_no_padding  # noqa: PLC0415

    width, size = max(batch.lengths[i] for i in rows), len(rows)
    prompts, responses = torch.ones(size, PROMPT, dtype=torch.long), torch.zeros(size, width, dtype=torch.long)
    attention = torch.zeros(size, PROMPT + width, dtype=torch.long)
    fields = {name: torch.zeros(size, width) for name in ("response_mask", "old_log_probs", "advantages",
                                                          "ref_log_prob")}
    for j, i in enumerate(rows):
        n = batch.lengths[i]
        responses[j, :n] = 1
        attention[j, :PROMPT + n] = 1
        fields["response_mask"][j, :n] = batch.masks[i].float()
        fields["old_log_probs"][j, :n] = batch.old_logprobs[i]
        fields["advantages"][j, :n] = batch.advantages[i]
        fields["ref_log_prob"][j, :n] = batch.ref_logprobs[i]  # the KL term's (use_kl_loss)
    td = TensorDict({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                     "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
                     **fields}, batch_size=[size])
    tu.assign_non_tensor(td, uid=[f"p{batch.group_ids[i]}" for i in rows])
    td = left_right_2_no_padding(td)
    lengths = torch.tensor([batch.lengths[i] for i in rows])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    for name in fields:
        values = torch.cat([td[name][j, :int(lengths[j])] for j in range(size)])
        td[name] = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    td["loss_mask"] = td["response_mask"]
    td["prompts"] = torch.nested.nested_tensor_from_jagged(
        torch.ones(PROMPT * size, dtype=torch.long), offsets=torch.arange(size + 1) * PROMPT)
    td["responses"] = torch.nested.nested_tensor_from_jagged(torch.ones(int(lengths.sum()), dtype=torch.long),
                                                             offsets=offsets)
    tu.assign_non_tensor(td, max_response_len=-1, temperature=1.0, global_batch_size=global_rows, dp_size=dp,
                         batch_num_tokens=tokens, micro_batch_size_per_gpu=split.settings["mbs"],
                         use_dynamic_bsz=split.settings["dynamic"],
                         max_token_len_per_gpu=split.settings["cap"] or 2 * (PROMPT + max(batch.lengths)),
                         use_remove_padding=True, use_fused_kernels=False, calculate_entropy=False)
    return td


def _micro_losses(loss_fn, td, rows: list, leaves: list):
    """verl's ``prepare_micro_batches`` of ``td`` and ``loss_fn`` on each, summed (the engine's x M and
    megatron-core's / M cancel)."""
    from verl.workers.engine.utils import prepare_micro_batches  # noqa: PLC0415

    micro, indices = prepare_micro_batches(td)
    if indices is None:
        sizes = [len(mb) for mb in micro]
        indices = [list(range(sum(sizes[:k]), sum(sizes[:k + 1]))) for k in range(len(sizes))]
    total = 0
    for mb, idx in zip(micro, indices):
        # whole sequences, the response log-probs left-shifted by one (verl's THD output)
        log_probs = torch.cat([torch.cat([torch.zeros(PROMPT - 1), leaves[rows[j]], torch.zeros(1)]) for j in idx])
        loss, _ = loss_fn(model_output={"log_probs": log_probs}, data=mb, dp_group=None)
        total = total + loss
    return total


def stock(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from functools import partial  # noqa: PLC0415

    from verl.workers.utils.losses import ppo_loss  # noqa: PLC0415

    dp = split.settings["dp"]
    loss_fn = partial(ppo_loss, config=config.host.actor)
    global_rows = config.host.actor.ppo_mini_batch_size * config.host.n
    objectives, steps = [], []
    for step in _steps(config, batch, dp):
        tokens = sum(int(batch.masks[i].sum()) for rank in step for i in rank)
        total = 0
        for rows in step:
            td = _mini_batch(batch, rows, split, dp=dp, tokens=tokens, global_rows=global_rows)
            total = total + _micro_losses(loss_fn, td, rows, leaves)
        objectives.append(total / dp)
        steps.append([i for rank in step for i in rank])
    return objectives, steps


def plugin(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from omegaconf import OmegaConf  # noqa: PLC0415

    from megatron_pg_agg.integrations.verl.config import loss_config_from_verl  # noqa: PLC0415
    from megatron_pg_agg.integrations.verl.loss import VerlPGLoss  # noqa: PLC0415

    actor = OmegaConf.to_container(config.host.cfg.actor_rollout_ref.actor, resolve=True)
    actor["policy_loss"]["loss_mode"], actor["loss_agg_mode"] = "pg_agg", "token-mean"  # the fix line
    loss_cfg = loss_config_from_verl(actor, None)
    objectives, steps = [], []
    global_rows = config.host.actor.ppo_mini_batch_size * config.host.n
    for step in _steps(config, batch, split.settings["dp"]):
        rows = [i for rank in step for i in rank]
        tokens = sum(int(batch.masks[i].sum()) for i in rows)
        loss_fn = VerlPGLoss(loss_cfg)
        td = _mini_batch(batch, rows, split, dp=1, tokens=tokens, global_rows=global_rows)
        loss_fn.prepare_step(td)
        objectives.append(_micro_losses(loss_fn, td, rows, leaves))
        steps.append(rows)
    return objectives, steps
