"""Megatron-LM's ``pretrain()`` (pretrain_gpt.py, core_v0.15 to core_v0.19) for the audit: the
megatron-lm host's loop when the command line starts with ``pretrain_gpt.py`` or ``--loop pretrain``
is given (:mod:`megatron_pg_agg.audit.hosts.megatron_lm`).

Config: Megatron-LM's own ``parse_args`` over the command line, with pretrain_gpt.py's
``extra_args_provider`` (its ModelOpt flags where ModelOpt is installed, as its ``__main__`` passes
them); a flag it does not know is refused by its argparse (``pretrain_gpt.py: error: unrecognized
arguments``). No ``--global-batch-size``: micro-batch size x DP, as Megatron-LM's ``validate_args``
sets it. DP from the audit's ``--dp`` (default 2). The collection: one optimizer step of
``--global-batch-size`` samples, each a response of up to ``--seq-length`` tokens (a sample has no
prompt group in pretrain(): group size 1).

Stock loss, all Megatron's code: the micro-batches of each DP rank from Megatron-LM's own
``MegatronPretrainingSampler`` (``--dataloader-type single``, its default: rank ``r`` takes samples
``r x mbs ... (r+1) x mbs - 1`` of every ``mbs x DP`` consecutive ones; ``cyclic`` and ``external``
order the samples otherwise, which the audit does not follow); pretrain_gpt.py's ``loss_func`` on
each (the masked sum and the token count, an all-masked micro-batch counting 0) and megatron-core's
``schedules.forward_step_calc_loss`` (without ``--calculate-per-token-loss``: the sum over
``max(count, 1)``, over the number of micro-batches). Across the step, what megatron-core's DDP and
``finalize_model_grads`` do: the gradients averaged over the DP ranks (a mean of micro-batch token
means), or, with ``--calculate-per-token-loss``, divided by the step's summed count (a token mean).

The per-token loss, ``output_tensor`` in ``loss_func``: whatever the user's model step computes. The
audit hands it the policy-gradient surrogate ``l_t = -A_i exp(logp_t - old_t)`` (no clip, no KL:
release-independent, and ``dJ/dlogp_t = -A_i r_t c_t`` shows the aggregation's coefficient ``c_t``).

Plug-in line: the project's pretrain() entry (launch/pretrain_actor.py, docs/megatron-lm.md) with
``--calculate-per-token-loss --pg-loss-aggregation token_mean``: token weights of the mode over the
step, the same per-token loss, megatron-core's per-token reduction, under the same splits (the entry
itself packs responses into THD micro-batches of ``--seq-length`` tokens; the step's objective is the
same whatever the split).
"""
from __future__ import annotations

import importlib.util
import types
from functools import partial

import torch

from megatron_pg_agg.audit.batch import BatchShape
from megatron_pg_agg.audit.hosts import HostConfig, HostMissing, HostRefusal, without_flags
from megatron_pg_agg.audit.hosts.megatron_lm_common import (
    checkout,
    microbatch,
    parse,
    reduced,
    splits,
    token_mean_step,
)
from megatron_pg_agg.audit.measure import Split

__all__ = ["INSTALL", "LOOP_NAME", "load", "plugin", "stock"]

INSTALL = ("a Megatron-LM checkout core_v0.15.x to core_v0.19.x (--megatron-lm PATH or MEGATRON_LM_PATH) with the "
           "megatron-core of its minor release and pip install 'megatron_pg_agg[megatron-lm]'")
LOOP_NAME = "pretrain() (pretrain_gpt.py)"
"""The value of the settings' ``loop`` key (what the megatron-lm host dispatches on)."""


def _triton_stand_in() -> None:
    """Megatron-LM's training side imports triton through megatron-core's batch-invariant kernels
    (0.16 on); where triton is missing, the project's ``megatron_lm_cpu`` patch stands in for that
    module (and checks the checkout's release against megatron-core's)."""
    if importlib.util.find_spec("triton") is not None:
        return
    from megatron_pg_agg.patches import apply_megatron_patches  # noqa: PLC0415

    try:
        apply_megatron_patches(cpu_gloo=False, megatron_lm_cpu=True)
    except RuntimeError as error:
        raise HostMissing(f"{error}".replace("\n", " ") + f"; install {INSTALL}") from None


def _modules():
    """pretrain_gpt.py (from the checkout), megatron-core's schedules and Megatron-LM's sampler."""
    _triton_stand_in()
    import pretrain_gpt  # noqa: PLC0415
    from megatron.core.pipeline_parallel import schedules  # noqa: PLC0415

    try:  # the sampler's module per release: megatron/training/datasets from core_v0.16, megatron/legacy/data before
        from megatron.training.datasets.data_samplers import MegatronPretrainingSampler  # noqa: PLC0415
    except ModuleNotFoundError:
        from megatron.legacy.data.data_samplers import MegatronPretrainingSampler  # noqa: PLC0415

    return pretrain_gpt, schedules, MegatronPretrainingSampler


