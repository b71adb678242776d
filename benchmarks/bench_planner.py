"""Host step planning: time, linearity and token balance against a first-fit-decreasing baseline.

    python benchmarks/bench_planner.py                 # 1M and 8M response tokens, groups of 8 and 16
    python benchmarks/bench_planner.py --tokens 1 --reps 3
    python benchmarks/bench_planner.py --glibc-default # without the launcher's malloc setting

One step of N responses (4096 per 1M response tokens; lengths log-normal, median 180, clipped to
32..4096; prompts 16..128 tokens) is planned into DP=8 ranks x 16 microbatches: validation,
canonical group order, padding, ``token_weights`` for the whole step, bin assignment, the gather
into packed microbatches. Goals: at most 80 ms for 1M tokens, time linear in tokens (8M at
most 8.5x the 1M time), token balance (max/mean) at most 1.05 across ranks and microbatches when
no sequence exceeds a bin's share. Baseline: plain first-fit-decreasing into bins of capacity
ceil(total / bins), overflow to the lightest bin.

By default the process first applies the launcher's malloc setting
(``megatron_pg_agg.training.worker_process.keep_freed_memory``), as training does. The last line
is the summary ``planner: 1M <ms> ms; 8M/1M <ratio>``: the median plan time over every
repetition of every group size at 1M response tokens, and the 8M median over it. Plan times are
taken in rounds that plan every case once each, so the machine's slow spells fall on all sizes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.planner import PlanConfig, _lpt_bins, plan_step
from megatron_pg_agg.data.rollouts import RolloutBatch

DP, MICROBATCHES = 8, 16


def make_batch(millions: int, group: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    n = 4096 * millions
    resp = torch.exp(torch.randn(n, generator=g) * 0.8 + torch.log(torch.tensor(180.0))).round().clamp(32, 4096).long()
    prompt = torch.randint(16, 129, (n,), generator=g)
    r_total, p_total = int(resp.sum()), int(prompt.sum())
    mask = torch.rand(r_total, generator=g) > 0.05
    return RolloutBatch(
        prompt_lengths=prompt, response_lengths=resp,
        prompt_tokens=torch.randint(0, 32000, (p_total,), generator=g),
        response_tokens=torch.randint(0, 32000, (r_total,), generator=g),
        loss_mask=mask,
        advantages=torch.randn(r_total, generator=g),
        old_logprobs=-torch.rand(r_total, generator=g) * 5,
        group_index=torch.arange(n) // group,
        numerator_mask=mask & (torch.rand(r_total, generator=g) > 0.02),
    )


def ffd_bins(lengths: list, num_bins: int) -> list:
    """First-fit decreasing with capacity ceil(total / bins); what fits nowhere goes to the lightest bin."""
    cap = -(-sum(lengths) // num_bins)
    loads = [0] * num_bins
    bins = [[] for _ in range(num_bins)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b in range(num_bins) if loads[b] + lengths[i] <= cap), None)
        if target is None:
            target = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[target].append(i)
        loads[target] += lengths[i]
    return bins


def balance(bins: list, lengths: list) -> tuple[float, float]:
    loads = [sum(lengths[i] for i in b) for b in bins]
    mean = sum(loads) / len(loads)
    ranks = [sum(loads[b] for b in range(r, len(loads), DP)) for r in range(DP)]
    return max(loads) / mean, max(ranks) / (sum(ranks) / DP)


def timed_ms(fn, reps: int) -> list:
    """Milliseconds of ``reps`` calls, after warm-up calls."""
    for _ in range(3):  # warm-up to the steady state of a training loop, which plans every step
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_ms(fn, reps: int) -> float:
    return statistics.median(timed_ms(fn, reps))


def add_malloc_args(parser: argparse.ArgumentParser) -> None:
    """The malloc switches every planner benchmark takes: the launcher's setting unless told otherwise."""
    parser.add_argument("--glibc-default", action="store_true",
                        help="leave glibc malloc at its defaults instead of the launcher's setting")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="the launcher's malloc setting (the default; kept for old command lines)")


