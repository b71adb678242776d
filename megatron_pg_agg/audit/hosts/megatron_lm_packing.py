"""Megatron-LM's sequence packing (``--rl-use-sequence-packing``) for the audit of its RL loop: the bins, the
DP ranks that get them and the bins of each optimizer step, all made by megatron/rl/sequence_packing_utils.py
(core_v0.19) itself, and per bin the RL loop's own loss.

What decides the bins (``rl_utils.prepare_data_for_update`` at core_v0.19.0, ~1585-1790; there is no bin-size
flag in core_v0.19.0): the whole collection, padded with empty rows to a multiple of DP x micro-batch size and
gathered from every rank (``pack_all_trajectories``), packed by ``SequencePacker(bin_size=--seq-length, the
tokenizer's pad, --rl-sequence-packing-max-sequences-per-bin)``: longest first, each sequence into the current
bin while the bin's tokens and count allow, else into a new one. ``distribute_packed_bins`` hands the bins to
the ranks (``--rl-sequence-packing-algo`` fifo: contiguous, round-robin: cyclic) and fills each rank up to the
same count with empty bins. ``update_microbatch_calculator`` makes a step ``ceil(global batch / collection x
the rank's bins)`` bins of each rank, ``get_microbatch_dataloader`` one bin a micro-batch, iterated cyclically
(``itertools.cycle``) from step to step. Megatron-LM asserts ``--micro-batch-size 1`` with packing (under
``--perform-rl-step``): the packed splits take micro-batches of one bin whatever the flag says.

Per bin, as train_rl.forward_step with packing: ``rl_utils.calculate_grpo_loss`` with the bin's sequence starts
and lengths (each sequence's advantage over its tokens), ``train_rl.loss_func`` on the packer's loss mask (an
empty bin counting 1 token) and megatron-core's ``forward_step_calc_loss`` (:func:`.megatron_lm_common.reduced`).

The synthetic batch holds responses only: each row becomes a trajectory as ``prepare_trajectories`` lays it
out, a prompt of ``--seq-length / PROMPT_PART`` tokens (outside the generation mask) then the response (the
row's loss mask as its generation mask), padded with the pad token to ``--seq-length``; a response token's
log-prob sits one position before the token in the bin (log-probs predict the next token).

Megatron-LM's packing reads the DP rank and size from megatron.core's parallel_state (``mpu``) and the pad
token from its tokenizer (``get_tokenizer``), set up by a distributed run: :func:`_as_rank` gives it, for one
call per DP rank in turn, a stand-in of both in sequence_packing_utils' namespace only, restored after the call.
"""
from __future__ import annotations

import itertools
import logging
import types
from contextlib import contextmanager
from functools import partial

import torch

from megatron_pg_agg.audit.hosts.megatron_lm_common import PAD, reduced
from megatron_pg_agg.audit.measure import Split, SplitRefused

__all__ = ["PROMPT_PART", "packed_splits", "stock"]

PROMPT_PART = 8
"""A row's prompt is ``--seq-length // 8`` tokens: the batch's responses are at most half of it, so at the
configured bin size two to five sequences share a bin (a prompt of the other half would leave each alone)."""
PAD_TOKEN, TOKEN = 0, 1
"""The stand-in tokenizer's pad, and the token every prompt and response position holds (the packer reads
only where the pad starts)."""


