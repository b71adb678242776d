"""slime (THUDM/slime, Megatron backend) for the audit.

Config: slime's own parser for its training side, Megatron-LM's ``parse_args`` with slime's
``get_slime_extra_args_provider()``, over the command line after ``--`` (``--config FILE``: a file of
such arguments); a flag neither knows is refused by that argparse. sglang's flags (``--sglang-*``)
go to sglang's own parser in a slime launch and are not read here. slime and Megatron-LM are users'
checkouts: ``--slime PATH`` (or ``MEGATRON_PG_AGG_SLIME``) and ``--megatron-lm PATH`` (or
``MEGATRON_LM_PATH``).

Stock loss, all slime's and megatron-core's code: slime's own default conversion
(``RolloutManager._convert_samples_to_train_data``: loss masks, ``rollout_mask_sums``), its step and
micro-batch schedule (``build_dp_schedule``: static ``--micro-batch-size`` or dynamic
``--max-tokens-per-gpu``, every DP rank), its ``loss_function`` (``get_sum_of_sample_mean``, the
per-token count clamped at 1 per sample, ``x num_microbatches / gbs x dp``) and megatron-core's
``forward_step_calc_loss``; then what DDP and ``finalize_model_grads`` do across micro-batches and
ranks (a sum; with ``--calculate-per-token-loss`` over the summed count). The DP ranks run in this
one process: slime's ``x dp`` and DDP's ``1 / dp`` cancel, so every rank's micro-batches run at DP
world 1. The per-token term is slime's PPO ``compute_policy_loss`` on the log-probs, given to
``loss_function`` as its ``custom_loss`` (:func:`policy_loss`): slime's ``policy_loss_function``
computes its log-probs from logits, which need a model; its KL and entropy terms go through the same
reducer and are left out.

Plug-in line: slime's same path with the plug-in's conversion hook
(``megatron_pg_agg.integrations.slime.plugin.convert_samples_to_train_data``, token_mean) writing
``rollout_mask_sums``.
"""
from __future__ import annotations

import os
import sys
import types
from functools import partial

import torch

from megatron_pg_agg.audit.batch import BatchShape
from megatron_pg_agg.audit.hosts import HostConfig, HostMissing, command_line, flag_value, without_flags
from megatron_pg_agg.audit.measure import Split, SplitRefused

__all__ = ["INSTALL", "load", "plugin", "policy_loss", "stock"]

INSTALL = ("a slime checkout (--slime PATH or MEGATRON_PG_AGG_SLIME) in slime's own environment (docs/slime.md), "
           "with a Megatron-LM checkout (--megatron-lm PATH or MEGATRON_LM_PATH)")
PROMPT = 8
"""Prompt tokens of every synthetic sample (slime's total_lengths; the loss reads responses only)."""
OWN_FLAGS = ("--slime", "--megatron-lm")


def _paths(argv: list) -> None:
    from megatron_pg_agg.integrations.slime.plugin import CHECKOUT_ENV, checkout_problem  # noqa: PLC0415
    from megatron_pg_agg.training.megatron_lm import find_checkout, use_checkout  # noqa: PLC0415
    from megatron_pg_agg.training.run_config import StartupError  # noqa: PLC0415

    path = flag_value(argv, "--slime") or os.environ.get(CHECKOUT_ENV)
    problem = checkout_problem(path)
    if problem:
        raise HostMissing(f"{problem}; install {INSTALL}")
    try:
        use_checkout(find_checkout(argv))
    except StartupError as error:
        raise HostMissing(f"{error}; install {INSTALL}") from None
    path = os.path.abspath(path)
    if path not in sys.path:
        sys.path.insert(0, path)


def _parse(argv: list):
    """slime's training-side parser over ``argv`` (it reads ``sys.argv``), with slime_validate_args'
    defaults for the two values the loss reads (``eps_clip_high``, the step size)."""
    from megatron.training.arguments import parse_args  # noqa: PLC0415
    from slime.utils.arguments import get_slime_extra_args_provider  # noqa: PLC0415

    saved = sys.argv
    sys.argv = ["train.py", *argv]
    try:
        args = parse_args(extra_args_provider=get_slime_extra_args_provider(), ignore_unknown_args=False)
    finally:
        sys.argv = saved
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.global_batch_size is None:
        rows = args.rollout_batch_size * args.n_samples_per_prompt
        args.global_batch_size = rows // (args.num_steps_per_rollout or 1)
    return args