def apply_malloc_setting(args: argparse.Namespace) -> None:
    """Apply the launcher's malloc setting as training does, unless ``--glibc-default``; say which."""
    if not args.glibc_default:
        from megatron_pg_agg.training.worker_process import keep_freed_memory

        keep_freed_memory()  # as launch/train_actor.py does
    print(f"glibc malloc: {'default' if args.glibc_default else 'launcher setting (keep_freed_memory)'}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8], help="millions of response tokens")
    parser.add_argument("--groups", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json")
    add_malloc_args(parser)
    args = parser.parse_args(argv)
    apply_malloc_setting(args)
    cfg = PGLossConfig(mode="prompt_mean")
    plan_cfg = PlanConfig(dp_size=DP, num_microbatches=MICROBATCHES)
    cases = [(millions, group) for millions in args.tokens for group in args.groups]
    batches = {case: make_batch(*case) for case in cases}
    # Plan times in rounds, each planning every case once, so a slow spell of a shared machine
    # falls on every size alike and the 8M/1M ratio compares like with like.
    times_by_case = {case: [] for case in cases}
    plans = {}  # each case's plan from the last round, for its stats
    for round_ in range(2 + args.reps):  # two warm-up rounds: the steady state of a training loop
        for case in cases:
            t0 = time.perf_counter()
            plans[case] = plan_step(batches[case], cfg, plan_cfg)
            if round_ >= 2:
                times_by_case[case].append((time.perf_counter() - t0) * 1e3)
    rows, plan_times = [], {}
    for millions, group in cases:
        batch, plan = batches[millions, group], plans[millions, group]
        padded = (batch.prompt_lengths + batch.response_lengths).tolist()  # pad multiple 1
        times = times_by_case[millions, group]
        plan_times.setdefault(millions, []).extend(times)
        ours_ms = statistics.median(times)
        lpt_ms = median_ms(lambda: _lpt_bins(padded, DP * MICROBATCHES), args.reps)
        ffd_ms = median_ms(lambda: ffd_bins(padded, DP * MICROBATCHES), args.reps)
        ours_mb, ours_rank = balance(_lpt_bins(padded, DP * MICROBATCHES), padded)
        ffd_mb, ffd_rank = balance(ffd_bins(padded, DP * MICROBATCHES), padded)
        row = {
            "response_tokens": int(batch.response_lengths.sum()), "tokens": plan.stats["tokens"],
            "sequences": len(batch), "group": group,
            "plan_ms": ours_ms, "assign_lpt_ms": lpt_ms, "assign_ffd_ms": ffd_ms,
            "balance_microbatch": ours_mb, "balance_rank": ours_rank,
            "ffd_balance_microbatch": ffd_mb, "ffd_balance_rank": ffd_rank,
            "plan_stats_balance": plan.stats["microbatch_balance"],
        }
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    print("\n| response tokens | sequences | group | plan ms (all of it) | assign: LPT ms / FFD ms | balance mb (ours / FFD) | balance rank (ours / FFD) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['response_tokens'] / 1e6:.2f}M | {r['sequences']} | {r['group']} | {r['plan_ms']:.1f} | "
              f"{r['assign_lpt_ms']:.1f} / {r['assign_ffd_ms']:.1f} | {r['balance_microbatch']:.4f} / "
              f"{r['ffd_balance_microbatch']:.4f} | {r['balance_rank']:.4f} / {r['ffd_balance_rank']:.4f} |")
    by_size = {}
    for r in rows:
        by_size.setdefault(r["group"], []).append(r)
    for group, rs in by_size.items():
        if len(rs) > 1:
            rs.sort(key=lambda r: r["response_tokens"])
            scale = rs[-1]["response_tokens"] / rs[0]["response_tokens"]
            print(f"groups of {group}: {scale:.1f}x the tokens took {rs[-1]['plan_ms'] / rs[0]['plan_ms']:.1f}x the time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    medians = {m: statistics.median(t) for m, t in plan_times.items()}
    if 1 in medians and 8 in medians:  # the summary: last line
        print(f"planner: 1M {medians[1]:.1f} ms; 8M/1M {medians[8] / medians[1]:.1f}")


if __name__ == "__main__":
    main()
