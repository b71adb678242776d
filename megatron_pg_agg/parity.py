"""Layout parity: one optimizer step under several parallel layouts against a single-device reference.

    python -m megatron_pg_agg.parity                      # default layouts, every mode
    python -m megatron_pg_agg.parity --modes seq_mean --json out.json --plot errors.png

The launcher groups the layouts by world size and starts one ``torchrun`` per group (many layouts
per launch: start-up dominates). Each worker computes the reference on its own (TP = PP = 1,
per-sequence forward passes, the objective in float64 Python sums written from the README's
formulas, sharing no code with the package's loss or aggregation, autograd), then for every
layout: builds the model with the reference weights (TP shards sliced by ``partition_dim``,
pipeline layers mapped by ``layer_number``), plans the step, runs megatron-core's real
forward-backward schedule with DDP and ``finalize_model_grads``, gathers the gradient shards and
compares: the logged objective within 1e-6 relative, every parameter's gradient within 1e-5
(max abs error / max abs reference value). Layouts marked ``expect_fail`` are negative controls:
they pass the check only if parity FAILS. Exit status 0 iff every row passes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional

OBJECTIVE_RTOL = 1e-6
GRAD_RTOL = 1e-5
VOCAB = 64
MAX_SEQ_LEN = 64
NUM_LAYERS = 4
MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")
CONSTANT_DIVISOR = 16.0
MOE_EXPERTS, MOE_TOPK, MOE_AUX_COEFF, MOE_Z_COEFF = 4, 2, 0.01, 1e-3


@dataclass(frozen=True)
class ParityLayout:
    """One parallel layout of the step."""

    name: str
    """Label in the table."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None = not interleaved."""
    cp: int = 1
    """Context-parallel size (with the per-token model: CP attention needs TE)."""
    dp: int = 1
    """Data-parallel size; the world size is tp * pp * cp * dp."""
    num_microbatches: int = 1
    """Microbatches per DP rank."""
    per_token_model: bool = False
    """Use PerTokenLM instead of GPTModel (required for cp > 1 on CPU)."""
    experts: int = 0
    """MoE: experts per layer (top-2, router aux 0.01 and z 1e-3 losses on, ``moe_aux_loss``
    patch applied); 0 = dense. The reference has the same experts and no router losses; the
    layout's PG gradient is its total gradient minus the router losses' own gradient (an aux-only
    run of the same plan: advantages 0, KL and entropy off), whose strength tests/test_moe.py
    checks against Megatron's default averaging."""
    ep: int = 1
    """Expert-parallel size (carved out of the DP ranks)."""
    dispatcher: str = "alltoall"
    """MoE token dispatcher: 'alltoall' or 'allgather'."""
    control: Optional[str] = None
    """Negative control: 'megatron_default_averaging' (calculate_per_token_loss=False) or
    'per_microbatch_weights' (weights computed inside each rank's microbatch, not per step)."""
    control_modes: Optional[tuple] = None
    """Modes a control runs in (a control is only meaningful where it must change the result)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expect_fail(self) -> bool:
        return self.control is not None


DEFAULT_LAYOUTS = (
    ParityLayout("DP=2, 3 mb", dp=2, num_microbatches=3),
    ParityLayout("TP=2, 3 mb", tp=2, num_microbatches=3),
    ParityLayout("PP=2 (1F1B), 3 mb", pp=2, num_microbatches=3),
    ParityLayout("PP=2 interleaved (2 virtual), 4 mb", pp=2, vpp=2, num_microbatches=4),
    ParityLayout("1 mb (TP=2)", tp=2, num_microbatches=1),
    ParityLayout("8 mb (PP=2)", pp=2, num_microbatches=8),
    ParityLayout("DP=2 x PP=2, 3 mb", dp=2, pp=2, num_microbatches=3),
    ParityLayout("TP=2 x PP=2, 3 mb", tp=2, pp=2, num_microbatches=3),
    ParityLayout("TP=2 x DP=2, 2 mb", tp=2, dp=2, num_microbatches=2),
    ParityLayout("CP=2 x DP=2 (per-token model), 2 mb", cp=2, dp=2, num_microbatches=2, per_token_model=True),
    ParityLayout("MoE DP=2 x EP=2 (alltoall), 3 mb", dp=2, ep=2, experts=MOE_EXPERTS, num_microbatches=3),
    ParityLayout("MoE DP=2 (allgather), 3 mb", dp=2, experts=MOE_EXPERTS, dispatcher="allgather",
                 num_microbatches=3),
    ParityLayout("MoE PP=2 (1F1B), 3 mb", pp=2, experts=MOE_EXPERTS, num_microbatches=3),
    ParityLayout("control: Megatron default averaging, DP=2, 3 mb", dp=2, num_microbatches=3,
                 control="megatron_default_averaging", control_modes=("token_mean",)),
    ParityLayout("control: per-microbatch weights, DP=2, 3 mb", dp=2, num_microbatches=3,
                 control="per_microbatch_weights", control_modes=("prompt_mean",)),
    ParityLayout("control: per-microbatch weights, CP=2 x DP=2", cp=2, dp=2, num_microbatches=2,
                 per_token_model=True, control="per_microbatch_weights", control_modes=("seq_mean",)),
)


def loss_config(mode: str):
    from .losses import PGLossConfig

    return PGLossConfig(
        mode=mode, divisor=CONSTANT_DIVISOR if mode == "constant" else None,
        clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0,
        kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01,
    )


def parity_rollouts(seed: int = 7, with_ref: bool = True):
    """The built-in step: ragged prompt groups (3, 1, 2, 4, 2), one response with no valid
    token, filtered numerator tokens, 3..21 tokens per sequence, groups interleaved in input order
    (so microbatches and ranks get different token counts and the planner must regroup)."""
    import random

    

    from .rollouts import Rollout

    rng = random.Random(seed)
    rollouts, seq = [], 0
    for g, size in enumerate((3, 1, 2, 4, 2)):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        for _ in range(size):
            n = rng.randint(1, 15)
            mask = [0] * n if seq == 4 else [1 if rng.random() > 0.15 else 0 for _ in range(n)]
            adv = rng.uniform(-1.5, 1.5)
            rollouts.append(Rollout(
                prompt_ids=prompt,
                response_ids=[rng.randrange(VOCAB) for _ in range(n)],
                loss_mask=mask,
                advantages=[adv + rng.uniform(-0.1, 0.1) for _ in range(n)],
                old_logprobs=[-rng.uniform(3.0, 5.5) for _ in range(n)],
                ref_logprobs=[-rng.uniform(3.0, 5.5) for _ in range(n)] if with_ref else None,
                group_id=f"prompt-{g}",
                numerator_mask=[m if rng.random() > 0.2 else 0 for m in mask],
            ))
            seq += 1
    rng.shuffle(rollouts)
    return rollouts


# ----------------------------------------------------------------------------- worker side


def _kind(layout: ParityLayout) -> str:
    """Which reference a layout compares with: 'per_token', 'moe' or 'gpt'."""
    return "per_token" if layout.per_token_model else "moe" if layout.experts else "gpt"


def _uniform_tokens(layout: ParityLayout) -> bool:
    """Microbatches padded to one length: the interleaved schedule, and the allgather dispatcher
    under PP (it refuses variable_seq_lengths) or EP (gloo all-gathers need equal sizes)."""
    allgather = layout.experts and layout.dispatcher == "allgather"
    return layout.vpp is not None or bool(allgather and (layout.pp > 1 or layout.ep > 1))


def _moe_kwargs(layout: ParityLayout, router_losses: bool) -> dict:
    if not layout.experts:
        return {}
    return dict(num_moe_experts=layout.experts, moe_router_topk=MOE_TOPK,
                moe_aux_loss_coeff=MOE_AUX_COEFF if router_losses else 0.0,
                moe_z_loss_coeff=MOE_Z_COEFF if router_losses else None,
                expert_model_parallel_size=layout.ep, moe_token_dispatcher_type=layout.dispatcher,
                add_bias_linear=False)  # megatron-core 0.16 experts cannot add a bias (see check_megatron_config)


def _build(layout: ParityLayout, per_token: bool, *, per_token_loss: bool = True, router_losses: bool = True):
    import torch

    from .model import PerTokenLM, build_model_chunks, tiny_transformer_config

    config = tiny_transformer_config(
        **_moe_kwargs(layout, router_losses),
        num_layers=NUM_LAYERS,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        # 1F1B exchanges shapes per microbatch; the interleaved schedule gets uniform packs
        variable_seq_lengths=layout.pp > 1 and not _uniform_tokens(layout),
        calculate_per_token_loss=per_token_loss,
    )
    torch.manual_seed(1234)
    if per_token:
        chunks = [PerTokenLM(config, VOCAB)]
    else:
        chunks = build_model_chunks(config, VOCAB, MAX_SEQ_LEN, share_embeddings_and_output_weights=False)
    if torch.cuda.is_available():  # NCCL run on a GPU node: weights built on the CPU, then moved
        chunks = [c.cuda() for c in chunks]
    return config, chunks


def _full_name(module, name: str) -> str:
    """Local parameter name -> the single-device model's name (pipeline layers renumbered)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = module.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
    if "local_experts" in parts:  # expert parallelism: local expert k of EP rank r is r * local + k
        from megatron.core import parallel_state

        k = parts.index("local_experts") + 1
        local = len(module.decoder.layers[0].mlp.experts.local_experts)
        parts[k] = str(parallel_state.get_expert_model_parallel_rank() * local + int(parts[k]))
    return ".".join(parts)


