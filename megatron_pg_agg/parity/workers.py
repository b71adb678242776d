"""The torchrun side of the parity check: every rank computes the reference, then runs each case
through the planner and megatron-core's real schedule and compares (rows on global rank 0).

    python -m torch.distributed.run --standalone --nproc_per_node 4 -m megatron_pg_agg.parity.workers \\
        --cases-json '[...]' --modes seq_mean --policy-losses ppo gspo --out rows.json

(:func:`megatron_pg_agg.parity.cli.launch` builds this command.)
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads

from megatron_pg_agg.core.aggregation import token_weights
from megatron_pg_agg.core.losses import REPORT_KEYS
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.megatron.config_checks import check_megatron_config
from megatron_pg_agg.megatron.layout import ParallelSizes
from megatron_pg_agg.megatron.model import default_ddp_config, wrap_in_ddp
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel
from megatron_pg_agg.megatron.step import StepGroups, run_pg_step
from megatron_pg_agg.patches import apply_megatron_patches, rope_thd

from .fixture import GRAD_RTOL, MODES, OBJECTIVE_RTOL, POLICY_LOSSES, VOCAB, ParityCase, loss_config, parity_rollouts
from .models import build_case_model, full_named_tensors, load_full_state
from .reference import mtp_reference, reference
from .report import REFERENCE_LABELS, format_row

__all__ = ["build_layout_model", "gather_full_grads", "plan_config", "run_case", "step_on_layout", "worker_main"]


def gather_full_grads(ddp_chunks) -> dict:
    """This rank's ``main_grad``s, TP shards concatenated, under single-device names."""
    return full_named_tensors(ddp_chunks, lambda chunk: {p: p.main_grad.detach().clone()
                                                         for p in chunk.module.parameters()})


def _per_microbatch_weights(mb, rollouts, cfg):
    """The control's bug: weights computed from the tokens one rank sees in one microbatch (its
    CP share of each sequence: the planner's ``cu_seqlens_local``)."""

    groups = []
    for k, s in enumerate(mb.sequence_ids):
        if k and rollouts[s].group_id == rollouts[mb.sequence_ids[k - 1]].group_id:
            groups[-1] += 1
        else:
            groups.append(1)
    return token_weights(mb.numerator_mask, mode=cfg.mode, divisor=cfg.divisor,
                         cu_seqlens=mb.cu_seqlens_local.long(), group_sizes=groups,
                         denominator_mask=mb.denominator_mask)


def _plan(case: ParityCase, rollouts, cfg, cp_rank: int):

    return plan_step(rollouts, cfg, plan_config(case), cp_rank=cp_rank)


def plan_config(case: ParityCase) -> PlanConfig:
    """How the case cuts its step: its DP/TP/CP sizes and microbatch count or capacity."""
    return PlanConfig(
        dp_size=case.dp, num_microbatches=case.num_microbatches if case.max_tokens is None else None,
        max_tokens_per_microbatch=case.max_tokens, tp_size=case.tp, cp_size=case.cp,
        vocab_size=VOCAB, uniform_microbatch_tokens=case.uniform_tokens)


def _groups(case: ParityCase):
    """The step's process groups; the control drops the CP group: each CP rank's sequence
    statistic then comes from its own tokens only."""

    groups = StepGroups.from_parallel_state()
    return replace(groups, context=None) if case.control == "no_cp_statistic_reduction" else groups


def _subtract_side_loss_gradient(model, rollouts, cfg, case, groups, cp_rank, dp_rank, device):
    """``main_grad -= `` the gradient of a side-loss-only run of the same step (advantages 0, KL
    and entropy off: the PG loss and its gradient are exactly 0 for every policy loss), leaving
    the PG objective's gradient. The side losses (MoE router aux/z losses, the MTP loss) add
    linearly; tests/distributed/test_moe.py checks the routers' strength. Returns the side-only
    run's gathered full gradients with MTP (checked against the MTP reference), else None."""

    total = {id(p): p.main_grad.detach().clone() for chunk in model for p in chunk.module.parameters()}
    aux_rollouts = [replace(r, advantages=[0.0] * len(r.advantages)) for r in rollouts]
    aux_cfg = replace(cfg, kl_coef=0.0, entropy_coef=0.0)
    run_pg_step(model, _plan(case, aux_rollouts, aux_cfg, cp_rank), aux_cfg, groups, dp_rank=dp_rank,
                experts=bool(case.experts), device=device)
    side = gather_full_grads(model) if case.mtp else None
    with torch.no_grad():
        for chunk in model:
            for p in chunk.module.parameters():
                p.main_grad.copy_(total[id(p)] - p.main_grad)
    return side


