"""Smoke worker: megatron-core's real schedules + DDP + finalize_model_grads on CPU/gloo.

Run with ``torchrun --standalone --nproc_per_node 4 -m tests.distributed.workers.smoke_worker``. For each
layout (TP2xPP2, DP2xPP2, DP4, PP2 interleaved with 2 virtual stages, DP2) it builds the tiny
GPT, wraps it in megatron DDP, runs the schedule (``megatron.loss_func.run_schedule``) on 2 packed THD micro-batches
with the per-token 3-tuple loss contract and checks that every gradient is finite and that some
are non-zero. It proves the schedule runs; exact parity is checked elsewhere.
"""
from __future__ import annotations

import faulthandler
import sys
import time

import torch
import torch.distributed as dist

from megatron_pg_agg.patches import apply_megatron_patches

apply_megatron_patches()  # before any model is built

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402

from megatron_pg_agg.megatron.layout import ParallelSizes  # noqa: E402
from megatron_pg_agg.megatron.loss_func import run_schedule  # noqa: E402
from megatron_pg_agg.megatron.model import build_model_chunks, wrap_in_ddp  # noqa: E402
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel  # noqa: E402
from megatron_pg_agg.parity.models import tiny_transformer_config  # noqa: E402
from tests.support.thd_packing import next_token_targets, pack_sequences  # noqa: E402

VOCAB = 64
MAX_SEQ_LEN = 64
NUM_MICROBATCHES = 2
HANG_DUMP_S = 75  # below the pytest launcher timeout
FIXED_LENGTH = 24
# (tp, pp, vpp); data parallel takes the rest of the 4 ranks
LAYOUTS = [(2, 2, None), (1, 2, None), (1, 1, None), (1, 2, 2)]


def microbatches(dp_rank: int, pad_to_length=None) -> list[dict]:
    """Packed THD micro-batches; sequence lengths differ per micro-batch and per DP rank, and so
    do the pack lengths unless ``pad_to_length`` fixes them."""
    out = []
    for mb in range(NUM_MICROBATCHES):
        g = torch.Generator().manual_seed(1000 * dp_rank + mb)
        lengths = (3 + mb + dp_rank, 6, 2 + 2 * mb)
        seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
        batch = pack_sequences(seqs, pad_to_length=pad_to_length)
        labels, loss_mask = next_token_targets(batch)
        out.append(dict(batch=batch, labels=labels, loss_mask=loss_mask))
    return out


def forward_step(data_iterator, model):
    item = next(data_iterator)
    batch = item["batch"]
    output = model(batch.tokens, batch.position_ids, None, labels=item["labels"],
                   packed_seq_params=batch.packed_seq_params)
    mask = item["loss_mask"]

    def loss_func(per_token_loss):
        loss = torch.where(mask > 0, per_token_loss, 0.0).sum()
        return loss, mask.sum().to(torch.int32), {}

    return output, loss_func


def run_layout(tp: int, pp: int, vpp) -> str:
    layout = init_parallel(ParallelSizes(tp=tp, pp=pp, vpp=vpp))
    # variable pack lengths, except in the interleaved schedule, whose shape exchange deadlocks
    # on gloo (see patches/cpu/cpu_gloo.py): fixed-length packs there
    fixed = vpp is not None
    config = tiny_transformer_config(**layout.config_kwargs(), variable_seq_lengths=not fixed)
    model = wrap_in_ddp(build_model_chunks(config, VOCAB, MAX_SEQ_LEN), config)
    config.finalize_model_grads_func = finalize_model_grads
    assert config.calculate_per_token_loss
    for chunk in model:
        chunk.zero_grad_buffer()

    data = microbatches(parallel_state.get_data_parallel_rank(), FIXED_LENGTH if fixed else None)
    assert len(data) == NUM_MICROBATCHES
    seq_length = max(d["batch"].tokens.size(1) for d in data)
    t0 = time.perf_counter()
    # every virtual stage walks the same micro-batches
    losses = run_schedule(model, data, forward_step, seq_length=seq_length)
    elapsed = time.perf_counter() - t0

    grads = [p.main_grad for chunk in model for p in chunk.parameters() if p.requires_grad]
    assert grads, f"{layout}: no parameters"
    for g in grads:
        assert torch.isfinite(g).all(), f"{layout}: non-finite gradient"
    assert any(g.abs().sum() > 0 for g in grads), f"{layout}: all gradients are zero"
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        assert len(losses) == NUM_MICROBATCHES, f"{layout}: {len(losses)} loss reports"
    teardown_parallel()
    return f"{layout} ok ({elapsed:.2f}s)"


def parse_layouts(argv: list[str]) -> list[tuple]:
    """``tp,pp[,vpp]`` per argument (for debugging one layout); default :data:`LAYOUTS`."""
    layouts = []
    for arg in argv:
        tp, pp, *vpp = (int(x) for x in arg.split(","))
        layouts.append((tp, pp, vpp[0] if vpp else None))
    return layouts or LAYOUTS


def main() -> int:
    faulthandler.dump_traceback_later(HANG_DUMP_S, exit=True)  # a hang prints every stack
    init_distributed()
    layouts = parse_layouts(sys.argv[1:])
    for tp, pp, vpp in layouts:
        msg = run_layout(tp, pp, vpp)
        dist.barrier()
        if dist.get_rank() == 0:
            print(msg, flush=True)
    if dist.get_rank() == 0:
        print("SMOKE OK", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