def _tp_info():
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def load_full_state(chunks, full_state: dict) -> None:
    """Copy single-device weights into this rank's (TP-sharded, PP-split) chunks."""
    import torch

    tp_rank, tp_size, _ = _tp_info()
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                full = full_state[_full_name(chunk, name)]
                if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                    full = full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
                if full.shape != param.shape:
                    raise RuntimeError(f"{name}: shard {tuple(full.shape)} != parameter {tuple(param.shape)}")
                param.copy_(full.to(param.device))


def gather_full_grads(ddp_chunks) -> dict:
    """This rank's ``main_grad``s, TP shards concatenated, under single-device names."""
    import torch

    tp_rank, tp_size, tp_group = _tp_info()
    out = {}
    for chunk in ddp_chunks:
        module = chunk.module
        for name, param in module.named_parameters():
            grad = param.main_grad.detach().clone()
            if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                parts = [torch.empty_like(grad) for _ in range(tp_size)]
                torch.distributed.all_gather(parts, grad, group=tp_group)
                grad = torch.cat(parts, dim=param.partition_dim)
            out[_full_name(module, name)] = grad.cpu()
    return out


def step_objective(forward_logits, rollouts, cfg) -> tuple:
    """The step objective J from the README's formulas, written independently of the package's
    loss and aggregation code: float64, one response at a time, plain per-token Python sums.

    ``forward_logits(ids)`` returns the logits ``[len(ids), V]`` of one whole sequence (the model
    is the only thing shared with what is checked); ``cfg`` is read for its numbers only (mode,
    divisor, clips, coefficients). Per response token ``j`` (scored at position ``P + j - 1``):
    ``d`` = loss_mask, ``n`` = d and numerator_mask, ``r = exp(log p - old)``,
    ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, capped at ``-A c`` for A < 0 with
    dual clip c. ``N_u``/``D_u`` sum ``n l``/``d`` over a unit; prompt groups are the responses
    sharing a group_id (pooled). token_mean: sum N / sum D; seq_mean: mean over active sequences of
    N_s / D_s; prompt_mean: mean over active groups of N_g / D_g; constant: sum N / (active
    sequences * L). Plus ``kl_coef`` x the mean KL (k1/k2/k3) and minus ``entropy_coef`` x the mean
    entropy over the ``d`` tokens of the step; J = 0 when no unit is active.
    Returns ``(J, W)``: a float64 0-d tensor (differentiable) and the integer weight."""
    import math

    import torch

    if getattr(cfg, "policy_loss", "ppo") != "ppo" or getattr(cfg, "rollout_correction", None) is not None:
        raise NotImplementedError("the independent reference covers the PPO surrogate without a rollout correction")
    mode = cfg.canonical_mode
    low, high, dual = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high, cfg.dual_clip
    zero = torch.zeros((), dtype=torch.float64)
    units = []  # per response: (group_id, N_s, D_s)
    kl_sum, ent_sum, tokens_d = zero, zero, 0
    for r in rollouts:
        ids = list(r.prompt_ids) + list(r.response_ids)
        logits = forward_logits(ids).double()
        p = len(r.prompt_ids)
        num, den = zero, 0
        for j, token in enumerate(r.response_ids):
            if not r.loss_mask[j]:
                continue
            row = torch.log_softmax(logits[p + j - 1], dim=-1)
            logp = row[token]
            den += 1
            filtered = r.numerator_mask is not None and not r.numerator_mask[j]
            if not filtered:
                adv = float(r.advantages[j])
                ratio = torch.exp(logp - float(r.old_logprobs[j]))
                surrogate = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, low, high))
                if dual is not None and adv < 0:
                    surrogate = torch.minimum(surrogate, torch.tensor(-adv * dual, dtype=torch.float64))
                num = num + surrogate
            if cfg.kl_coef > 0:
                x = logp - float(r.ref_logprobs[j])  # log(pi / ref)
                kl = {"k1": x, "k2": 0.5 * x * x, "k3": torch.exp(-x) + x - 1.0}[cfg.kl_estimator]
                kl_sum = kl_sum + kl
            if cfg.entropy_coef > 0:
                ent_sum = ent_sum - (row.exp() * row).sum()
        tokens_d += den
        units.append((r.group_id, num, den))
    active = [(n, d) for _, n, d in units if d > 0]
    if mode == "token_mean":
        weight = tokens_d
        pg = sum((n for _, n, _ in units), zero) / max(tokens_d, 1)
    elif mode == "seq_mean":
        weight = len(active)
        pg = sum((n / d for n, d in active), zero) / max(weight, 1)
    elif mode == "constant":
        weight = len(active)
        pg = sum((n for n, _ in active), zero) / (max(weight, 1) * float(cfg.divisor))
    elif mode == "prompt_mean":
        groups = {}
        for g, n, d in units:
            acc = groups.setdefault(g, [zero, 0])
            acc[0], acc[1] = acc[0] + n, acc[1] + d
        pooled = [(n, d) for n, d in groups.values() if d > 0]
        weight = len(pooled)
        pg = sum((n / d for n, d in pooled), zero) / max(weight, 1)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    if weight == 0:
        return zero, 0
    objective = pg + (cfg.kl_coef * kl_sum - cfg.entropy_coef * ent_sum) / tokens_d
    assert math.isfinite(float(objective))
    return objective, weight


