"""The single-device reference the layouts are checked against, independent of the package's loss,
aggregation and planning code: every sequence forwarded on its own, the objective in float64
Python sums written from the README's formulas, its gradient by autograd. Only the model (and its
weights) is shared with what is checked."""
from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

from megatron_pg_agg.megatron.mtp import mtp_kwargs
from megatron_pg_agg.patches.mtp_loss import set_mtp_loss_scale

from .fixture import MOE_EXPERTS, ParityCase, loss_config
from .models import build_case_model, load_full_state

__all__ = ["mtp_reference", "reference", "report_reference", "step_objective"]


def _sequence_token_losses(policy: str, logp: dict, r, cfg, numerator: list) -> dict:
    """``{j: loss_j}`` for the numerator tokens ``numerator`` of one response (README formulas;
    ``x_j = log p_j - old_j``, ``A_j`` the advantage, ``sg`` = detach):

    * ppo: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` with ``r = exp(x)``, capped at
      ``-A c`` for ``A < 0`` under the dual clip ``c``;
    * gspo: the same with ``r'_j = exp(log p_j - sg(log p_j)) * s``, ``s = exp(mean_n x)``;
    * gmpo: ``-A exp(m_j - sg(m_j) + sg(mean_n m))``, ``m = a min(a x, a clamp(x, -eps_low,
      eps_high))``, ``a = sign(A)``;
    * cispo: ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) A log p_j``.

    ``mean_n`` is over the response's numerator tokens (all of them: the reference never splits a
    response)."""
    low, high = cfg.clip_eps_low, cfg.clip_eps_high
    adv = {j: float(r.advantages[j]) for j in numerator}
    x = {j: logp[j] - float(r.old_logprobs[j]) for j in numerator}
    out = {}
    if policy == "ppo":
        for j in numerator:
            ratio = torch.exp(x[j])
            loss = torch.maximum(-adv[j] * ratio, -adv[j] * torch.clamp(ratio, 1.0 - low, 1.0 + high))
            if cfg.dual_clip is not None and adv[j] < 0:
                loss = torch.minimum(loss, torch.tensor(-adv[j] * cfg.dual_clip, dtype=torch.float64))
            out[j] = loss
    elif policy == "gspo":
        s = math.exp(sum(float(x[j].detach()) for j in numerator) / len(numerator))
        for j in numerator:
            ratio = torch.exp(logp[j] - logp[j].detach()) * s
            out[j] = torch.maximum(-adv[j] * ratio, -adv[j] * torch.clamp(ratio, 1.0 - low, 1.0 + high))
    elif policy == "gmpo":
        m = {}
        for j in numerator:
            a = 1.0 if adv[j] >= 0 else -1.0
            m[j] = a * torch.minimum(a * x[j], a * torch.clamp(x[j], -low, high))
        mean_m = sum(float(m[j].detach()) for j in numerator) / len(numerator)
        for j in numerator:
            out[j] = -adv[j] * torch.exp(m[j] - m[j].detach() + mean_m)
    elif policy == "cispo":
        for j in numerator:
            weight = min(max(math.exp(float(x[j].detach())), 1.0 - low), 1.0 + high)
            out[j] = -weight * adv[j] * logp[j]
    else:
        raise ValueError(f"unknown policy loss {policy!r}")
    return out


def step_objective(forward_logits, rollouts, cfg) -> tuple:
    """The step objective J from the README's formulas, written independently of the package's
    loss and aggregation code: float64, one response at a time, plain per-token Python sums.

    ``forward_logits(ids)`` returns the logits ``[len(ids), V]`` of one whole sequence (the model
    is the only thing shared with what is checked); ``cfg`` is read for its numbers only (mode,
    divisor, policy loss, clips, coefficients). Per response token ``j`` (scored at position
    ``P + j - 1``): ``d`` = loss_mask, ``n`` = d and numerator_mask, ``l_j`` the policy loss
    (:func:`_sequence_token_losses`). ``N_u``/``D_u`` sum ``n l``/``d`` over a unit; prompt
    groups are the responses sharing a group_id (pooled). token_mean: sum N / sum D; seq_mean:
    mean over active sequences of N_s / D_s; prompt_mean: mean over active groups of N_g / D_g;
    constant: sum N / (active sequences * L). Plus ``kl_coef`` x the mean KL (k1/k2/k3) and minus
    ``entropy_coef`` x the mean entropy over the ``d`` tokens of the step; J = 0 when no unit is
    active. A rollout's optional ``pg_weights`` (a rollout correction's per-token weights, computed
    by the caller) multiply its ``l_j``. Returns ``(J, W)``: a float64 0-d tensor (differentiable)
    and the integer weight."""
    if getattr(cfg, "rollout_correction", None) is not None:
        raise NotImplementedError("the independent reference covers the policy losses without a rollout correction")
    mode = cfg.mode
    zero = torch.zeros((), dtype=torch.float64)
    units = []  # per response: (group_id, N_s, D_s)
    kl_sum, ent_sum, tokens_d = zero, zero, 0
    for r in rollouts:
        ids = list(r.prompt_ids) + list(r.response_ids)
        logits = forward_logits(ids).double()
        p = len(r.prompt_ids)
        logp, valid = {}, []
        for j, token in enumerate(r.response_ids):
            if not r.loss_mask[j]:
                continue
            row = torch.log_softmax(logits[p + j - 1], dim=-1)
            logp[j] = row[token]
            valid.append(j)
            if cfg.kl_coef > 0:
                x = logp[j] - float(r.ref_logprobs[j])  # log(pi / ref)
                kl = {"k1": x, "k2": 0.5 * x * x, "k3": torch.exp(-x) + x - 1.0}[cfg.kl_estimator]
                kl_sum = kl_sum + kl
            if cfg.entropy_coef > 0:
                ent_sum = ent_sum - (row.exp() * row).sum()
        numerator = [j for j in valid if r.numerator_mask is None or r.numerator_mask[j]]
        losses = _sequence_token_losses(cfg.policy_loss, logp, r, cfg, numerator) if numerator else {}
        pg_weights = getattr(r, "pg_weights", None)
        if pg_weights is not None:
            losses = {j: loss * float(pg_weights[j]) for j, loss in losses.items()}
        tokens_d += len(valid)
        units.append((r.group_id, sum(losses.values(), zero), len(valid)))
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
    assert math.isfinite(float(objective.detach()))
    return objective, weight