def _grad_errors(full: dict, ref_grads: dict, where: str) -> dict:
    """``{parameter: max |grad - ref| / max |ref|}`` over the reference's parameters."""
    missing = sorted(set(ref_grads) - set(full))
    if missing:
        raise RuntimeError(f"{where}: no gradient gathered for {missing}")
    return {k: float((full[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max().clamp_min(1e-30))
            for k in ref_grads}


def _compare(case, policy, mode, objective, full, references, plan, step_s, mtp_full=None) -> dict:
    ref_obj, ref_grads, _ = references[(case.model_kind, policy, mode)]
    if mtp_full is not None:
        # the PG reference gives the MTP block no gradient (exactly 0 here too: total minus the
        # MTP-only run); the MTP block is checked through the MTP-only run's gradient instead
        ref_grads = {k: v for k, v in ref_grads.items() if not k.startswith("mtp.")}
    errors = _grad_errors(full, ref_grads, case.name)
    if mtp_full is not None:
        mtp_errors = _grad_errors(mtp_full, references["mtp-only"], case.name)
        errors.update({f"MTP-only {k}": v for k, v in mtp_errors.items()})
    worst = max(errors, key=errors.get)
    if os.environ.get("PG_AGG_PARITY_DEBUG"):
        got_ref = {k: (full[k], v) for k, v in ref_grads.items()}
        if mtp_full is not None:
            got_ref.update({f"MTP-only {k}": (mtp_full[k], v) for k, v in references["mtp-only"].items()})
        for k in sorted(errors, key=errors.get)[-6:]:
            got, ref = got_ref[k]
            print(f"  {k}: rel {errors[k]:.2e} ref max {float(ref.abs().max()):.3e} "
                  f"abs err {float((got - ref).abs().max()):.3e}", flush=True)
    obj_err = abs(objective - ref_obj) / max(abs(ref_obj), 1e-30)
    within = obj_err <= OBJECTIVE_RTOL and errors[worst] <= GRAD_RTOL
    return {
        "layout": case.name, "policy_loss": policy, "mode": mode, "objective": objective, "reference": ref_obj,
        "objective_rel_err": obj_err, "grad_max_rel_err": errors[worst], "worst_parameter": worst,
        "expect_fail": case.expect_fail, "passed": within != case.expect_fail,
        "microbatch_balance": plan.stats["microbatch_balance"], "step_s": step_s,
    }


def _gather_everywhere(grads: dict) -> dict:
    """Every rank's gathered gradients merged on rank 0 (an embedding copy on two pipeline stages
    holds the same all-reduced gradient on both)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grads)
    full = {}
    for g in gathered:
        full.update(g)
    return full


def build_layout_model(case: ParityCase, full_state: dict) -> list:
    """The case's layout initialised (``parallel_state``) and its DDP-wrapped chunks holding the
    reference's weights ``full_state``; the project's config checks unless a control breaks them."""
    init_parallel(case.layout, ep=case.ep)
    per_token_loss = case.control != "megatron_default_averaging"
    config, chunks = build_case_model(case, per_token_loss=per_token_loss)
    load_full_state(chunks, full_state)
    ddp_config = default_ddp_config()
    model = wrap_in_ddp(chunks, config, ddp_config)
    config.finalize_model_grads_func = finalize_model_grads
    if case.control is None:
        check_megatron_config(config, ddp_config)
    return model


def step_on_layout(case: ParityCase, model, rollouts, cfg, groups, device, microbatches=None):
    """One planned step of ``rollouts`` on the layout's ``model``: ``(result, plan, full, mtp_full,
    step_s)``, ``full`` the PG objective's gradients gathered under single-device names (on every
    rank; MoE/MTP: the side losses' gradient subtracted), ``mtp_full`` the MTP-only run's."""
    dp_rank = parallel_state.get_data_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    # MoE: expert gradients live on their EP rank (any DP rank): every rank sends its gradients
    keep = (dp_rank == 0 and cp_rank == 0) or bool(case.experts)
    plan = _plan(case, rollouts, cfg, cp_rank)
    mbs = None if microbatches is None else microbatches(plan, dp_rank)
    t0 = time.perf_counter()
    result = run_pg_step(model, plan, cfg, groups, dp_rank=dp_rank, experts=bool(case.experts),
                         device=device, microbatches=mbs)
    step_s = time.perf_counter() - t0
    mtp_grads = None
    if case.experts or case.mtp:
        mtp_grads = _subtract_side_loss_gradient(model, rollouts, cfg, case, groups, cp_rank, dp_rank, device)
    full = _gather_everywhere(gather_full_grads(model) if keep else {})
    mtp_full = _gather_everywhere(mtp_grads if keep else {}) if case.mtp else None
    return result, plan, full, mtp_full, step_s


def run_case(case: ParityCase, rollouts, runs, full_states, references):
    """Run one case for each ``(policy_loss, mode)`` of ``runs``; rows on global rank 0 (None
    elsewhere)."""
    model = build_layout_model(case, full_states[case.model_kind])
    groups = _groups(case)
    device = torch.device("cuda") if torch.cuda.is_available() else None
    rows = []
    for policy, mode in runs:
        cfg = loss_config(mode, policy)
        microbatches = None
        if case.control == "per_microbatch_weights":
            def microbatches(plan, dp_rank, cfg=cfg):
                return [replace(mb, token_weights=_per_microbatch_weights(mb, rollouts, cfg))
                        for mb in plan.for_rank(dp_rank)]
        result, plan, full, mtp_full, step_s = step_on_layout(case, model, rollouts, cfg, groups, device,
                                                              microbatches)
        total, count = result.pairs[REPORT_KEYS.index("objective")].tolist()  # every stage has them
        if dist.get_rank() != 0:
            continue
        objective = total / count if count else 0.0
        rows.append(_compare(case, policy, mode, objective, full, references, plan, step_s, mtp_full))
    teardown_parallel()
    return rows if dist.get_rank() == 0 else None


def worker_main(argv=None) -> int:


    parser = argparse.ArgumentParser(prog="python -m megatron_pg_agg.parity.workers")
    parser.add_argument("--cases-json", required=True, help="JSON list of ParityCase fields")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--policy-losses", nargs="+", default=list(POLICY_LOSSES), choices=POLICY_LOSSES)
    parser.add_argument("--out", required=True, help="rank 0 writes the rows here (JSON)")
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(float(os.environ.get("PG_AGG_HANG_DUMP_S", "540")), exit=True)
    cases = [ParityCase(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
             for d in json.loads(args.cases_json)]
    # moe_aux_loss whenever a model has experts (router losses at Megatron's default strength)
    apply_megatron_patches(cpu_gloo=not torch.cuda.is_available(), rope_thd=rope_thd.needed(),
                           moe_aux_loss=any(case.experts for case in cases), mtp_loss=any(case.mtp for case in cases))
    init_distributed()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rollouts = parity_rollouts()
    runs = {case.name: case.runs(args.modes, args.policy_losses) for case in cases}
    # The references: the same on every rank (deterministic CPU init), then shared weights.
    init_parallel(ParallelSizes())
    references, full_states = {}, {}
    needed = sorted({(case.model_kind, p, m) for case in cases for p, m in runs[case.name]})
    for kind, policy, mode in needed:
        obj, grads, state = reference(rollouts, mode, policy, kind, full_states.get(kind))
        full_states.setdefault(kind, state)
        references[(kind, policy, mode)] = (obj, grads, state)
    if "mtp" in full_states:  # the MTP term's own reference gradient (mode-independent)
        references["mtp-only"] = mtp_reference(rollouts, full_states["mtp"])
    teardown_parallel()
    rows = []
    for case in cases:
        if not runs[case.name]:
            continue
        got = run_case(case, rollouts, runs[case.name], full_states, references)
        dist.barrier()
        if dist.get_rank() == 0:
            rows.extend(got)
            for row in got:
                print(format_row(row), flush=True)
    if dist.get_rank() == 0:
        ref_rows = [{"layout": "single-process reference" + REFERENCE_LABELS[k], "policy_loss": p,
                     "mode": m, "objective": references[(k, p, m)][0], "reference": references[(k, p, m)][0],
                     "objective_rel_err": 0.0, "grad_max_rel_err": 0.0, "expect_fail": False, "passed": True}
                    for k, p, m in needed]
        with open(args.out, "w") as f:
            json.dump(ref_rows + rows, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
