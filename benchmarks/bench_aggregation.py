"""Forward+backward cost of the aggregation against a bare masked sum and a segment-sum baseline.

    python benchmarks/bench_aggregation.py                # T = 1M and 8M, every mode
    python benchmarks/bench_aggregation.py --tokens 1000000 --reps 5 --no-memory

Timing runs in one process, implementations interleaved, median of --reps. Peak memory is the
extra resident-set high-water mark of one forward+backward over its inputs, measured in a fresh
child process per (implementation, mode, T) with the kernel's mark reset first (Linux). Goals: token form within 1.3x
of the bare masked sum; local form within 2x of it and >= 1.5x faster than the segment-sum
baseline for seq_mean and prompt_mean; token_weights for a 1M-token step under 50 ms.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _peak import extra_peak_bytes, in_child

from megatron_pg_agg import aggregate, token_weights, weighted_sum
from megatron_pg_agg.core.modes import MODES

DIVISOR = 2048.0
GROUP = 8


def make_step(num_tokens: int, seed: int = 0):
    """Packed step: sequence lengths uniform in 32..2048, groups of 8 (last one ragged), ~10% of
    tokens outside the loss mask and ~5% of the rest filtered from the numerator."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    remaining = num_tokens
    while remaining > 0:
        n = min(int(torch.randint(32, 2049, (1,), generator=g)), remaining)
        lengths.append(n)
        remaining -= n
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    full, last = divmod(len(lengths), GROUP)
    groups = [GROUP] * full + ([last] if last else [])
    den = torch.rand(num_tokens, generator=g) > 0.1
    num = den & (torch.rand(num_tokens, generator=g) > 0.05)
    loss = torch.randn(num_tokens, generator=g)
    return loss, num, den, cu, groups


def segment_sum_baseline(loss, num, den, cu, groups, mode):
    """A straightforward per-call implementation: scatter_add per sequence, then per group."""
    seqs = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(seqs), lengths, output_size=loss.numel())
    n_s = torch.zeros(seqs).scatter_add(0, seq_id, torch.where(num, loss, 0.0))
    d_s = torch.zeros(seqs).scatter_add(0, seq_id, den.float())
    if mode == "prompt_mean":
        gs = torch.tensor(groups)
        group_id = torch.repeat_interleave(torch.arange(gs.numel()), gs, output_size=seqs)
        n_s = torch.zeros(gs.numel()).scatter_add(0, group_id, n_s)
        d_s = torch.zeros(gs.numel()).scatter_add(0, group_id, d_s)
    active = d_s > 0
    weight = active.sum()
    if mode == "constant":
        return n_s.sum() / (weight.clamp(min=1) * DIVISOR), weight
    per_unit = torch.where(active, n_s / d_s.clamp(min=1), 0.0)
    return per_unit.sum() / weight.clamp(min=1), weight


def bare_masked_sum(loss, num, den):
    return torch.where(num, loss, 0.0).sum() / den.sum()


def runners(step, mode):
    loss, num, den, cu, groups = step
    kw = {"divisor": DIVISOR} if mode == "constant" else {}
    if mode == "prompt_mean":
        kw["group_sizes"] = groups
    weights = token_weights(num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw)
    out = {
        "bare": lambda leaf: bare_masked_sum(leaf, num, den),
        "token_form": lambda leaf: weighted_sum(leaf, num, weights, validate=False)[0],
        "local_form": lambda leaf: aggregate(
            leaf, num, mode=mode, cu_seqlens=cu, denominator_mask=den, validate=False, **kw)[0],
    }
    if mode != "token_mean":
        out["segment_sum"] = lambda leaf: segment_sum_baseline(leaf, num, den, cu, groups, mode)[0]
    return out, kw


def fwd_bwd(fn, loss):
    leaf = loss.detach().requires_grad_(True)
    fn(leaf).backward()
    return leaf.grad


def time_it(fn, loss):
    start = time.perf_counter()
    fwd_bwd(fn, loss)
    return time.perf_counter() - start


def child_peak(impl: str, mode: str, tokens: int) -> int:
    """In a fresh process: extra peak RSS (bytes) of one forward+backward over its inputs (and,
    for the token form, the step's TokenWeights), the loss gradient included."""
    step = make_step(tokens)
    fns, _ = runners(step, mode)
    return extra_peak_bytes(lambda: fwd_bwd(fns[impl], step[0]))


def measure_memory(impl, mode, tokens):
    return in_child("bench_aggregation", "child_peak", impl, mode, tokens)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1_000_000, 8_000_000])
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per implementation")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-child peak-memory runs")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    results = []
    for tokens in args.tokens:
        step = make_step(tokens)
        loss, num, den, cu, groups = step
        plan_times = []
        for mode in MODES:
            kw = {"divisor": DIVISOR} if mode == "constant" else {}
            if mode == "prompt_mean":
                kw["group_sizes"] = groups
            for _ in range(args.reps):
                t0 = time.perf_counter()
                token_weights(num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw)
                plan_times.append((mode, time.perf_counter() - t0))
        for mode in MODES:
            ms = statistics.median(t for m, t in plan_times if m == mode) * 1e3
            print(f"T={tokens:>9,} {mode:<12} token_weights {ms:8.1f} ms", flush=True)
            results.append({"tokens": tokens, "mode": mode, "impl": "token_weights", "ms": ms})
        for mode in MODES:
            fns, _ = runners(step, mode)
            for fn in fns.values():  # warm-up
                fwd_bwd(fn, loss)
            times = {name: [] for name in fns}
            for _ in range(args.reps):  # interleaved repetitions
                for name, fn in fns.items():
                    times[name].append(time_it(fn, loss))
            med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            row = {"tokens": tokens, "mode": mode, **{f"{k}_ms": v for k, v in med.items()}}
            row["token_form_vs_bare"] = med["token_form"] / med["bare"]
            row["local_form_vs_bare"] = med["local_form"] / med["bare"]
            if "segment_sum" in med:
                row["segment_sum_vs_local_form"] = med["segment_sum"] / med["local_form"]
            if not args.no_memory:
                for name in fns:
                    row[f"{name}_peak_MiB"] = measure_memory(name, mode, tokens) / 2**20
            results.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    print("\n| T | mode | bare ms | token form ms (x bare) | local form ms (x bare) | segment-sum ms (x slower than local) | token_weights ms |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "bare_ms" not in r:
            continue
        tw = next(x["ms"] for x in results if x.get("impl") == "token_weights" and x["tokens"] == r["tokens"] and x["mode"] == r["mode"])
        seg = f"{r['segment_sum_ms']:.1f} ({r['segment_sum_vs_local_form']:.2f}x)" if "segment_sum_ms" in r else "-"
        print(f"| {r['tokens']/1e6:.0f}M | {r['mode']} | {r['bare_ms']:.1f} | {r['token_form_ms']:.1f} ({r['token_form_vs_bare']:.2f}x) "
              f"| {r['local_form_ms']:.1f} ({r['local_form_vs_bare']:.2f}x) | {seg} | {tw:.1f} |")
    if not args.no_memory:
        print("\n| T | mode | extra peak MiB: bare / token form / local form / segment-sum |")
        print("|---|---|---|")
        for r in results:
            if "bare_peak_MiB" in r:
                seg = f"{r['segment_sum_peak_MiB']:.0f}" if "segment_sum_peak_MiB" in r else "-"
                print(f"| {r['tokens']/1e6:.0f}M | {r['mode']} | {r['bare_peak_MiB']:.0f} / {r['token_form_peak_MiB']:.0f} / "
                      f"{r['local_form_peak_MiB']:.0f} / {seg} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
