"""The distributed optimizer's parameter layout handed to DDP (megatron-core 0.18 on) against the
one DDP computes itself without it, on the installed release's real GPTModel and DDP (one gloo
rank): the same buffers (keys, parameters by name, index ranges, buckets), and no "full_param_layout
not provided" warning. Catches a layout built from other inputs than DDP's (bucket size, a chunk
after the first, the shard count), which would move parameters between buckets or shards."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel

from megatron_pg_agg.megatron.layout import ParallelSizes
from megatron_pg_agg.megatron.model import _ddp_parameters, build_model_chunks, default_ddp_config, wrap_in_ddp
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel
from megatron_pg_agg.parity.models import tiny_transformer_config
from megatron_pg_agg.patches import apply_megatron_patches, revert_megatron_patches
from tests.support.rollouts import VOCAB

pytestmark = pytest.mark.skipif("full_param_layout" not in _ddp_parameters(),
                                reason="this release's DDP takes no full_param_layout (before 0.18)")
WARNING = "full_param_layout not provided"


@pytest.fixture(scope="module")
def parallel():
    revert_megatron_patches()
    apply_megatron_patches(cpu_gloo=True)
    owns_group = not dist.is_initialized()
    init_distributed()
    init_parallel(ParallelSizes(), seed=5)
    yield
    teardown_parallel()
    if owns_group:
        dist.destroy_process_group()
    revert_megatron_patches()
    apply_megatron_patches()


def _by_name(ddp: DistributedDataParallel) -> dict:
    """``{buffer key: (parameter name -> (start, end, bucket), bucket boundaries, unpadded bucket
    sizes, param_indices, shards)}``."""
    names = {p: n for n, p in ddp.module.named_parameters()}
    return {key: ({names[p]: tuple(r) for p, r in layout.param_index_map.items()},
                  [tuple(b) for b in layout.bucket_indices], list(layout.per_bucket_numel_unpadded),
                  list(layout.param_indices), getattr(layout, "num_optimizer_shards", None))  # 0.19 on
            for key, layout in ddp.full_param_layout.layouts.items()}


@pytest.mark.parametrize("overlap, bucket_size", [(True, 4000), (True, None), (False, 4000)],
                         ids=["overlap-small-buckets", "overlap-default-bucket", "no-overlap"])
def test_the_layout_handed_to_ddp_is_the_one_ddp_computes_itself(parallel, caplog, overlap, bucket_size):
    config = tiny_transformer_config(num_layers=2, calculate_per_token_loss=True)

    def ddp_config():
        return default_ddp_config(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                                  bucket_size=bucket_size)

    torch.manual_seed(5)
    chunks = build_model_chunks(config, VOCAB, 64, share_embeddings_and_output_weights=False)
    with caplog.at_level(logging.WARNING):
        (given,) = wrap_in_ddp(chunks, config, ddp_config())
    assert WARNING not in caplog.text
    torch.manual_seed(5)
    (chunk,) = build_model_chunks(config, VOCAB, 64, share_embeddings_and_output_weights=False)
    with caplog.at_level(logging.WARNING):
        computed = DistributedDataParallel(config=config, ddp_config=ddp_config(), module=chunk)
    assert WARNING in caplog.text  # the control: without a layout this release warns and computes its own
    assert _by_name(given) == _by_name(computed)
    assert len(next(iter(_by_name(given).values()))[1]) > (1 if overlap and bucket_size else 0)
