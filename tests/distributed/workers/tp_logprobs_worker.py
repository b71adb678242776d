"""TP worker for tests/distributed/test_tp_losses.py: ``vocab_parallel_logprobs`` on vocab-sharded logits.

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.workers.tp_logprobs_worker OUT.json

Every rank builds the same random logits ``[B, T, V]`` (fixed seed), keeps its contiguous
vocabulary shard (Megatron's layout), and computes log-probs of global target ids (each target
lying in one rank's shard only) with and without the entropy, then back-propagates a random
linear combination of them. The unsharded reference is plain float64 ``log_softmax`` and
``-sum p log p`` on the whole vocabulary, differentiated by autograd. Rank 0 writes, per case,
the largest absolute error of the values and of this shard's logit gradient over all ranks,
and the largest difference between the ranks' values (Megatron needs every TP rank to hold the
same loss). No megatron-core: only torch.distributed (gloo) and the function under test.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from megatron_pg_agg.core.losses import vocab_parallel_logprobs


def reference(logits: torch.Tensor, target: torch.Tensor, a: torch.Tensor, b: torch.Tensor, with_entropy: bool):
    x = logits.double().detach().requires_grad_(True)
    logp_all = torch.log_softmax(x, dim=-1)
    logp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    loss = (a * logp).sum() + ((b * entropy).sum() if with_entropy else 0.0)
    loss.backward()
    return logp.detach(), entropy.detach(), x.grad


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    batch, tokens, vocab = 2, 7, 12 * world
    shard = vocab // world
    # large spread: the max shift, the normaliser and exp() all matter; one row peaks in each shard
    logits = torch.randn(batch, tokens, vocab, generator=gen) * 4.0
    logits[0, 0, 1] += 30.0
    logits[0, 1, vocab - 2] += 30.0
    target = torch.randint(0, vocab, (batch, tokens), generator=gen)
    target[0, :world] = torch.arange(world) * shard  # first id of every shard
    target[1, :world] = torch.arange(1, world + 1) * shard - 1  # last id of every shard
    a, b = torch.randn(batch, tokens, generator=gen), torch.randn(batch, tokens, generator=gen)
    results = {}
    for with_entropy in (False, True):
        ref_logp, ref_ent, ref_grad = reference(logits, target, a, b, with_entropy)
        local = logits[..., rank * shard:(rank + 1) * shard].clone().requires_grad_(True)
        logp, ent = vocab_parallel_logprobs(local, target, tp_group=dist.group.WORLD, with_entropy=with_entropy)
        loss = (a * logp).sum() + ((b * ent).sum() if with_entropy else 0.0)
        loss.backward()
        errs = torch.tensor([
            float((logp.double() - ref_logp).abs().max()),
            float((ent.double() - ref_ent).abs().max()) if with_entropy else 0.0,
            float((local.grad.double() - ref_grad[..., rank * shard:(rank + 1) * shard]).abs().max()),
            float(ref_grad.abs().max()),
        ], dtype=torch.float64)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
        # every TP rank must return the same values (and hence the same loss)
        mine = torch.cat([logp.detach().double().reshape(-1),
                          ent.detach().double().reshape(-1) if with_entropy else torch.zeros(0, dtype=torch.float64)])
        others = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(others, mine)
        spread = max(float((o - mine).abs().max()) for o in others)
        results["entropy" if with_entropy else "logprobs"] = {
            "logprob_err": float(errs[0]), "entropy_err": float(errs[1]), "grad_err": float(errs[2]),
            "grad_scale": float(errs[3]), "rank_spread": spread, "returned_entropy": ent is not None,
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"world": world, **results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