def reference(rollouts, mode: str, policy_loss: str, kind: str, full_state: Optional[dict] = None, cfg=None,
              with_report: bool = False):
    """``(J, grads, state)`` of the single-device model of ``kind`` ('gpt', 'per_token', 'moe'):
    :func:`step_objective` differentiated by autograd. No planner, no token weights, no split.
    ``full_state``: the weights to use (the first call's model initialisation otherwise);
    ``state`` returns them, for the layouts to load. ``cfg``: the loss settings (the parity
    table's :func:`loss_config` of ``mode`` and ``policy_loss`` when None). ``with_report``: a
    fourth item, :func:`report_reference`'s fields."""
    cfg = loss_config(mode, policy_loss) if cfg is None else cfg
    model, state = _reference_model(kind, full_state)
    device = next(model.parameters()).device
    if kind == "mtp":  # the PG objective only: the MTP block's loss gets a backward scale of 0
        set_mtp_loss_scale(0, 0)  # (the patch refuses an MTP loss without a step factor)
        MTPLossAutoScaler.main_loss_backward_scale = torch.zeros((), device=device)

    def forward_logits(ids):
        tokens = torch.tensor([ids], device=device)
        extra = _mtp_inputs(model, ids, [0] * len(ids), device) if kind == "mtp" else {}
        return model(tokens, torch.arange(len(ids), device=device)[None], None, **extra)[0].cpu()

    objective, _ = step_objective(forward_logits, rollouts, cfg)
    if objective.requires_grad:
        objective.backward()
    grads = {name: (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).cpu().clone()
             for name, p in model.named_parameters()}
    if not with_report:
        return float(objective.detach()), grads, state
    with torch.no_grad():
        return float(objective.detach()), grads, state, report_reference(forward_logits, rollouts, cfg)


