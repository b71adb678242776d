"""The torchrun side of the fuzzer: each case's reference, then its layout, compared (rank 0 writes).

    python -m torch.distributed.run --standalone --nproc_per_node W \\
        -m megatron_pg_agg.parity.fuzz_worker CASES.json ROWS.jsonl

(:func:`megatron_pg_agg.parity.fuzz.run_fuzz` builds this command.) Every rank computes the
float64 reference of a case (the single-device model, :func:`~megatron_pg_agg.parity.reference.
reference` with the case's loss settings; a rollout correction is applied to the reference's
rollouts here, from its definition, not by the planner), then builds the case's layout with the
reference's weights and runs one planned step through megatron-core's real schedule.
"""
from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
from dataclasses import replace
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

from megatron_pg_agg.core.losses import REPORT_KEYS, PGLossConfig
from megatron_pg_agg.megatron.layout import ParallelSizes
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel
from megatron_pg_agg.megatron.step import StepGroups
from megatron_pg_agg.patches import apply_megatron_patches, rope_thd

from .fuzz import FuzzCase, fuzz_rollouts
from .reference import mtp_reference, reference
from .workers import build_layout_model, step_on_layout

TOL = 1e-5
"""|got - ref| <= TOL * max(|ref|, 1) for the objective and every reported field, and the grad
norm's relative error (float32 layouts against float64; seen: <= 3e-7)."""
GRAD_TOL = 5e-5
"""Per parameter, max |grad - ref| <= GRAD_TOL * max(max |ref|, 1e-3 x the largest reference
gradient entry) (seen: <= 7e-6, with MTP; a token's weight or count off moves it by 1e-2 or more)."""
SIDE_ROUNDING_ULPS = 8
"""With MTP the PG gradient is measured as the step's float32 total minus a side-only run's
(:func:`~megatron_pg_agg.parity.workers.step_on_layout`), so it carries the float32 rounding of the
MTP gradient it was taken from: an error within this many float32 ulps of a parameter's largest
side-gradient entry (its grad norm: of the side norm) is that rounding, not a wrong weight. Seen: 1-2
ulps (case 1671656309: PG gradient 2.6e-3 in norm under an MTP gradient of 0.2-0.3 per entry,
absolute errors 3e-8 to 7e-8)."""


def corrected_rollouts(rollouts, cfg: PGLossConfig) -> list:
    """The reference's view of a rollout correction, from its definition (docs/policy-losses.md):
    ``delta = old - rollout`` per valid token (or its mean over the response's valid tokens for the
    sequence variants); truncate: the PG weight ``min(exp(delta), C)``; mask: tokens (responses)
    with ``exp(delta)`` outside ``[c, C]`` leave the numerator."""
    out = []
    kind = cfg.rollout_correction
    for r in rollouts:
        valid = [j for j, m in enumerate(r.loss_mask) if m]
        numerator = [bool(m) and (r.numerator_mask is None or bool(r.numerator_mask[j]))
                     for j, m in enumerate(r.loss_mask)]
        new = SimpleNamespace(prompt_ids=r.prompt_ids, response_ids=r.response_ids, loss_mask=r.loss_mask,
                              advantages=r.advantages, old_logprobs=r.old_logprobs, ref_logprobs=r.ref_logprobs,
                              group_id=r.group_id, numerator_mask=numerator, pg_weights=None)
        if kind is not None:
            delta = [float(r.old_logprobs[j]) - float(r.rollout_logprobs[j]) for j in range(len(r.loss_mask))]
            if kind.startswith("sequence"):
                mean = sum(delta[j] for j in valid) / len(valid) if valid else 0.0
                delta = [mean] * len(delta)
            ratio = [math.exp(d) for d in delta]
            if kind.endswith("truncate"):
                new.pg_weights = [min(q, cfg.rollout_correction_max) for q in ratio]
            else:
                keep = [cfg.rollout_correction_min <= q <= cfg.rollout_correction_max for q in ratio]
                new.numerator_mask = [n and k for n, k in zip(numerator, keep)]
        out.append(new)
    return out


def _close(got, ref) -> float:
    """The error of a reported value against its reference, scaled (inf when one is missing)."""
    if got is None or ref is None:
        return 0.0 if got is None and ref is None else math.inf
    return abs(got - ref) / max(abs(ref), 1.0)


def _grad_error(full: dict, ref: dict, side: Optional[dict] = None) -> tuple:
    """``(worst relative error, its parameter, grad norm relative error, reference norm)``.
    ``side``: the side-only gradients ``full`` was taken from (a total minus them): their float32
    rounding (:data:`SIDE_ROUNDING_ULPS`) joins each denominator, scaled to the tolerance."""
    missing = sorted(set(ref) - set(full))
    if missing:
        raise RuntimeError(f"no gradient gathered for {missing[:5]}")
    top = max((float(v.abs().max()) for v in ref.values()), default=0.0)
    ulp = SIDE_ROUNDING_ULPS * torch.finfo(torch.float32).eps
    side = {k: v for k, v in (side or {}).items() if k in ref}
    floor = {k: ulp * float(side[k].abs().max()) / GRAD_TOL if k in side else 0.0 for k in ref}
    errors = {k: float((full[k].double() - ref[k].double()).abs().max())
              / max(float(ref[k].abs().max()), 1e-3 * top, floor[k], 1e-30) for k in ref}
    worst = max(errors, key=errors.get)
    norm = math.sqrt(sum(float((full[k].double() ** 2).sum()) for k in ref))
    ref_norm = math.sqrt(sum(float((ref[k].double() ** 2).sum()) for k in ref))
    side_norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in side.values()))
    scale = max(ref_norm, ulp * side_norm / TOL)
    norm_err = abs(norm - ref_norm) / scale if scale else (0.0 if norm == 0 else math.inf)
    return errors[worst], worst, norm_err, ref_norm


