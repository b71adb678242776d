"""What the audit's two Megatron-LM loops share (:mod:`.megatron_lm`, the RL loop; :mod:`.megatron_lm_pretrain`,
``pretrain()``): the checkout, Megatron-LM's own parser, the splits, a micro-batch as Megatron's data iterator
yields it, megatron-core's per-micro-batch reduction and the plug-in's token-mean step."""
from __future__ import annotations

import sys
import types
from functools import partial

import torch

from megatron_pg_agg.audit.hosts import HostMissing
from megatron_pg_agg.audit.measure import Split

__all__ = ["PAD", "checkout", "microbatch", "parse", "reduced", "splits", "token_mean_step"]

PAD = -1
"""A padding row (all-masked): ``prepare_data_for_update``'s."""


def parse(argv: list, script: str = "train_rl.py", extra_args_provider=None):
    """Megatron-LM's own parser over ``argv`` (its ``parse_args`` reads ``sys.argv``; ``script`` names
    the program in its messages)."""
    from megatron.training.arguments import parse_args  # noqa: PLC0415

    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        return parse_args(extra_args_provider)
    finally:
        sys.argv = saved


def checkout(argv: list, install: str) -> None:
    """The checkout of ``--megatron-lm`` or ``MEGATRON_LM_PATH`` first on ``sys.path``; missing: one line
    naming ``install``."""
    from megatron_pg_agg.training.megatron_lm import find_checkout, use_checkout  # noqa: PLC0415
    from megatron_pg_agg.training.run_config import StartupError  # noqa: PLC0415

    try:
        use_checkout(find_checkout(argv))
    except StartupError as error:
        raise HostMissing(f"{error}; install {install}") from None


def splits(args, dp: int) -> list:
    """The micro-batch size, half and twice it, at DP ``dp`` and 1, the global batch kept: those whose
    micro-batch size x DP divides it (Megatron-LM refuses the others)."""
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    found = []
    for d in dict.fromkeys([dp, 1]):
        for m in dict.fromkeys([mbs, max(1, mbs // 2), 2 * mbs]):
            if gbs % (d * m) == 0:
                found.append(Split(f"micro-batch {m}, DP {d}", {"micro_batch_size": m, "dp": d,
                                                                "global_batch_size": gbs}))
    return found


def microbatch(batch, rows: list, leaves: list, dtype) -> dict:
    """[mbs, width] tensors of ``rows`` (PAD rows all-masked), as Megatron's data iterator yields them."""
    width = max([batch.lengths[i] for i in rows if i != PAD] + [1])

    def pad(values):
        out = [torch.nn.functional.pad(v.to(dtype), (0, width - v.numel())) for v in values]
        return torch.stack(out)

    def per_row(source, fill):
        return [source[i] if i != PAD else torch.full((1,), fill) for i in rows]

    mask = [batch.masks[i].float() if i != PAD else torch.zeros(1) for i in rows]
    adv = torch.stack([batch.advantages[i] if i != PAD else torch.zeros(()) for i in rows]).to(dtype)
    return {"current": pad(per_row(leaves, 0.0)), "old": pad(per_row(batch.old_logprobs, 0.0)),
            "ref": pad(per_row(batch.ref_logprobs, 0.0)), "mask": pad(mask), "advantages": adv}


def reduced(schedules, loss_func, output, per_token: bool, num_microbatches: int) -> tuple:
    """megatron-core's ``forward_step_calc_loss`` on one micro-batch's loss function."""
    config = types.SimpleNamespace(calculate_per_token_loss=per_token, timers=None)
    return schedules.forward_step_calc_loss(None, output, loss_func, config, None, False, num_microbatches, [],
                                            cp_group_size=1, is_last_stage=True)


def token_mean_step(schedules, batch, leaves: list, rows: list, micro: list, token_losses) -> torch.Tensor:
    """The plug-in's objective of one step of ``rows``, its micro-batches ``micro[rank]`` (row lists): the
    token weights of token_mean over the step (``token_weights``), each micro-batch's ``(sum_t c_t l_t,
    sum_t k_t)`` through megatron-core's per-token reduction, ``l_t = token_losses(micro-batch)`` in float64."""
    from megatron_pg_agg.core.aggregation import token_weights  # noqa: PLC0415

    mask = torch.cat([batch.masks[i] for i in rows])
    cu = torch.tensor([0] + [batch.lengths[i] for i in rows]).cumsum(0)
    weights = token_weights(mask, mode="token_mean", cu_seqlens=cu)
    offset = dict(zip(rows, cu[:-1].tolist()))
    losses, counts = [], []
    for rank in micro:
        for mb_rows in rank:
            mb = microbatch(batch, mb_rows, leaves, torch.float64)
            loss = token_losses(mb)
            coef = torch.zeros_like(loss)
            count = torch.zeros((), dtype=torch.int64)
            for j, i in enumerate(mb_rows):
                w = weights[int(offset[i]):int(offset[i]) + batch.lengths[i]]
                coef[j, :batch.lengths[i]] = w.coef.double()
                count = count + w.count.sum()
            out, n = reduced(schedules, partial(_weighted, coef, count), loss, True, len(rank))
            losses.append(out)
            counts.append(n)
    return torch.stack(losses).sum() / torch.stack(counts).sum()


def _weighted(coef, count, losses):
    """The plug-in's loss function: ``(sum_t c_t l_t, sum_t k_t, report)`` (the token form)."""
    return (coef * losses).sum(), count, {}
