"""Megatron-LM's RL loop (train_rl.py, megatron/rl at core_v0.19) for the audit; its ``pretrain()``
(pretrain_gpt.py) in :mod:`megatron_pg_agg.audit.hosts.megatron_lm_pretrain`.

Which loop: the command line's script, its first word when that ends in ``.py`` (``-- pretrain_gpt.py
--num-layers ...``: ``pretrain()``; ``train_rl.py``: the RL loop; any other script is refused), else the
audit's ``--loop pretrain|rl``, else the RL loop. A ``--loop`` that contradicts the script is refused.

Config: Megatron-LM's own ``megatron.training.arguments.parse_args`` over the command line after
``--`` (``--config FILE``: a file of such arguments); a flag it does not know is refused by its
argparse ("unrecognized arguments"). The DP size is the world size over the model-parallel sizes,
not a flag: the audit's ``--dp`` gives it (default 2).

Stock loss, per micro-batch, all Megatron's code: ``rl_utils.calculate_grpo_loss`` (per token: PPO
clip, k3 KL, entropy term), ``train_rl.loss_func`` (masked sum and token count, an all-masked
micro-batch counting 1) and megatron-core's ``schedules.forward_step_calc_loss`` (without
``--calculate-per-token-loss``: the sum over the count, over the number of micro-batches). Across a
step, what megatron-core's DDP and ``finalize_model_grads`` do to those per-micro-batch losses: the
gradients averaged over DP ranks, or, with ``--calculate-per-token-loss``, divided by the step's
summed count. The DP partition is the one ``rl_utils.prepare_data_for_update`` makes inline (a
function that needs the model): the collection group-major, padded with all-masked rows to a
multiple of DP x micro-batch size, each DP rank a contiguous slice; each optimizer step takes the
next ``global_batch / DP`` rows of every rank's slice (rl_utils.py at core_v0.19.0, ~1585-1620).
With ``--rl-use-sequence-packing`` the configured split and the bin-size splits are Megatron-LM's own
packing (:mod:`.megatron_lm_packing`: bins of ``--seq-length``, half and twice it, one bin a micro-batch);
the row splits stay, named "no packing".

Plug-in line: the project's RL entry (launch/train_rl_actor.py, docs/megatron-rl.md): steps of whole
groups in collection order whatever the DP size, token weights of the mode over the step, the same
per-token loss and megatron-core's per-token reduction.
"""
from __future__ import annotations

import math
import os
import types
from functools import partial

import torch

from megatron_pg_agg.audit.batch import BatchShape
from megatron_pg_agg.audit.hosts import (
    HostConfig,
    HostMissing,
    HostRefusal,
    command_line,
    megatron_lm_packing,
    megatron_lm_pretrain,
    without_flags,
)
from megatron_pg_agg.audit.hosts.megatron_lm_common import (
    PAD,
    checkout,
    microbatch,
    parse,
    reduced,
    splits,
    token_mean_step,
)
from megatron_pg_agg.audit.measure import Split

__all__ = ["INSTALL", "load", "plugin", "stock"]

INSTALL = ("a Megatron-LM checkout at core_v0.19.x (--megatron-lm PATH or MEGATRON_LM_PATH) with "
           "pip install megatron-core==0.19.2 'megatron_pg_agg[megatron-rl]'")
SCRIPTS = {"pretrain_gpt.py": "pretrain", "train_rl.py": "rl"}
"""The Megatron-LM scripts a command line may start with, and the loop each names."""
LOOP = "loop"
"""The settings key that names the audited loop (set for ``pretrain()`` only)."""


def _modules():
    """Megatron-LM's train_rl and rl_utils, and megatron-core's schedules (imports only when used)."""
    from megatron.core import __version__ as core_version  # noqa: PLC0415

    if not core_version.startswith("0.19."):
        raise HostMissing(f"megatron-core {core_version}: Megatron-LM's RL loop is audited on 0.19; install {INSTALL}")
    import train_rl  # noqa: PLC0415
    from megatron.core.pipeline_parallel import schedules  # noqa: PLC0415
    from megatron.rl import rl_utils  # noqa: PLC0415

    return train_rl, rl_utils, schedules


