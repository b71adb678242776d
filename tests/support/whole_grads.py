"""The whole, reduced gradient of a step as the single-device model names it, on any DDP setting.

With megatron-core's distributed optimizer each rank's ``main_grad`` is reduced only over its own
shard of every bucket (reduce-scatter); the rest of the buffer holds this rank's unreduced partial
sums. :func:`whole_named_grads` all-gathers each bucket's shards (a copy: the buffers the optimizer
steps on are left alone), concatenates tensor-parallel shards and renames pipeline-local layers
(``parity.models.full_named_tensors``), so a step on any layout can be compared with the float64
reference's autograd gradient by name. Plain DDP: the ``main_grad`` already holds the whole
gradient. Collectives: every rank of the world must call it at the same point."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_pg_agg.parity.models import full_named_tensors


def _reduced_main_grads(chunk) -> dict:
    """``{param: whole reduced gradient}`` of one DDP chunk."""
    sharded = chunk.ddp_config.use_distributed_optimizer
    gathered, out = {}, {}
    for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            if not sharded:
                out[param] = param.main_grad.detach().clone()
                continue
            bucket = buffer.buckets[bucket_id]
            if id(bucket) not in gathered:  # the same bucket order on every rank of its group
                group = chunk.param_to_bucket_group[param].intra_distributed_optimizer_instance_group
                shard = bucket.grad_data.view(group.size(), -1)[group.rank()].contiguous()
                whole = torch.empty_like(bucket.grad_data)
                dist.all_gather_into_tensor(whole, shard, group=group)
                gathered[id(bucket)] = whole
            piece = gathered[id(bucket)][start - bucket.offset:end - bucket.offset]
            out[param] = piece.view(param.shape).clone()
    return out


def whole_named_grads(model: list) -> dict:
    """``{single-device name: float64 gradient}`` of this rank's chunks (TP shards joined)."""
    return _float64(full_named_tensors(model, _reduced_main_grads))


def whole_named_params(model: list) -> dict:
    """``{single-device name: float64 parameter}`` of this rank's chunks (TP shards joined): the
    weights a single-device reference loads to compare a layout's step with."""
    return _float64(full_named_tensors(model, lambda chunk: {p: p.detach().clone() for p in chunk.module.parameters()}))


def _float64(tensors: dict) -> dict:
    return {name: t.double() for name, t in tensors.items()}
