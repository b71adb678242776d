"""Bytes per microbatch that a sequence-level policy loss (gspo/gmpo) moves under context
parallelism: ours, one all-reduce of the per-sequence statistic ([sequences in the microbatch]
float32), against all-gathering the log-probs across the CP group (what gather-based peers do to
see whole sequences). Both counted from the real planned microbatches of a 1M-response-token step
(the planner's CP layout), per rank, with the ring algorithms' traffic: all-reduce sends
2 (cp - 1) / cp of its buffer, all-gather (cp - 1) x the local part.

    python benchmarks/bench_cp_statistic.py [--millions 1] [--cp 2 4 8] [--dp 4] [--microbatches 8]
"""
from __future__ import annotations

import argparse
import statistics

from bench_planner import make_batch

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.planner import PlanConfig, plan_step

FLOAT32 = 4


def measure(batch, cp: int, dp: int, microbatches: int) -> dict:
    cfg = PGLossConfig(mode="seq_mean", policy_loss="gspo")
    plan = plan_step(batch, cfg, PlanConfig(dp_size=dp, num_microbatches=microbatches, cp_size=cp), cp_rank=0)
    ours, gather, seqs, tokens = [], [], [], []
    for rank in plan.microbatches:
        for mb in rank:
            statistic = mb.seq_numerator_tokens.numel() * FLOAT32  # the all-reduced buffer
            ours.append(2 * (cp - 1) / cp * statistic)
            gather.append((cp - 1) * mb.num_tokens * FLOAT32)  # this rank's log-probs to every peer
            seqs.append(mb.seq_numerator_tokens.numel())
            tokens.append(mb.num_tokens)
    return dict(cp=cp, ours=statistics.mean(ours), gather=statistics.mean(gather),
                sequences=statistics.mean(seqs), local_tokens=statistics.mean(tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--millions", type=int, default=1)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    args = parser.parse_args()
    batch = make_batch(args.millions, args.group)
    print(f"{int(batch.response_lengths.sum())} response tokens, {len(batch)} sequences, "
          f"DP={args.dp} x {args.microbatches} microbatches per rank")
    print("| CP | sequences / microbatch | local tokens / microbatch | ours: all-reduce bytes / rank | "
          "all-gather of log-probs bytes / rank | ratio |")
    print("|---|---|---|---|---|---|")
    for cp in args.cp:
        r = measure(batch, cp, args.dp, args.microbatches)
        print(f"| {cp} | {r['sequences']:.0f} | {r['local_tokens']:.0f} | {r['ours']:.0f} | "
              f"{r['gather']:.0f} | {r['gather'] / r['ours']:.0f}x fewer |")


if __name__ == "__main__":
    main()
