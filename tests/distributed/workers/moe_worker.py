"""MoE worker: router aux/z losses under the exact aggregation, real megatron-core MoE layers.

Run with ``torchrun --standalone --nproc_per_node N -m tests.distributed.workers.moe_worker --out rows.json
--layouts NAME...`` (see :data:`LAYOUTS`; N = the layouts' world size). For each layout it builds
a tiny MoE GPT (4 experts, top-2, aux 0.01, z 1e-3, 2 layers) twice with the same weights, once
with ``calculate_per_token_loss=True`` (this project's contract) and once with Megatron's default
averaging, and runs megatron-core's real schedule + DDP + finalize_model_grads on one ragged step
(prompt groups 3, 1, 2, 4, 2; unequal microbatches):

* aux-only (advantages 0, KL and entropy off): with the ``moe_aux_loss`` patch every mode's
  gradients (all parameters, router included) equal the default-averaging run's (``err_<mode>``);
  without the patch (the control, ``unpatched_err_<mode>``) they must not. ``factor_*`` is the
  router-gradient ratio to the default run (projection <g, g_def> / <g_def, g_def>).
* a W = 0 step (every loss mask 0): with the patch every gradient is exactly zero.
* linearity: gradient(PG + aux) = gradient(PG only) + gradient(aux only), prompt_mean.
* (1-rank launch only) the op trace of a router forward/backward and the patched
  ``set_loss_scale`` with the patch active: no host sync.

Rank 0 writes one JSON row per layout; the pytest side (tests/distributed/test_moe.py) asserts.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from megatron_pg_agg.patches import _machinery, apply_megatron_patches, moe_aux_loss

apply_megatron_patches(cpu_gloo=True, moe_aux_loss=True)  # before any model is built

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402

from megatron_pg_agg.core.losses import PGLossConfig  # noqa: E402
from megatron_pg_agg.data.planner import PlanConfig, plan_step  # noqa: E402
from megatron_pg_agg.megatron.config_checks import check_megatron_config  # noqa: E402
from megatron_pg_agg.megatron.layout import ParallelSizes  # noqa: E402
from megatron_pg_agg.megatron.model import build_model_chunks, default_ddp_config, wrap_in_ddp  # noqa: E402
from megatron_pg_agg.megatron.moe import begin_moe_step, clear_moe_aux_loss_scale, router_loss_pairs  # noqa: E402
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel  # noqa: E402
from megatron_pg_agg.megatron.step import StepGroups, run_pg_step  # noqa: E402
from megatron_pg_agg.parity import VOCAB, parity_rollouts  # noqa: E402
from megatron_pg_agg.parity.models import tiny_transformer_config  # noqa: E402

MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")
AUX_COEFF, Z_COEFF = 0.01, 1e-3
HANG_DUMP_S = 100

# name -> (tp, pp, ep, sequence_parallel, dispatcher, microbatches per DP rank)
LAYOUTS = {
    "1 rank, 3 mb": (1, 1, 1, False, "alltoall", 3),
    "DP2, allgather, 3 mb": (1, 1, 1, False, "allgather", 3),
    "DP2 x EP2, alltoall, 3 mb": (1, 1, 2, False, "alltoall", 3),
    "DP2 x EP2, allgather (uniform microbatches), 3 mb": (1, 1, 2, False, "allgather", 3),
    "PP2 (1F1B), alltoall, 3 mb": (1, 2, 1, False, "alltoall", 3),
}


def loss_config(mode: str) -> PGLossConfig:
    return PGLossConfig(mode=mode, divisor=16.0 if mode == "constant" else None,
                        clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0, entropy_coef=0.0)


def step_rollouts(kind: str):
    """'pg': the parity step; 'aux': advantages 0 (the PG loss and its gradient are exactly 0);
    'empty': every loss mask 0 (W = 0)."""
    rollouts = parity_rollouts(with_ref=False)
    if kind == "aux":
        return [replace(r, advantages=[0.0] * len(r.advantages)) for r in rollouts]
    if kind == "empty":
        return [replace(r, loss_mask=[0] * len(r.loss_mask), numerator_mask=[0] * len(r.loss_mask))
                for r in rollouts]
    return rollouts


class Setup:
    """One layout: the per-token model (patched contract) and a default-averaging twin."""

    def __init__(self, tp, pp, ep, sp, dispatcher, num_mb):
        init_parallel(ParallelSizes(tp=tp, pp=pp), ep=ep)
        self.tp, self.pp, self.ep, self.sp, self.num_mb = tp, pp, ep, sp, num_mb
        self.dp = parallel_state.get_data_parallel_world_size()
        self.uniform = dispatcher == "allgather" and (ep > 1 or pp > 1)
        self.models, self.configs = {}, {}
        state = None
        for per_token in (True, False):
            config = tiny_transformer_config(
                num_layers=2, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                sequence_parallel=sp, calculate_per_token_loss=per_token,
                num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=AUX_COEFF, moe_z_loss_coeff=Z_COEFF,
                expert_model_parallel_size=ep, moe_token_dispatcher_type=dispatcher, add_bias_linear=False,
                variable_seq_lengths=pp > 1 and dispatcher == "alltoall",
            )
            torch.manual_seed(1234)
            chunks = build_model_chunks(config, VOCAB, 64, share_embeddings_and_output_weights=False)
            if state is None:
                state = [c.state_dict() for c in chunks]
            else:
                for c, s in zip(chunks, state):
                    c.load_state_dict(s)
            ddp = default_ddp_config()
            model = wrap_in_ddp(chunks, config, ddp)
            config.finalize_model_grads_func = finalize_model_grads
            if per_token:
                check_megatron_config(config, ddp)  # the patch is active: MoE with aux is accepted
            self.models[per_token], self.configs[per_token] = model, config

    def run(self, kind: str, mode: str, *, per_token: bool = True, patched: bool = True,
            aux: bool = True) -> dict:
        """One step; returns this rank's gradients by parameter name (and the loss pairs)."""
        model, config = self.models[per_token], self.configs[per_token]
        config.moe_aux_loss_coeff = AUX_COEFF if aux else 0.0
        config.moe_z_loss_coeff = Z_COEFF if aux else None
        if patched != _machinery.is_applied(moe_aux_loss.PATCH):
            (_machinery.apply if patched else _machinery.revert)(moe_aux_loss.PATCH)
        cfg = loss_config(mode)
        plan = plan_step(step_rollouts(kind), cfg, PlanConfig(
            dp_size=self.dp, num_microbatches=self.num_mb, tp_size=self.tp, sequence_parallel=self.sp,
            vocab_size=VOCAB, uniform_microbatch_tokens=self.uniform))
        mbs = plan.for_rank(parallel_state.get_data_parallel_rank())
        # the project's step (the factor W / M_total set, router pairs reduced) when the patch
        # and the per-token contract are on; otherwise Megatron's own strength, factor cleared
        scaled = per_token and patched
        clear_moe_aux_loss_scale()
        result = run_pg_step(model, plan, cfg, StepGroups.from_parallel_state(),
                             dp_rank=parallel_state.get_data_parallel_rank(), experts=scaled)
        clear_moe_aux_loss_scale()
        if scaled:
            pairs = result.router_pairs
        else:
            pairs = router_loss_pairs([c.module for c in model], len(mbs))
            dist.all_reduce(pairs)
        grads = {name: p.main_grad.detach().clone() for c in model for name, p in c.module.named_parameters()}
        return {"grads": grads, "pairs": pairs, "weight": plan.totals.pg_weight,
                "tokens": [mb.num_tokens for mb in mbs], "microbatches": len(mbs),
                "tokens_total": sum(mb.num_tokens for rank_mbs in plan.microbatches for mb in rank_mbs)}


