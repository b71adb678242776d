"""Unfused RoPE on a packed (THD) micro-batch, forward + backward per call: megatron-core 0.19's
``_apply_rotary_pos_emb_thd`` (one autograd chain per packed sequence) against the ``rope_thd`` patch
(patches/rope_thd.py: positions gathered once, RoPE applied once), at 8, 64 and 512 sequences per
micro-batch, CP 1 and CP 2 (rank 0). Ragged lengths (seeded, uniform in ``[min, max]``, padded to
``2 * CP`` under CP), ``freqs`` of the longest sequence, fp32 on the CPU. Repetitions interleave
the two variants; the table gives medians and upstream / patched. Needs megatron-core 0.19.

    python benchmarks/bench_rope_thd.py [--seqs 8 64 512] [--cp 1 2] [--heads 4] [--head-dim 32] [--reps 9]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from megatron_pg_agg.patches import _machinery, rope_thd


class CpGroup:
    """What the function reads of its CP group: size and rank (it communicates nothing)."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def packed_batch(seqs: int, cp: int, heads: int, head_dim: int, lengths: tuple, seed: int = 0):
    """``(t, cu_seqlens, freqs)`` of one micro-batch: ``t`` holds this CP rank's rows."""
    rng = random.Random(seed)
    pad = 2 * cp if cp > 1 else 1
    lens = [-(-rng.randint(*lengths) // pad) * pad for _ in range(seqs)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(int(cu[-1]) // cp, heads, head_dim)
    freqs = torch.rand(max(lens), 1, 1, head_dim) * 6
    return t, cu, freqs


def one_call(fn, t, cu, freqs, group) -> float:
    """Seconds of one forward + backward."""
    x = t.clone().requires_grad_()
    start = time.perf_counter()
    fn(x, cu, freqs, cp_group=group).sum().backward()
    return time.perf_counter() - start


def measure(fns: dict, batch, group, reps: int) -> dict:
    for fn in fns.values():  # warm-up
        one_call(fn, *batch, group)
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(one_call(fn, *batch, group))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs=2, default=[8, 56], metavar=("MIN", "MAX"))
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a shared host)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from megatron.core.models.common.embeddings import rope_utils

    _machinery.revert(rope_thd.NAME)
    upstream = rope_utils._apply_rotary_pos_emb_thd
    _machinery.apply(rope_thd.PATCH)  # refuses (says why) outside megatron-core 0.19
    fns = {"upstream": upstream, "patched": rope_utils._apply_rotary_pos_emb_thd}
    print(f"megatron-core {rope_thd.installed_megatron_core_version()}, torch {torch.__version__}, "
          f"{args.threads} thread(s), heads={args.heads}, head_dim={args.head_dim}, lengths {args.lengths}")
    print("| CP | sequences / micro-batch | local tokens | upstream (ms) | patched (ms) | upstream / patched |")
    print("|---|---|---|---|---|---|")
    for cp in args.cp:
        for seqs in args.seqs:
            batch = packed_batch(seqs, cp, args.heads, args.head_dim, tuple(args.lengths))
            ms = {k: v * 1e3 for k, v in measure(fns, batch, CpGroup(cp, 0), args.reps).items()}
            print(f"| {cp} | {seqs} | {batch[0].size(0)} | {ms['upstream']:.2f} | {ms['patched']:.2f} | "
                  f"{ms['upstream'] / ms['patched']:.1f}x |", flush=True)
    _machinery.revert(rope_thd.NAME)


if __name__ == "__main__":
    main()