def _loop(full: list, options) -> tuple:
    """``(loop, the command line less its script)`` by the rule of the module docstring."""
    script = full[0] if full and full[0].endswith(".py") else None
    named = SCRIPTS.get(os.path.basename(script)) if script else None
    if script and named is None:
        raise HostRefusal(f"{script}: the megatron-lm audit knows pretrain_gpt.py (pretrain()) and train_rl.py "
                          "(the RL loop)")
    chosen = getattr(options, "loop", None) or named or "rl"
    if named and chosen != named:
        raise HostRefusal(f"--loop {chosen} with a {os.path.basename(script)} command line")
    return chosen, full[1:] if script else full


def _pretrain(config) -> bool:
    """Whether ``config`` is a pretrain() config (its settings name the loop)."""
    return LOOP in config.settings


def _formula(args, dp: int) -> str:
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    packing = megatron_lm_packing.formula(args) if args.rl_use_sequence_packing else ""
    return _stock(args, dp, gbs, mbs) + packing


def _splits(args, dp: int) -> list:
    """The row splits; with --rl-use-sequence-packing the packed ones first (the configured one) and the row
    splits named 'no packing'."""
    rows = splits(args, dp)
    if not args.rl_use_sequence_packing:
        return rows
    return megatron_lm_packing.packed_splits(args, dp) + [Split(f"no packing, {s.name}", s.settings) for s in rows]


def _stock(args, dp: int, gbs: int, mbs: int) -> str:
    if args.calculate_per_token_loss:
        return ("J_step = sum_t m_t l_t / (valid tokens of the step + k), k = all-masked micro-batches "
                f"(padding rows, empty bins) counted as 1 each; steps of {gbs // dp} rows of each DP rank's "
                "contiguous slice (--calculate-per-token-loss)")
    return (f"J_step = (1/{dp}) sum_ranks (1/{gbs // (dp * mbs)}) sum_mb [sum_t m_t l_t / max(tokens_mb, 1)]: "
            f"a mean of micro-batch token means (--micro-batch-size {mbs}, DP {dp}, --global-batch-size {gbs}, "
            "no --calculate-per-token-loss)")