def report_reference(forward_logits, rollouts, cfg) -> dict:
    """The reported fields of a step from their definitions (float64, one response at a time):
    ``objective`` J; ``pg_loss`` J without the KL and entropy terms; over the numerator tokens,
    ``ratio`` (the importance ratio each policy loss uses: ``exp(x)`` for ppo and cispo, the
    sequence's ``exp(mean_n x)`` for gspo, ``exp(mean_n m)`` for gmpo) and ``clip_fraction`` (the
    clip changed the token's loss: ppo's clipped or dual-clipped term chosen, gspo's clipped term,
    cispo's weight clamped, gmpo's ``m != x``); over the denominator tokens, the mean ``kl`` (the
    configured estimator, where reference log-probs exist) and ``entropy``. None where a field
    has no token (J and J_pg are 0 when W = 0)."""
    from dataclasses import replace  # noqa: PLC0415

    objective, weight = step_objective(forward_logits, rollouts, cfg)
    pg, _ = step_objective(forward_logits, rollouts, replace(cfg, kl_coef=0.0, entropy_coef=0.0))
    low, high = cfg.clip_eps_low, cfg.clip_eps_high
    sums = {"ratio": 0.0, "clip_fraction": 0.0, "kl": 0.0, "entropy": 0.0}
    numerator_tokens, valid_tokens, has_ref = 0, 0, True
    for r in rollouts:
        ids = list(r.prompt_ids) + list(r.response_ids)
        logits = forward_logits(ids).double()
        p = len(r.prompt_ids)
        valid = [j for j, m in enumerate(r.loss_mask) if m]
        numerator = [j for j in valid if r.numerator_mask is None or r.numerator_mask[j]]
        rows = {j: torch.log_softmax(logits[p + j - 1], dim=-1) for j in valid}
        logp = {j: float(rows[j][r.response_ids[j]]) for j in valid}
        for j in valid:
            sums["entropy"] -= float((rows[j].exp() * rows[j]).sum())
            if r.ref_logprobs is None:
                has_ref = False
            else:
                x = logp[j] - float(r.ref_logprobs[j])
                sums["kl"] += {"k1": x, "k2": 0.5 * x * x, "k3": math.exp(-x) + x - 1.0}[cfg.kl_estimator]
        valid_tokens += len(valid)
        numerator_tokens += len(numerator)
        x = {j: logp[j] - float(r.old_logprobs[j]) for j in numerator}
        m = {}
        for j in numerator:
            a = 1.0 if float(r.advantages[j]) >= 0 else -1.0
            m[j] = a * min(a * x[j], a * min(max(x[j], -low), high))
        mean_x = sum(x.values()) / len(x) if x else 0.0
        mean_m = sum(m.values()) / len(m) if m else 0.0
        for j in numerator:
            adv = float(r.advantages[j])
            if cfg.policy_loss in ("ppo", "cispo"):
                ratio = math.exp(x[j])
            elif cfg.policy_loss == "gspo":
                ratio = math.exp(mean_x)
            else:
                ratio = math.exp(mean_m)
            clipped_ratio = min(max(ratio, 1.0 - low), 1.0 + high)
            if cfg.policy_loss == "cispo":
                clipped = clipped_ratio != ratio
            elif cfg.policy_loss == "gmpo":
                clipped = m[j] != x[j]
            else:
                clipped = -adv * clipped_ratio > -adv * ratio
                if cfg.policy_loss == "ppo" and cfg.dual_clip is not None and adv < 0:
                    clipped = clipped or max(-adv * ratio, -adv * clipped_ratio) > -adv * cfg.dual_clip
            sums["ratio"] += ratio
            sums["clip_fraction"] += float(clipped)
    out = {"objective": float(objective) if weight else 0.0, "pg_loss": float(pg) if weight else None}
    for name in ("ratio", "clip_fraction"):
        out[name] = sums[name] / numerator_tokens if numerator_tokens else None
    out["kl"] = sums["kl"] / valid_tokens if valid_tokens and has_ref else None
    out["entropy"] = sums["entropy"] / valid_tokens if valid_tokens else None
    return out


def _reference_model(kind: str, full_state: Optional[dict]):
    """The single-device model of ``kind`` with ``full_state``'s weights (the first build's own
    initialisation when None), and those weights."""
    case = ParityCase("reference", experts=MOE_EXPERTS if kind == "moe" else 0, per_token_model=kind == "per_token",
                      mtp=kind == "mtp")
    _, chunks = build_case_model(case, router_losses=False)
    model = chunks[0]
    if full_state is not None:
        load_full_state([model], full_state)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    return model, state


def _mtp_inputs(model, ids: list, mask: list, device) -> dict:
    """The MTP keywords of one unpacked sequence: its next tokens as labels (0 at the end) and
    ``mask`` (label-aligned) as the loss mask."""
    labels = torch.tensor([list(ids[1:]) + [0]], device=device)
    return mtp_kwargs(model, labels, torch.tensor([mask], dtype=torch.float32, device=device))


def mtp_reference(rollouts, full_state: dict) -> dict:
    """The MTP term's gradient ``(f / K) sum_k sum_t d_k grad CE_k / D`` of the step, per
    parameter, on the single-device MTP model: every response forwarded ALONE (one unpacked
    row: no packing, planner, microbatches or padded roll) through megatron-core's MTP block with
    its label-aligned mask (response token ``j`` scored at ``P + j - 1``), the attached loss's
    backward scale set to ``1 / D`` by hand (``D``: the step's valid tokens), no policy-gradient
    loss. Independent of the step factor, the report and the planner."""
    model, _ = _reference_model("mtp", full_state)
    device = next(model.parameters()).device
    valid = sum(int(bool(d)) for r in rollouts for d in r.loss_mask)
    set_mtp_loss_scale(valid, valid)  # the patch refuses an MTP loss without a step factor
    # the backward scale set by hand on upstream's class attribute, not through the patch's
    # set_loss_scale, so a wrong step factor there cannot reach this reference
    MTPLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0 / valid, device=device)
    for r in rollouts:
        ids = list(r.prompt_ids) + list(r.response_ids)
        mask = [0] * (len(r.prompt_ids) - 1) + [int(bool(d)) for d in r.loss_mask] + [0]
        tokens = torch.tensor([ids], device=device)
        logits = model(tokens, torch.arange(len(ids), device=device)[None], None,
                       **_mtp_inputs(model, ids, mask, device))
        (logits * 0.0).sum().backward()  # only the attached MTP loss has a gradient
    return {name: (p.grad.detach() if p.grad is not None else torch.zeros_like(p)).cpu().clone()
            for name, p in model.named_parameters()}