def _dp(args) -> int:
    gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    return max(1, gpus // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                           * args.context_parallel_size))


def _formula(args) -> str:
    gbs = args.global_batch_size
    if args.calculate_per_token_loss:
        return ("J_step = sum_i sum_t m_it l_it / sum_i max(n_i, 1) over the step's samples: a token mean in which "
                "each fully masked sample counts one token (J x N/(N+k)) (--calculate-per-token-loss)")
    return (f"J_step = (1/{gbs}) sum_i [sum_t m_it l_it / max(D_i, 1)], D_i = rollout_mask_sums (the sample's "
            f"valid tokens): a mean of sample means over --global-batch-size {gbs} samples, fully masked ones "
            "included")


def _splits(args, dp: int) -> list:
    mbs, cap = args.micro_batch_size, args.max_tokens_per_gpu
    splits = []
    for d in dict.fromkeys([dp, 1]):
        if args.use_dynamic_batch_size:
            splits.append(Split(f"dynamic {cap} tokens, DP {d}", {"dynamic": True, "cap": cap, "mbs": mbs, "dp": d}))
        for m in dict.fromkeys([mbs, max(1, mbs // 2), 2 * mbs]):
            splits.append(Split(f"micro-batch {m}, DP {d}", {"dynamic": False, "cap": cap, "mbs": m, "dp": d}))
        if not args.use_dynamic_batch_size:
            cap2 = cap or 2 * (args.rollout_max_response_len + PROMPT)
            splits.append(Split(f"dynamic {cap2} tokens, DP {d}", {"dynamic": True, "cap": cap2, "mbs": mbs, "dp": d}))
    return splits


def load(config, overrides: list, argv: list, options) -> HostConfig:
    full = command_line(config, overrides, argv)
    _paths(full)
    try:
        args = _parse(without_flags(full, OWN_FLAGS))
        _modules()
    except ImportError as error:
        raise HostMissing(f"slime does not import here ({error}); install {INSTALL}") from None
    dp = _dp(args)
    shape = BatchShape(args.n_samples_per_prompt, args.rollout_batch_size, args.rollout_max_response_len,
                       options.seed)
    settings = {key: getattr(args, key.lstrip("-").replace("-", "_")) for key in (
        "--calculate-per-token-loss", "--global-batch-size", "--micro-batch-size", "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", "--n-samples-per-prompt", "--rollout-batch-size", "--num-steps-per-rollout",
        "--rollout-max-response-len")}
    settings["DP"] = dp
    fix = ("--custom-convert-samples-to-train-data-path megatron_pg_agg.integrations.slime.plugin."
           "convert_samples_to_train_data --custom-config-path pg_agg.yaml (pg_agg_mode: token_mean)"
           + ("; drop --calculate-per-token-loss" if args.calculate_per_token_loss else "") + "  (docs/slime.md)")
    return HostConfig(shape, _formula(args), settings, _splits(args, dp), fix, args)


def _modules():
    import torch._functorch.config as functorch_config  # noqa: PLC0415
    from megatron.core.pipeline_parallel import schedules  # noqa: PLC0415
    from slime.backends.megatron_utils import loss  # noqa: PLC0415
    from slime.utils.dp_schedule import build_dp_schedule  # noqa: PLC0415

    # slime's compute_policy_loss is torch.compile'd; the audit takes each optimizer step's gradient from
    # one graph (retain_graph between steps), which a compiled backward with donated buffers refuses
    # (seen under OMP_NUM_THREADS=1, as torchrun sets it). Values are unchanged: buffers are only not reused.
    functorch_config.donated_buffer = False
    return loss, build_dp_schedule, schedules


def _parallel_state() -> None:
    """A one-process gloo group and megatron-core's parallel state (slime's loss reads its DP and CP sizes),
    on a port of its own: a ``MASTER_PORT`` in the environment belongs to whatever launched the audit."""
    from megatron.core import parallel_state  # noqa: PLC0415

    if not parallel_state.model_parallel_is_initialized():
        from megatron_pg_agg.megatron.parallel import (  # noqa: PLC0415
            ParallelSizes,
            free_port,
            init_distributed,
            init_parallel,
        )

        init_distributed(world_size=1, rank=0, port=free_port())
        init_parallel(ParallelSizes())


def policy_loss(args, batch, logits, sum_of_sample_mean):
    """slime's ``custom_loss`` for the audit: ``logits`` are the micro-batch's response log-probs; slime's
    PPO term (``compute_policy_loss``) reduced by slime's ``sum_of_sample_mean``."""
    from slime.utils.ppo_utils import compute_policy_loss  # noqa: PLC0415

    ppo_kl = torch.cat(batch["log_probs"]) - logits
    pg_loss, _ = compute_policy_loss(ppo_kl, torch.cat(batch["advantages"]), args.eps_clip, args.eps_clip_high)
    loss = sum_of_sample_mean(pg_loss)
    return loss, {"pg_loss": loss.detach()}


def _samples(batch) -> list:
    from slime.utils.types import Sample  # noqa: PLC0415

    return [Sample(group_index=batch.group_ids[i], index=i, tokens=[1] * (PROMPT + n), response_length=n,
                   reward=float(batch.advantages[i]), loss_mask=batch.masks[i].int().tolist(),
                   status=Sample.Status.COMPLETED) for i, n in enumerate(batch.lengths)]


def _run(config: HostConfig, batch, split: Split, leaves: list, data: dict, per_token: bool) -> tuple:
    """slime's schedule and loss over ``data`` (a conversion's output) under ``split``: ``(J per step, steps)``."""
    loss, build_dp_schedule, schedules = _modules()
    _parallel_state()
    args = types.SimpleNamespace(**vars(config.host))
    args.loss_type, args.custom_loss_function_path = "custom_loss", f"{__name__}.policy_loss"
    args.calculate_per_token_loss, args.recompute_loss_function, args.allgather_cp = per_token, False, False
    schedule = types.SimpleNamespace(**vars(args))  # build_dp_schedule's balancing reads the model's sizes too
    schedule.use_dynamic_batch_size, schedule.micro_batch_size = split.settings["dynamic"], split.settings["mbs"]
    schedule.max_tokens_per_gpu = split.settings["cap"]
    parallel = {"dp_size": split.settings["dp"], "cp_size": 1, "vpp_size": 1, "microbatch_group_size_per_vp_stage": 1}
    try:
        partitions, micro, num_mbs, sizes = build_dp_schedule(
            schedule, parallel, [PROMPT + n for n in batch.lengths], global_batch_size=args.global_batch_size,
            rollout_indices=list(data["rollout_ids"]))
    except AssertionError as error:  # slime's own refusal of the split (its asserts)
        raise SplitRefused(str(error)) from None
    masks = [torch.tensor(m, dtype=torch.float32) for m in data["loss_masks"]]
    denominators = torch.tensor(data["rollout_mask_sums"], dtype=torch.float32)
    objectives, steps, start = [], [], 0
    for s, count in enumerate(num_mbs):
        outputs, counts, rows = [], [], []
        for partition, local in zip(partitions, micro):
            for mb in [[partition[j] for j in indices] for indices in local[start:start + count]]:
                part = {"advantages": [batch.advantages[i].expand(batch.lengths[i]) for i in mb],
                        "log_probs": [batch.old_logprobs[i] for i in mb], "loss_masks": [masks[i] for i in mb],
                        "response_lengths": [batch.lengths[i] for i in mb],
                        "total_lengths": [PROMPT + batch.lengths[i] for i in mb],
                        "rollout_mask_sums": [denominators[i] for i in mb]}
                func = partial(loss.loss_function, args, part, count, sizes[s])
                config_ = types.SimpleNamespace(calculate_per_token_loss=per_token, timers=None)
                out, n = schedules.forward_step_calc_loss(None, torch.cat([leaves[i] for i in mb]), func, config_,
                                                          None, False, count, [], cp_group_size=1, is_last_stage=True)
                outputs.append(out)
                counts.append(torch.as_tensor(n, dtype=torch.float32))
                rows += list(mb)
        total = torch.stack(outputs).sum()
        objectives.append(total / torch.stack(counts).sum() if per_token else total)
        steps.append(rows)
        start += count
    return objectives, steps


def stock(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from megatron_pg_agg.integrations.slime.plugin import default_conversion  # noqa: PLC0415

    data = default_conversion(config.host, _samples(batch))
    return _run(config, batch, split, leaves, data, config.host.calculate_per_token_loss)


def plugin(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from megatron_pg_agg.integrations.objective import HostObjective  # noqa: PLC0415
    from megatron_pg_agg.integrations.slime.plugin import convert_samples_to_train_data  # noqa: PLC0415

    args = types.SimpleNamespace(**vars(config.host))
    args.calculate_per_token_loss = False  # the fix drops it: slime then reads rollout_mask_sums
    data = convert_samples_to_train_data(args, _samples(batch), HostObjective("token_mean"))
    return _run(config, batch, split, leaves, data, False)