def run_one(case: FuzzCase, full_states: dict, device) -> dict:
    pc = case.parity_case
    rollouts = fuzz_rollouts(case)
    cfg = PGLossConfig(**case.loss)
    row = {"seed": case.seed, "case": case.describe(), "world": case.world}
    init_parallel(ParallelSizes())
    try:  # the same on every rank, with no collective: a failure here is this case's, not the run's
        ref_obj, ref_grads, state, ref_fields = reference(
            corrected_rollouts(rollouts, cfg), cfg.mode, cfg.policy_loss, pc.model_kind,
            full_states.get(pc.model_kind), cfg=replace(cfg, rollout_correction=None), with_report=True)
        full_states.setdefault(pc.model_kind, state)
        valid = sum(1 for r in rollouts for m in r.loss_mask if m)
        # the MTP term is a mean over the step's valid tokens: with none (W = 0) it and its gradient are 0
        mtp_ref = mtp_reference(rollouts, full_states["mtp"]) if pc.mtp and valid else None
    except Exception as exc:  # noqa: BLE001  (reported as the case's failure, with its rerun command)
        teardown_parallel()
        return {**row, "passed": False, "error": f"the reference failed: {type(exc).__name__}: {exc}"}
    teardown_parallel()
    try:
        model = build_layout_model(pc, full_states[pc.model_kind])
    except (AssertionError, ValueError, RuntimeError, NotImplementedError) as exc:
        teardown_parallel()  # every rank raises the same on the same case (deterministic build)
        return {**row, "refused": True, "why": f"megatron-core refused the build: {type(exc).__name__}: {exc}"}
    result, plan, full, mtp_full, _ = step_on_layout(pc, model, rollouts, cfg, StepGroups.from_parallel_state(), device)
    got = result.values(plan.totals.pg_weight)
    teardown_parallel()
    if pc.mtp:
        ref_grads = {k: v for k, v in ref_grads.items() if not k.startswith("mtp.")}
    grad_err, worst, norm_err, ref_norm = _grad_error(full, ref_grads, mtp_full)
    if pc.mtp:
        if mtp_ref is None:  # no valid token: the MTP-only gradient must be exactly 0
            mtp_err = 0.0 if all(float(v.abs().max()) == 0.0 for v in mtp_full.values()) else math.inf
        else:
            mtp_err = _grad_error(mtp_full, mtp_ref)[0]
        if mtp_err > grad_err:
            grad_err, worst = mtp_err, "MTP-only gradient"
    fields = {k: _close(got.get(k), ref_fields[k]) for k in REPORT_KEYS}
    worst_field = max(fields, key=fields.get)
    objective = got["objective"] if got["objective"] is not None else 0.0
    obj_err = _close(objective, ref_obj if plan.totals.pg_weight else 0.0)
    passed = obj_err <= TOL and fields[worst_field] <= TOL and grad_err <= GRAD_TOL and norm_err <= TOL
    return {**row, "objective": objective, "reference": ref_obj, "objective_rel_err": obj_err,
            "fields_max_err": fields[worst_field], "worst_field": worst_field, "fields": got,
            "reference_fields": ref_fields, "grad_max_rel_err": grad_err, "worst_parameter": worst,
            "grad_norm_rel_err": norm_err, "grad_norm_reference": ref_norm, "pg_weight": plan.totals.pg_weight,
            "passed": passed}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec, out = argv
    faulthandler.dump_traceback_later(float(os.environ.get("PG_AGG_HANG_DUMP_S", "1500")), exit=True)
    with open(spec) as f:
        cases = [FuzzCase(**{k: v for k, v in d.items()}) for d in json.load(f)]
    apply_megatron_patches(cpu_gloo=not torch.cuda.is_available(), rope_thd=rope_thd.needed(),
                           moe_aux_loss=any(c.parity_case.experts for c in cases),
                           mtp_loss=any(c.parity_case.mtp for c in cases))
    init_distributed()
    device = None
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda")
    full_states = {}  # per model kind: the first reference's initialisation (the same on every rank)
    # rank 0 appends each case's row as it ends: a launch that dies keeps what it finished
    rows = open(out, "w") if dist.get_rank() == 0 else None  # noqa: SIM115
    for case in cases:
        row = run_one(case, full_states, device)
        dist.barrier()
        if rows is not None:
            rows.write(json.dumps(row) + "\n")
            rows.flush()
    if rows is not None:
        rows.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
