"""Memory the exact aggregation adds: bytes per token it stores, and the peak of the loss path.

    python benchmarks/bench_memory.py            # T = 8M tokens

1. Stored per token by the planner beyond what a PPO loss already needs (tokens, labels, positions,
   loss mask, advantages, old log-probs): the step's TokenWeights (coef float32 + count int32),
   the numerator mask (only with filtering; otherwise it is the loss mask itself), and padding
   (reported as its share of tokens for the step of bench_planner at several pad multiples).
2. Peak of the loss path at T tokens: forward + backward from per-token log-probs to the loss sum,
   megatron_pg_agg's ``pg_loss_sum`` (every mode, report included) against a bare PPO token-mean
   loss ``where(mask, pg, 0).sum() / count`` on the same inputs; extra peak resident memory
   measured in a fresh process per cell (benchmarks/_peak.py).
Goal: at most 8 extra bytes per token beyond the per-token tensors a PPO loss needs.
"""
from __future__ import annotations

import argparse
import json

import torch
from _peak import extra_peak_bytes, in_child

from megatron_pg_agg.core.modes import MODES


def _inputs(tokens: int, mode: str):
    from megatron_pg_agg import token_weights

    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.randn(tokens // 250 + 1, generator=g) * 0.8 + 5.2).round().clamp(32, 4096).long()
    lengths = lengths[: int((lengths.cumsum(0) <= tokens).sum())]
    lengths = torch.cat([lengths, torch.tensor([tokens - int(lengths.sum())])])
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    den = torch.rand(tokens, generator=g) > 0.1
    groups = [8] * (lengths.numel() // 8) + ([lengths.numel() % 8] if lengths.numel() % 8 else [])
    kw = {"divisor": 2048.0} if mode == "constant" else {}
    weights = token_weights(den, mode=mode, cu_seqlens=cu, denominator_mask=den,
                            group_sizes=groups if mode == "prompt_mean" else None, **kw)
    return {
        "logprobs": -torch.rand(tokens, generator=g) * 5,
        "old": -torch.rand(tokens, generator=g) * 5,
        "adv": torch.randn(tokens, generator=g),
        "den": den,
        "weights": weights,
    }


def loss_peak(kind: str, mode: str, tokens: int) -> int:
    from megatron_pg_agg.core.losses import LossPart, PGLossConfig, StepTotals, pg_loss_sum, ppo_token_losses

    x = _inputs(tokens, mode)
    cfg = PGLossConfig(mode=mode, divisor=2048.0 if mode == "constant" else None, report_entropy=False)
    totals = StepTotals(pg_weight=int(x["weights"].count.sum()), valid_tokens=int(x["den"].sum()))

    def run():
        leaf = x["logprobs"].clone().requires_grad_(True)
        if kind == "bare":
            pg, _, _ = ppo_token_losses(leaf, x["old"], x["adv"], cfg)
            loss = torch.where(x["den"], pg, 0.0).sum() / x["den"].sum()
        else:
            part = LossPart(old_logprobs=x["old"], advantages=x["adv"], numerator_mask=x["den"],
                            denominator_mask=x["den"], token_weights=x["weights"])
            loss, _, _ = pg_loss_sum(leaf, part, totals, cfg)
        loss.backward()

    return extra_peak_bytes(run)


def padding_share():
    """Padding as a share of real tokens for bench_planner's 1M-token step, by pad multiple."""
    from bench_planner import make_batch

    batch = make_batch(1, 8)
    length = batch.prompt_lengths + batch.response_lengths
    out = {}
    for multiple in (1, 2, 4, 8, 16):
        padded = (length + multiple - 1) // multiple * multiple
        out[multiple] = float(padded.sum() / length.sum() - 1)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8_000_000)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from megatron_pg_agg import token_weights

    w = token_weights(torch.ones(16, dtype=torch.bool), mode="seq_mean", cu_seqlens=torch.tensor([0, 16]))
    stored = w.coef.element_size() + w.count.element_size()
    rows = {"stored_bytes_per_token": {"coef": w.coef.element_size(), "count": w.count.element_size(),
                                       "numerator_mask_only_with_filtering": 1},
            "padding_share_by_multiple": padding_share(), "peak": {}}
    print(f"stored per token: coef {w.coef.element_size()} B + count {w.count.element_size()} B = {stored} B "
          f"(+1 B numerator mask only when tokens are filtered)")
    for multiple, share in rows["padding_share_by_multiple"].items():
        print(f"padding at a multiple of {multiple:>2}: {100 * share:.2f}% extra tokens")
    bare = in_child("bench_memory", "loss_peak", "bare", "token_mean", args.tokens)
    print("\n| mode | loss-path peak, MiB (ours / bare PPO token mean) | extra bytes per token |")
    print("|---|---|---|")
    for mode in MODES:
        ours = in_child("bench_memory", "loss_peak", "ours", mode, args.tokens)
        extra = (ours - bare) / args.tokens
        rows["peak"][mode] = {"ours_bytes": ours, "bare_bytes": bare, "extra_bytes_per_token": extra}
        print(f"| {mode} | {ours / 2**20:.0f} / {bare / 2**20:.0f} | {extra:+.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