def load(config, overrides: list, argv: list, options) -> HostConfig:
    """Megatron-LM's parsed args and what the audit reads of them; the responses of the synthetic
    batch are up to half of ``--seq-length`` (the rest is the prompt's)."""
    loop, full = _loop(command_line(config, overrides, argv), options)
    if loop == "pretrain":
        return megatron_lm_pretrain.load(full, options)
    checkout(full, INSTALL)
    try:
        _modules()
    except ImportError as error:
        raise HostMissing(f"Megatron-LM's RL loop does not import here ({error}); install {INSTALL}") from None
    args = parse(without_flags(full, ("--megatron-lm",)))
    dp = 2 if options.dp is None else options.dp  # not in Megatron-LM's flags (cli.py's --dp)
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise HostRefusal(f"--global-batch-size {args.global_batch_size} is not a multiple of --micro-batch-size "
                          f"{args.micro_batch_size} x DP {dp} (--dp): Megatron-LM refuses it")
    shape = BatchShape(args.grpo_group_size, args.grpo_prompts_per_step, args.seq_length // 2, options.seed)
    settings = {"--calculate-per-token-loss": args.calculate_per_token_loss,
                "--global-batch-size": args.global_batch_size, "--micro-batch-size": args.micro_batch_size,
                "--grpo-group-size": args.grpo_group_size, "--grpo-prompts-per-step": args.grpo_prompts_per_step,
                "--seq-length": args.seq_length, "--rl-use-sequence-packing": args.rl_use_sequence_packing,
                "DP (--dp)": dp}
    if args.rl_use_sequence_packing:
        settings.update({"--rl-sequence-packing-max-sequences-per-bin": args.rl_sequence_packing_max_sequences_per_bin,
                         "--rl-sequence-packing-algo": args.rl_sequence_packing_algo})
    fix = ("torchrun ... launch/train_rl_actor.py --megatron-lm PATH <the same flags> --calculate-per-token-loss "
           "--pg-loss-aggregation token_mean   (docs/megatron-rl.md)")
    return HostConfig(shape, _formula(args, dp), settings, _splits(args, dp), fix, args)


def _partition(rows: int, dp: int, mbs: int, gbs: int) -> list:
    """``prepare_data_for_update``'s partition: ``steps[k][rank]`` = the rank's micro-batches (row lists)."""
    order = list(range(rows)) + [PAD] * (-rows % (dp * mbs))
    per_rank = len(order) // dp
    slices = [order[r * per_rank:(r + 1) * per_rank] for r in range(dp)]
    per_step = gbs // dp
    steps = []
    for k in range(math.ceil(per_rank / per_step)):
        steps.append([[s[a:a + mbs] for a in range(k * per_step, min((k + 1) * per_step, per_rank), mbs)]
                      for s in slices])
    return steps


def _token_losses(rl_utils, args, mb: dict) -> tuple:
    return rl_utils.calculate_grpo_loss(
        mb["current"], mb["old"], mb["ref"], mb["advantages"], clamp_eps_lower=args.grpo_clamp_eps_lower,
        clamp_eps_upper=args.grpo_clamp_eps_upper, kl_beta=args.grpo_kl_beta,
        entropy_weight=args.grpo_entropy_term_weight)


def stock(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from megatron.training.global_vars import set_args  # noqa: PLC0415

    from megatron_pg_agg.patches.cpu.cpu_torch import _TensorCudaIsIdentity  # noqa: PLC0415

    if _pretrain(config):
        return megatron_lm_pretrain.stock(config, batch, split, leaves)
    train_rl, rl_utils, schedules = _modules()
    args = types.SimpleNamespace(**vars(config.host))
    # train_rl.loss_func's optional checks need Megatron's rerun state machine; they change no value
    args.check_for_nan_in_loss_and_grad = args.check_for_spiky_loss = False
    args.context_parallel_size = 1
    set_args(args)
    if "bin_size" in split.settings:
        return megatron_lm_packing.stock((train_rl, rl_utils, schedules), args, batch, split, leaves)
    dp, mbs, gbs = split.settings["dp"], split.settings["micro_batch_size"], split.settings["global_batch_size"]
    objectives, steps = [], []
    for step in _partition(batch.rows, dp, mbs, gbs):
        losses, counts = [], []
        for rank in step:
            for rows in rank:
                mb = microbatch(batch, rows, leaves, torch.float32)
                loss, kl, ratios, entropy, above, below = _token_losses(rl_utils, args, mb)
                func = partial(train_rl.loss_func, mb["mask"], kl, ratios, entropy, above, below)
                with _TensorCudaIsIdentity():  # loss_func moves its inputs with .cuda()
                    out, count = reduced(schedules, func, loss, args.calculate_per_token_loss, len(rank))
                losses.append(out)
                counts.append(count)
        total = torch.stack(losses).sum()
        objectives.append(total / torch.stack(counts).sum() if args.calculate_per_token_loss else total / dp)
        steps.append([i for rank in step for rows in rank for i in rows if i != PAD])
    return objectives, steps


def plugin(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    if _pretrain(config):
        return megatron_lm_pretrain.plugin(config, batch, split, leaves)
    _, rl_utils, schedules = _modules()
    args = config.host
    dp, mbs, gbs = split.settings["dp"], split.settings["micro_batch_size"], split.settings["global_batch_size"]
    objectives, steps = [], []
    for start in range(0, batch.rows, gbs):
        rows = list(range(start, min(start + gbs, batch.rows)))
        per_rank = math.ceil(len(rows) / dp)
        mine = [rows[r * per_rank:(r + 1) * per_rank] for r in range(dp)]
        micro = [[m[a:a + mbs] for a in range(0, len(m), mbs)] for m in mine]
        objectives.append(token_mean_step(schedules, batch, leaves, rows, micro,
                                          lambda mb: _token_losses(rl_utils, args, mb)[0]))
        steps.append(rows)
    return objectives, steps


