"""Multi-token prediction's roll under context parallelism, on 2 gloo ranks (CP=2):

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        -m tests.distributed.workers.mtp_cp_roll_worker OUT.json

Each CP rank holds, of every packed sequence, its padded chunks ``r`` and ``2 * CP - 1 - r``
(the planner's layout, what Transformer Engine's THD attention expects). The labels and the
denominator mask of the fixed ragged step are rolled with megatron-core's own ``roll_tensor`` on
the CP group, under the mtp_loss patch and as released. The reference is written here: both
ranks' shards gathered back into whole padded sequences (their tokens checked against the
rollouts), each sequence shifted left by one within its padded slot in Python (its last position
0), then cut into the same chunks. Rank 0 writes, per variant, whether this rank's shard equals
the reference and the rolled mask's count summed over the CP ranks.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out_path = sys.argv[1]
    from megatron.core import parallel_state

    from megatron_pg_agg.core.losses import PGLossConfig
    from megatron_pg_agg.data.planner import PlanConfig, plan_step
    from megatron_pg_agg.megatron.layout import ParallelSizes
    from megatron_pg_agg.megatron.loss_func import packed_seq_params
    from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel
    from megatron_pg_agg.patches import apply_megatron_patches, revert_megatron_patches
    from tests.support.rollouts import fixed_step

    apply_megatron_patches(cpu_gloo=True, mtp_loss=True)
    init_distributed()
    init_parallel(ParallelSizes(cp=2))
    import megatron.core.transformer.multi_token_prediction as mtp_module

    cp_group = parallel_state.get_context_parallel_group()
    rank, size = parallel_state.get_context_parallel_rank(), 2
    rollouts = fixed_step()
    plan = plan_step(rollouts, PGLossConfig(), PlanConfig(dp_size=1, num_microbatches=1, cp_size=size), cp_rank=rank)
    (mb,) = plan.for_rank(0)
    padded = mb.cu_seqlens_padded.tolist()
    real = mb.cu_seqlens.tolist()

    def whole(local: torch.Tensor) -> list:
        """Both ranks' shards of a [T / 2] tensor back into the padded run, per sequence."""
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=cp_group)
        seqs = []
        for i in range(len(padded) - 1):
            length = padded[i + 1] - padded[i]
            chunk, start = length // (2 * size), padded[i] // size
            pieces = [None] * (2 * size)
            for r, part in enumerate(parts):
                own = part[start:start + length // size]
                pieces[r], pieces[2 * size - 1 - r] = own[:chunk], own[chunk:]
            seqs.append(torch.cat(pieces))
        return seqs

    def shard(seqs: list) -> torch.Tensor:
        out = []
        for seq in seqs:
            chunk = len(seq) // (2 * size)
            out += [seq[rank * chunk:(rank + 1) * chunk], seq[(2 * size - 1 - rank) * chunk:(2 * size - rank) * chunk]]
        return torch.cat(out)

    # the gathered tokens are the rollouts' (prompt, response, then padding 0): the layout is as assumed
    order = [rollouts[i] for i in mb.sequence_ids]
    tokens_ok = all(seq.tolist() == list(r.prompt_ids) + list(r.response_ids) + [0] * (len(seq) - len(r.prompt_ids)
                                                                                      - len(r.response_ids))
                    for seq, r in zip(whole(mb.tokens[0]), order))
    params = packed_seq_params(mb)
    result = {"tokens_ok": tokens_ok, "padding": real != padded}
    for variant in ("patched", "released"):
        if variant == "released":
            revert_megatron_patches()
            apply_megatron_patches(cpu_gloo=True)
        agree, count = True, 0.0
        for name, local in (("labels", mb.labels[0].float()), ("mask", mb.denominator_mask.float())):
            reference = shard([torch.cat([seq[1:], seq.new_zeros(1)]) for seq in whole(local)])
            rolled, total = mtp_module.roll_tensor(local[None], shifts=-1, dims=-1, cp_group=cp_group,
                                                   packed_seq_params=params)
            agree &= bool(torch.equal(rolled[0], reference))
            if name == "mask":
                summed = total.reshape(1).double()
                dist.all_reduce(summed, group=cp_group)
                count = float(summed)
                expected = torch.tensor([float(reference.sum())], dtype=torch.float64)
                dist.all_reduce(expected, group=cp_group)
                result[f"{variant}_expected_count"] = float(expected)
        agreed = torch.tensor([int(agree)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=cp_group)
        result[variant] = {"agree": bool(agreed), "count": count}
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