def rel_err(a: dict, b: dict) -> float:
    """max over parameters of max|a - b| / max|b|, the max over all ranks."""
    local = max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in b)
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def router_factor(g: dict, ref: dict) -> float:
    """<g, ref> / <ref, ref> over the router weights (replicated: read on this rank)."""
    keys = [k for k in ref if k.endswith("router.weight")]
    num = sum(float((g[k].double() * ref[k].double()).sum()) for k in keys)
    den = sum(float((ref[k].double() ** 2).sum()) for k in keys)
    t = torch.tensor([num, den], dtype=torch.float64)
    dist.all_reduce(t)  # PP: routers live on different stages
    return float(t[0] / t[1])


def max_abs(g: dict, only_router: bool = False) -> float:
    local = max(float(v.abs().max()) for k, v in g.items() if not only_router or k.endswith("router.weight"))
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def check_layout(name: str) -> dict:
    t0 = time.perf_counter()
    s = Setup(*LAYOUTS[name])
    row = {"layout": name, "tp": s.tp, "pp": s.pp, "ep": s.ep, "dp": s.dp}
    default = s.run("aux", "token_mean", per_token=False, patched=False)
    row["tokens_rank0"] = default["tokens"]
    row["tokens_total"] = default["tokens_total"]  # routed tokens of the step (every DP rank)
    row["microbatches_total"] = default["microbatches"] * s.dp
    row["moe_layers"] = 2
    row["default_router_grad_max"] = max_abs(default["grads"], only_router=True)
    for mode in MODES:
        got = s.run("aux", mode)
        row[f"err_{mode}"] = rel_err(got["grads"], default["grads"])
        row[f"factor_{mode}"] = router_factor(got["grads"], default["grads"])
        row[f"weight_{mode}"] = got["weight"]
        if mode == "token_mean":
            row["pairs_patched"] = got["pairs"].tolist()
            row["pairs_default"] = default["pairs"].tolist()
        bad = s.run("aux", mode, patched=False)
        row[f"unpatched_err_{mode}"] = rel_err(bad["grads"], default["grads"])
        row[f"unpatched_factor_{mode}"] = router_factor(bad["grads"], default["grads"])
    # W = 0: every gradient exactly zero with the patch; the unpatched control is not
    empty = s.run("empty", "token_mean")
    row["w0_weight"] = empty["weight"]
    row["w0_max_abs_grad"] = max_abs(empty["grads"])
    empty_bad = s.run("empty", "token_mean", patched=False)
    row["w0_unpatched_router_grad_max"] = max_abs(empty_bad["grads"], only_router=True)
    empty_default = s.run("empty", "token_mean", per_token=False, patched=False)
    row["w0_unpatched_factor"] = router_factor(empty_bad["grads"], empty_default["grads"])
    # linearity, prompt_mean: PG + aux = PG only + aux only
    both = s.run("pg", "prompt_mean")["grads"]
    pg_only = s.run("pg", "prompt_mean", aux=False)["grads"]
    aux_only = s.run("aux", "prompt_mean")["grads"]
    row["linearity_err"] = rel_err({k: pg_only[k] + aux_only[k] for k in both}, both)
    row["aux_share_of_grad"] = max_abs(aux_only) / max_abs(both)
    row["seconds"] = time.perf_counter() - t0
    teardown_parallel()
    return row