def _formula(args, dp: int) -> str:
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    surrogate = "; l_t = -A_i exp(logp_t - old_t) stands in for the model's per-token loss (loss_func's output_tensor)"
    order = ("" if args.dataloader_type in (None, "single") else
             f"; --dataloader-type {args.dataloader_type} orders the samples otherwise: audited in the single order")
    if args.calculate_per_token_loss:
        return ("J_step = sum_t m_t l_t / (valid tokens of the step): a token mean of each step "
                "(--calculate-per-token-loss; pretrain_gpt.loss_func counts an all-masked micro-batch 0)"
                + surrogate + order)
    return (f"J_step = (1/{dp}) sum_ranks (1/{gbs // (dp * mbs)}) sum_mb [sum_t m_t l_t / max(tokens_mb, 1)]: "
            f"a mean of micro-batch token means (pretrain_gpt.loss_func, --micro-batch-size {mbs}, DP {dp}, "
            f"--global-batch-size {gbs}, no --calculate-per-token-loss)" + surrogate + order)


def load(full: list, options) -> HostConfig:
    """Megatron-LM's parsed args (pretrain_gpt.py's flags) and what the audit reads of them."""
    checkout(full, INSTALL)
    try:
        pretrain_gpt, _, _ = _modules()
    except ImportError as error:
        raise HostMissing(f"Megatron-LM's pretrain_gpt.py does not import here ({error}); install {INSTALL}") from None
    extra = pretrain_gpt.add_modelopt_args if pretrain_gpt.has_nvidia_modelopt else None
    args = parse(without_flags(full, ("--megatron-lm",)), "pretrain_gpt.py", extra)
    dp = 2 if options.dp is None else options.dp
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp  # as Megatron-LM's validate_args sets it
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise HostRefusal(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                          f"{args.micro_batch_size} x DP {dp} (--dp): Megatron-LM refuses it")
    if not args.seq_length:
        raise HostRefusal("--seq-length is not set: the audit's responses are up to --seq-length tokens")
    shape = BatchShape(1, args.global_batch_size, args.seq_length, options.seed)
    settings = {"loop": LOOP_NAME, "--calculate-per-token-loss": args.calculate_per_token_loss,
                "--global-batch-size": args.global_batch_size, "--micro-batch-size": args.micro_batch_size,
                "--seq-length": args.seq_length, "--dataloader-type": args.dataloader_type, "DP (--dp)": dp}
    fix = ("torchrun ... launch/pretrain_actor.py --megatron-lm PATH <the same flags> --calculate-per-token-loss "
           "--pg-loss-aggregation token_mean --micro-batch-size 1 (it packs responses into THD micro-batches; "
           "docs/megatron-lm.md)")
    return HostConfig(shape, _formula(args, dp), settings, splits(args, dp), fix, args)


def _partition(sampler, rows: int, dp: int, mbs: int, gbs: int) -> list:
    """``steps[k][rank]`` = the rank's micro-batches (row lists), each rank's in Megatron-LM's
    ``MegatronPretrainingSampler`` order."""
    per_rank = [list(sampler(rows, 0, mbs, r, dp)) for r in range(dp)]
    n = gbs // (dp * mbs)
    return [[rank[k * n:(k + 1) * n] for rank in per_rank] for k in range(len(per_rank[0]) // n)]


def _surrogate(mb: dict) -> torch.Tensor:
    """``l_t = -A_i exp(logp_t - old_t)`` of a micro-batch (module docstring)."""
    return -mb["advantages"].unsqueeze(1) * (mb["current"] - mb["old"]).exp()


def stock(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from megatron.training.global_vars import set_args  # noqa: PLC0415


    pretrain_gpt, schedules, sampler = _modules()
    args = types.SimpleNamespace(**vars(config.host))
    # loss_func's optional checks need Megatron's rerun state machine; they change no value
    args.check_for_nan_in_loss_and_grad = args.check_for_spiky_loss = False
    set_args(args)
    dp, mbs, gbs = split.settings["dp"], split.settings["micro_batch_size"], split.settings["global_batch_size"]
    objectives, steps = [], []
    for step in _partition(sampler, batch.rows, dp, mbs, gbs):
        losses, counts = [], []
        for rank in step:
            for rows in rank:
                mb = microbatch(batch, rows, leaves, torch.float32)
                func = partial(pretrain_gpt.loss_func, mb["mask"])
                out, count = reduced(schedules, func, _surrogate(mb), args.calculate_per_token_loss, len(rank))
                losses.append(out)
                counts.append(count)
        total = torch.stack(losses).sum()
        objectives.append(total / torch.stack(counts).sum() if args.calculate_per_token_loss else total / dp)
        steps.append(sorted(i for rank in step for rows in rank for i in rows))
    return objectives, steps


def plugin(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    _, schedules, sampler = _modules()
    dp, mbs, gbs = split.settings["dp"], split.settings["micro_batch_size"], split.settings["global_batch_size"]
    objectives, steps = [], []
    for step in _partition(sampler, batch.rows, dp, mbs, gbs):
        rows = sorted(i for rank in step for mb in rank for i in mb)
        objectives.append(token_mean_step(schedules, batch, leaves, rows, step, _surrogate))
        steps.append(rows)
    return objectives, steps