def reference(rollouts, mode: str, kind: str, full_state: Optional[dict] = None):
    """Single-device objective and gradients, independent of the package's loss, aggregation and
    planning code: every sequence forwarded on its own, :func:`step_objective` (float64 Python
    sums from the README's formulas) differentiated by autograd. No planner, no token weights, no
    split; only the model (and its weights) is shared with the layouts it checks."""
    import torch

    cfg = loss_config(mode)
    layout = ParityLayout("reference", experts=MOE_EXPERTS if kind == "moe" else 0)
    _, chunks = _build(layout, kind == "per_token", router_losses=False)
    model = chunks[0]
    if full_state is not None:
        load_full_state([model], full_state)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    device = next(model.parameters()).device

    def forward_logits(ids):
        tokens = torch.tensor([ids], device=device)
        return model(tokens, torch.arange(len(ids), device=device)[None], None)[0].cpu()

    objective, _ = step_objective(forward_logits, rollouts, cfg)
    if objective.requires_grad:
        objective.backward()
    grads = {name: (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).cpu().clone()
             for name, p in model.named_parameters()}
    return float(objective), grads, state


def _per_microbatch_weights(mb, rollouts, cfg, cp):
    """The control's bug: weights computed from the tokens one rank sees in one microbatch."""
    from .aggregation import token_weights

    pads = [b - a for a, b in zip(mb.cu_seqlens_padded.tolist()[:-1], mb.cu_seqlens_padded.tolist()[1:])]
    local = [n // cp for n in pads]
    cu = [0]
    for n in local:
        cu.append(cu[-1] + n)
    groups = []
    for k, s in enumerate(mb.sequence_ids):
        if k and rollouts[s].group_id == rollouts[mb.sequence_ids[k - 1]].group_id:
            groups[-1] += 1
        else:
            groups.append(1)
    import torch

    return token_weights(mb.numerator_mask, mode=cfg.canonical_mode, divisor=cfg.divisor,
                         cu_seqlens=torch.tensor(cu), group_sizes=groups,
                         denominator_mask=mb.denominator_mask)


def _subtract_router_loss_gradient(model, rollouts, cfg, layout, cp_rank, dp_rank, device) -> None:
    """``main_grad -= `` the gradient of an aux-only run of the same step (advantages 0, KL and
    entropy off: the PG loss and its gradient are exactly 0), leaving the PG objective's gradient
    (the router losses add linearly; tests/test_moe.py checks that and their strength)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .megatron_loss import make_forward_step
    from .moe import begin_moe_step
    from .planner import PlanConfig, plan_step

    total = {id(p): p.main_grad.detach().clone() for chunk in model for p in chunk.module.parameters()}
    aux_rollouts = [replace(r, advantages=[0.0] * len(r.advantages)) for r in rollouts]
    aux_cfg = replace(cfg, kl_coef=0.0, entropy_coef=0.0)
    plan = plan_step(aux_rollouts, aux_cfg, PlanConfig(
        dp_size=layout.dp, num_microbatches=layout.num_microbatches, tp_size=layout.tp, cp_size=layout.cp,
        vocab_size=VOCAB, uniform_microbatch_tokens=_uniform_tokens(layout)), cp_rank=cp_rank)
    mbs = plan.for_rank(dp_rank)
    for chunk in model:
        chunk.zero_grad_buffer()
    begin_moe_step(plan.totals.pg_weight, len(mbs), layout.dp)
    iterators = [iter(mbs) for _ in model]
    get_forward_backward_func()(
        forward_step_func=make_forward_step(aux_cfg, plan.totals, device=device,
                                            tp_group=parallel_state.get_tensor_model_parallel_group()),
        data_iterator=iterators if len(iterators) > 1 else iterators[0], model=model,
        num_microbatches=len(mbs), seq_length=max(mb.num_tokens for mb in mbs), micro_batch_size=1,
        forward_only=False)
    with torch.no_grad():
        for chunk in model:
            for p in chunk.module.parameters():
                p.main_grad.copy_(total[id(p)] - p.main_grad)


def run_layout(layout: ParityLayout, rollouts, modes, full_states, references):
    """Run one layout for each mode; returns rows on global rank 0 (None elsewhere)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .megatron_loss import check_megatron_config, make_forward_step
    from .model import default_ddp_config, wrap_in_ddp
    from .moe import begin_moe_step
    from .parallel import init_parallel, teardown_parallel
    from .planner import PlanConfig, plan_step

    init_parallel(layout.tp, layout.pp, layout.vpp, layout.cp, ep=layout.ep)
    per_token_loss = layout.control != "megatron_default_averaging"
    config, chunks = _build(layout, layout.per_token_model, per_token_loss=per_token_loss)
    load_full_state(chunks, full_states[_kind(layout)])
    ddp_config = default_ddp_config()
    model = wrap_in_ddp(chunks, config, ddp_config)
    config.finalize_model_grads_func = finalize_model_grads
    if layout.control is None:
        check_megatron_config(config, ddp_config)
    dp_rank = parallel_state.get_data_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    # MoE: expert gradients live on their EP rank (any DP rank): every rank sends its gradients
    keep = (dp_rank == 0 and cp_rank == 0) or bool(layout.experts)
    rows = []
    for mode in modes:
        cfg = loss_config(mode)
        plan = plan_step(rollouts, cfg, PlanConfig(
            dp_size=layout.dp, num_microbatches=layout.num_microbatches, tp_size=layout.tp,
            cp_size=layout.cp, vocab_size=VOCAB, uniform_microbatch_tokens=_uniform_tokens(layout),
        ), cp_rank=cp_rank)
        mbs = plan.for_rank(dp_rank)
        if layout.control == "per_microbatch_weights":
            mbs = [replace(mb, weights=_per_microbatch_weights(mb, rollouts, cfg, layout.cp)) for mb in mbs]
        for chunk in model:
            chunk.zero_grad_buffer()
        device = torch.device("cuda") if torch.cuda.is_available() else None
        forward_step = make_forward_step(cfg, plan.totals, device=device,
                                         tp_group=parallel_state.get_tensor_model_parallel_group())
        iterators = [iter(mbs) for _ in model]
        t0 = time.perf_counter()
        if layout.experts:  # the router losses' per-step factor W / M_total
            begin_moe_step(plan.totals.pg_weight, len(mbs), layout.dp)
        store = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=model,
            num_microbatches=len(mbs),
            seq_length=max(mb.num_tokens for mb in mbs),
            micro_batch_size=1,
            forward_only=False,
        )
        step_s = time.perf_counter() - t0
        if layout.experts:
            _subtract_router_loss_gradient(model, rollouts, cfg, layout, cp_rank, dp_rank, device)
        pair = torch.zeros(2, dtype=torch.float64, device=device)
        if last_stage:
            for report in store:
                pair += report["objective"].double()
        dist.all_reduce(pair, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        pair = pair.cpu()
        grads = gather_full_grads(model) if keep else {}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (last_stage and keep, pair.tolist(), grads))
        if dist.get_rank() != 0:
            continue
        objective = next(p[0] / p[1] if p[1] else 0.0 for is_src, p, _ in gathered if is_src)
        full = {}
        for _, _, g in gathered:
            full.update(g)
        ref_obj, ref_grads, _ = references[(_kind(layout), mode)]
        missing = sorted(set(ref_grads) - set(full))
        if missing:
            raise RuntimeError(f"{layout.name}: no gradient gathered for {missing}")
        errors = {
            k: float((full[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max().clamp_min(1e-30))
            for k in ref_grads
        }
        worst = max(errors, key=errors.get)
        grad_err = errors[worst]
        if os.environ.get("PG_AGG_PARITY_DEBUG"):
            for k in sorted(errors, key=errors.get)[-6:]:
                print(f"  {k}: rel {errors[k]:.2e} ref max {float(ref_grads[k].abs().max()):.3e} "
                      f"abs err {float((full[k] - ref_grads[k]).abs().max()):.3e}", flush=True)
        obj_err = abs(objective - ref_obj) / max(abs(ref_obj), 1e-30)
        within = obj_err <= OBJECTIVE_RTOL and grad_err <= GRAD_RTOL
        rows.append({
            "layout": layout.name, "mode": mode, "objective": objective, "reference": ref_obj,
            "objective_rel_err": obj_err, "grad_max_rel_err": grad_err, "worst_parameter": worst,
            "expect_fail": layout.expect_fail, "passed": within != layout.expect_fail,
            "microbatch_balance": plan.stats["microbatch_balance"], "step_s": step_s,
        })
    teardown_parallel()
    return rows if dist.get_rank() == 0 else None


def worker_main(argv=None) -> int:
    import faulthandler

    import torch
    import torch.distributed as dist

    from .patches import apply_megatron_patches

    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts-json", required=True)
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(float(os.environ.get("PG_AGG_HANG_DUMP_S", "540")), exit=True)
    layouts = [ParityLayout(**d) for d in json.loads(args.layouts_json)]
    # moe_aux_loss whenever a model has experts (router losses at Megatron's default strength)
    apply_megatron_patches(cpu_gloo=not torch.cuda.is_available(),
                           moe_aux_loss=any(lay.experts for lay in layouts))
    from .parallel import init_distributed, init_parallel, teardown_parallel

    init_distributed()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rollouts = parity_rollouts()
    # The reference: the same on every rank (deterministic CPU init), then shared weights.
    init_parallel(1, 1)
    references, full_states = {}, {}
    for kind in sorted({_kind(lay) for lay in layouts}):
        for mode in args.modes:
            obj, grads, state = reference(rollouts, mode, kind, full_states.get(kind))
            full_states.setdefault(kind, state)
            references[(kind, mode)] = (obj, grads, state)
    teardown_parallel()
    rows = []
    for layout in layouts:
        modes = [m for m in args.modes if layout.control_modes is None or m in layout.control_modes]
        if not modes:
            continue
        got = run_layout(layout, rollouts, modes, full_states, references)
        dist.barrier()
        if dist.get_rank() == 0:
            rows.extend(got)
            for row in got:
                print(_format_row(row), flush=True)
    if dist.get_rank() == 0:
        label = {"gpt": "", "per_token": " (per-token model)", "moe": " (MoE model)"}
        ref_rows = [{"layout": "single-process reference" + label[k],
                     "mode": m, "objective": references[(k, m)][0], "reference": references[(k, m)][0],
                     "objective_rel_err": 0.0, "grad_max_rel_err": 0.0, "expect_fail": False, "passed": True}
                    for k in sorted(full_states) for m in args.modes]
        with open(args.out, "w") as f:
            json.dump(ref_rows + rows, f, indent=1)
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------- launcher side


def _format_row(row) -> str:
    verdict = "pass" if row["passed"] else "FAIL"
    if row["expect_fail"]:
        verdict += " (control: must differ)"
    return (f"{row['layout']:<50} {row['mode']:<12} {row['objective']:>+12.7f} "
            f"{row['objective_rel_err']:>10.2e} {row['grad_max_rel_err']:>10.2e}  {verdict}")


def print_table(rows) -> None:
    print(f"{'layout':<50} {'mode':<12} {'objective':>12} {'obj relerr':>10} {'grad relerr':>10}  result")
    for row in rows:
        print(_format_row(row))


TABLE_HEADER = "| layout | " + " | ".join(MODES) + " |"
_REFERENCE_LABELS = {"gpt": "", "per_token": " (per-token model)", "moe": " (MoE model)"}


def _table_cell(row) -> str:
    if row["layout"].startswith("single-process reference"):
        return f"J = {row['objective']:.7f}"
    cell = f"{row['objective_rel_err']:.1e} / {row['grad_max_rel_err']:.1e}"
    if row["expect_fail"]:
        cell += " **fails, as it must**" if row["passed"] else " **did not fail: control broken**"
    elif not row["passed"]:
        cell += " **FAIL**"
    return cell


def markdown_table(rows) -> str:
    """The README's parity table from the rows ``--json`` writes: one line per layout, cells
    ``J = ...`` (references) or ``objective rel err / max grad rel err`` per mode, ``-`` where a
    mode did not run. Grouped by model (GPT, per-token, MoE): the reference first, then the
    layouts in ``DEFAULT_LAYOUTS`` order (controls last); unknown layouts at the end."""
    by_layout = {}
    for row in rows:
        by_layout.setdefault(row["layout"], {})[row["mode"]] = row
    order = []
    for kind, label in _REFERENCE_LABELS.items():
        order.append("single-process reference" + label)
        members = [lay for lay in DEFAULT_LAYOUTS if _kind(lay) == kind]
        order += [lay.name for lay in members if not lay.expect_fail] + [lay.name for lay in members if lay.expect_fail]
    order += [name for name in by_layout if name not in order]
    lines = [TABLE_HEADER, "|---" * (len(MODES) + 1) + "|"]
    for name in order:
        if name not in by_layout:
            continue
        cells = [_table_cell(by_layout[name][m]) if m in by_layout[name] else "-" for m in MODES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def find_markdown_table(text: str) -> tuple:
    """``(start, end)`` character offsets of the parity table in ``text`` (README.md): from its
    header line to the end of its last row."""
    start = text.index(TABLE_HEADER + "\n")
    end = start
    for line in text[start:].splitlines(keepends=True):
        if not line.startswith("|"):
            break
        end += len(line)
    return start, end


def plot_errors(rows, path: str) -> None:
    """PNG of the max relative gradient error per layout (one marker per mode) vs the tolerance."""
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit("--plot needs matplotlib: pip install 'megatron_pg_agg[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(r["layout"] for r in rows if not r["layout"].startswith("single")))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(layouts) + 1.5))
    for k, mode in enumerate(MODES):
        ys, xs = [], []
        for i, lay in enumerate(layouts):
            for r in rows:
                if r["layout"] == lay and r["mode"] == mode:
                    ys.append(i + (k - 1.5) * 0.12)
                    xs.append(max(r["grad_max_rel_err"], 1e-12))
        ax.scatter(xs, ys, label=mode, s=18)
    ax.axvline(GRAD_RTOL, color="red", linestyle="--", label=f"tolerance {GRAD_RTOL:g}")
    ax.set_xscale("log")
    ax.set_ylim(-0.5, len(layouts) - 0.5)
    ax.set_yticks(range(len(layouts)), layouts, fontsize=7)
    ax.set_xlabel("max relative gradient error vs single-process reference")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def launch(layouts, modes, *, timeout_s: float = 900.0, log=print, echo: bool = False) -> list:
    """Run ``layouts`` (grouped by world size, one torchrun each) and return every row."""
    rows = []
    by_world = {}
    for layout in layouts:
        by_world.setdefault(layout.world, []).append(layout)
    for world, group in sorted(by_world.items()):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(world), "-m", "megatron_pg_agg.parity", "--worker", "--out", out,
                   "--layouts-json", json.dumps([asdict(lay) for lay in group]), "--modes", *modes]
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
            log(f"[parity] launching {world} ranks for {len(group)} layouts x {len(modes)} modes", flush=True)
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            lines = []
            try:
                for line in proc.stdout:
                    lines.append(line)
                    if echo:
                        log("  " + line.rstrip(), flush=True)
                    if time.monotonic() - t0 > timeout_s:
                        raise subprocess.TimeoutExpired(cmd, timeout_s)
                proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"parity launch ({world} ranks) timed out after {timeout_s:.0f}s:\n" + "".join(lines[-200:]))
            if proc.returncode != 0 or not os.path.exists(out):
                raise RuntimeError(f"parity launch ({world} ranks) failed with rc={proc.returncode}:\n" + "".join(lines[-200:]))
            with open(out) as f:
                got = json.load(f)
            log(f"[parity] {world} ranks done in {time.monotonic() - t0:.1f}s", flush=True)
            seen = {(r["layout"], r["mode"]) for r in rows}
            rows.extend(r for r in got if (r["layout"], r["mode"]) not in seen)
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker_main([a for a in argv if a != "--worker"])
    parser = argparse.ArgumentParser(prog="megatron-pg-agg-parity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--layouts", nargs="+", help="substrings selecting layouts by name (default: all)")
    parser.add_argument("--no-controls", action="store_true", help="skip the negative controls")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--plot", help="write a PNG of the gradient errors per layout here")
    parser.add_argument("--verbose", action="store_true", help="echo the workers' output (rows as they finish)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun launch")
    args = parser.parse_args(argv)
    layouts = [lay for lay in DEFAULT_LAYOUTS
               if (args.layouts is None or any(s in lay.name for s in args.layouts))
               and not (args.no_controls and lay.expect_fail)]
    if not layouts:
        parser.error("no layout matches --layouts")
    rows = launch(layouts, args.modes, timeout_s=args.timeout, echo=args.verbose,
                  log=lambda *a, **k: print(*a, file=sys.stderr, **k))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot_errors(rows, args.plot)
    failed = [r for r in rows if not r["passed"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