def hot_path_trace() -> dict:
    """A router forward + backward and the patched set_loss_scale, traced with the patch active
    and a step factor set (1 rank)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router import TopKRouter

    from tests.support.op_trace import OpTrace  # the project's trace (syncs, data-dependent shapes)

    s = Setup(1, 1, 1, False, "alltoall", 1)
    chunk = s.models[True][0].module
    router = next(m for m in chunk.modules() if isinstance(m, TopKRouter))
    hidden = torch.randn(12, 1, 32, requires_grad=True)
    clear_moe_aux_loss_scale()
    try:  # misuse: a per-token model's router attaching its loss with no step factor set
        router(hidden)
        missing_factor_error = None
    except RuntimeError as err:
        missing_factor_error = str(err)
    begin_moe_step(7, 1, 1)
    trace = OpTrace()
    with trace:
        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
        probs, _ = router(hidden)
        probs.sum().backward()
    clear_moe_aux_loss_scale()
    teardown_parallel()
    return {"layout": "hot path trace", "violations": trace.violations, "ops": len(trace.ops),
            "patched": getattr(MoEAuxLossAutoScaler.set_loss_scale, _machinery.MARKER, None),
            "scale_after": float(MoEAuxLossAutoScaler.main_loss_backward_scale),
            "missing_factor_error": missing_factor_error}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", nargs="+", required=True, choices=list(LAYOUTS))
    parser.add_argument("--hot-path", action="store_true")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(HANG_DUMP_S, exit=True)
    init_distributed()
    rows = []
    for name in args.layouts:
        row = check_layout(name)
        dist.barrier()
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    if args.hot_path:
        rows.append(hot_path_trace())
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print("MOE OK", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