def packed_splits(args, dp: int) -> list:
    """The configured bin size (``--seq-length``), half and twice it, at DP ``dp`` and 1: one bin a micro-batch."""
    found = []
    for d in dict.fromkeys([dp, 1]):
        for size in (args.seq_length, args.seq_length // 2, 2 * args.seq_length):
            found.append(Split(f"bins of {size} tokens, DP {d}", {"bin_size": size, "dp": d, "micro_batch_size": 1,
                                                                   "global_batch_size": args.global_batch_size}))
    return found


@contextmanager
def _as_rank(spu, rank: int, dp: int):
    """sequence_packing_utils' ``mpu`` and ``get_tokenizer`` as DP rank ``rank`` of ``dp`` sees them."""
    saved = spu.mpu, spu.get_tokenizer
    spu.mpu = types.SimpleNamespace(get_data_parallel_rank=lambda: rank, get_data_parallel_world_size=lambda: dp)
    spu.get_tokenizer = lambda: types.SimpleNamespace(pad=PAD_TOKEN)
    try:
        yield
    finally:
        spu.mpu, spu.get_tokenizer = saved


def _trajectories(batch, rows: list, seq_length: int) -> tuple:
    """``(trajs [rows, seq_length], generation masks)`` of ``rows`` (PAD: all pad, nothing generated)."""
    prompt = max(1, seq_length // PROMPT_PART)
    trajs = torch.full((len(rows), seq_length), PAD_TOKEN, dtype=torch.long)
    generated = torch.zeros((len(rows), seq_length), dtype=torch.bool)
    for j, i in enumerate(rows):
        if i != PAD:
            trajs[j, :prompt + batch.lengths[i]] = TOKEN
            generated[j, prompt:prompt + batch.lengths[i]] = batch.masks[i]
    return trajs, generated


def _bins_per_step(spu, ratio: float, mine, args, dp: int) -> int:
    """``update_microbatch_calculator``'s micro-batches (bins) of a rank's step."""
    from megatron.core import num_microbatches_calculator as calculator  # noqa: PLC0415

    calculator.destroy_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(0, None, args.global_batch_size, 1, dp,
                                                args.decrease_batch_size_if_needed)
    try:
        spu.update_microbatch_calculator(ratio, len(mine.bin_seq_indices), mine.bin_seq_indices,
                                         args.global_batch_size, 1, args.decrease_batch_size_if_needed)
        return calculator.get_num_microbatches()
    finally:
        calculator.destroy_num_microbatches_calculator()


@contextmanager
def _quiet():
    """The packer's and the calculator's INFO lines, one set per split and rank, kept out of the report."""
    loggers = [logging.getLogger(name) for name in ("megatron.rl.sequence_packing_utils",
                                                    "megatron.core.num_microbatches_calculator")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _packed(batch, args, dp: int, size: int) -> tuple:
    """``(rows, steps)``: ``rows[s]`` the row of sequence ``s``; ``steps[k][rank]`` = ``(loss mask, PackingInfo,
    bin index)`` of each of the rank's micro-batches in step ``k``."""
    from megatron.rl import sequence_packing_utils as spu  # noqa: PLC0415

    rows = list(range(batch.rows)) + [PAD] * (-batch.rows % dp)  # prepare_data_for_update's padding, micro-batch 1
    trajs, generated = _trajectories(batch, rows, args.seq_length)
    packer = spu.SequencePacker(size, PAD_TOKEN, args.rl_sequence_packing_max_sequences_per_bin)
    try:
        packed, positions, mask, info = packer.pack_sequences(trajs, generated)
    except RuntimeError:  # its copy of a trajectory into a shorter bin
        longest = max(batch.lengths) + max(1, args.seq_length // PROMPT_PART)
        raise SplitRefused(f"a trajectory of {longest} tokens is longer than the bin: Megatron-LM's SequencePacker "
                           "cannot place it") from None
    info.packing_algo = args.rl_sequence_packing_algo
    ratio = args.global_batch_size / batch.rows  # prepare_data_for_update's samples_ratio_per_step
    count = max(1, batch.rows // args.global_batch_size)
    steps = [[] for _ in range(count)]
    for rank in range(dp):
        with _as_rank(spu, rank, dp):
            _, _, mine_mask, mine = spu.distribute_packed_bins(packed, positions, mask, info)
            per_step = _bins_per_step(spu, ratio, mine, args, dp)
        loader = itertools.cycle(spu.get_microbatch_dataloader(len(mine_mask), 1))
        for step in steps:
            step.append([(mine_mask, mine, int(next(loader)[0])) for _ in range(per_step)])
    return rows, steps


def _placed(values: list, where: list, width: int, dtype) -> torch.Tensor:
    out = torch.zeros(width, dtype=dtype)
    if where:
        out = out.index_put((torch.cat(where),), torch.cat(values).to(dtype))
    return out.unsqueeze(0)


def _bin_loss(rl_utils, args, batch, leaves: list, rows: list, info, b: int, width: int) -> tuple:
    """``(per-token loss [1, width] and calculate_grpo_loss' other outputs, the bin's rows)`` of bin ``b``."""
    prompt = max(1, args.seq_length // PROMPT_PART)
    starts, seqs = info.seq_starts[b], info.bin_seq_indices[b]
    where, current, old, ref, members = [], [], [], [], []
    for start, s in zip(starts, seqs):
        if rows[s] != PAD:
            i = rows[s]
            where.append(torch.arange(start + prompt - 1, start + prompt - 1 + batch.lengths[i]))
            current.append(leaves[i])
            old.append(batch.old_logprobs[i])
            ref.append(batch.ref_logprobs[i])
            members.append(i)
    advantages = torch.stack([batch.advantages[rows[s]] if rows[s] != PAD else torch.zeros(()) for s in seqs]
                             ) if seqs else torch.zeros(0)
    out = rl_utils.calculate_grpo_loss(
        _placed(current, where, width, torch.float32), _placed(old, where, width, torch.float32),
        _placed(ref, where, width, torch.float32), advantages.float(), clamp_eps_lower=args.grpo_clamp_eps_lower,
        clamp_eps_upper=args.grpo_clamp_eps_upper, kl_beta=args.grpo_kl_beta,
        entropy_weight=args.grpo_entropy_term_weight, seq_starts=starts,
        seq_lengths=[info.seq_lengths[s] for s in seqs])
    return out, members


def stock(modules: tuple, args, batch, split: Split, leaves: list) -> tuple:
    """Megatron-LM's ``(J per step, rows per step)`` with sequence packing at ``split``'s bin size and DP size."""
    from megatron_pg_agg.patches.cpu.cpu_torch import _TensorCudaIsIdentity  # noqa: PLC0415

    train_rl, rl_utils, schedules = modules
    dp, size = split.settings["dp"], split.settings["bin_size"]
    with _quiet():
        rows, steps = _packed(batch, args, dp, size)
    objectives, members = [], []
    for step in steps:
        losses, counts, mine = [], [], []
        for rank in step:
            for mask, info, b in rank:
                (loss, kl, ratios, entropy, above, below), in_bin = _bin_loss(rl_utils, args, batch, leaves, rows,
                                                                              info, b, size - 1)
                func = partial(train_rl.loss_func, mask[b:b + 1, 1:], kl, ratios, entropy, above, below)
                with _TensorCudaIsIdentity():  # loss_func moves its inputs with .cuda()
                    out, count = reduced(schedules, func, loss, args.calculate_per_token_loss, len(rank))
                losses.append(out)
                counts.append(count)
                mine.extend(in_bin)
        total = torch.stack(losses).sum()
        objectives.append(total / torch.stack(counts).sum() if args.calculate_per_token_loss else total / dp)
        members.append(list(dict.fromkeys(mine)))
    return objectives, members


def formula(args) -> str:
    """The packed splits' line of the stock formula."""
    return (". With --rl-use-sequence-packing (the 'bins' splits) the micro-batches are bins, built by Megatron-LM's "
            f"SequencePacker over the whole collection (bins of --seq-length {args.seq_length} tokens, at most "
            f"{args.rl_sequence_packing_max_sequences_per_bin} sequences, longest first) and distribute_packed_bins "
            f"({args.rl_sequence_packing_algo}; each DP rank filled with empty bins to the same count): a step is "
            "ceil(--global-batch-size / collection x the rank's bins) bins of each rank, one bin a micro-batch "
            "(without --calculate-per-token-loss: 1/that per bin, 1/DP per rank); the 'no packing' splits split by "
            "rows")
