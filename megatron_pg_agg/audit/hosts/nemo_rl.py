"""NeMo-RL (0.6, GRPO on its Megatron policy) for the audit.

Config: NeMo-RL's own loader, as its ``examples/run_grpo.py`` (and so ``launch/nemo_rl_grpo.py``) loads
it: ``register_omegaconf_resolvers``, ``load_config`` of ``--config FILE`` (a NeMo-RL YAML; default the
checkout's ``examples/configs/grpo_math_1B_megatron.yaml``, or ``grpo_math_1B.yaml`` with
``policy.megatron_cfg.enabled=true policy.dtensor_cfg.enabled=false`` where the checkout has no
Megatron one), ``parse_hydra_overrides`` of the Hydra ``key=value`` overrides (a key NeMo-RL does not
know is refused by Hydra) and ``MasterConfig(**OmegaConf.to_container(...))`` (its pydantic checks). The
checkout: ``--nemo-rl PATH`` after ``--``, or ``MEGATRON_PG_AGG_NEMO_RL`` (as the plug-in finds it).

Split, NeMo-RL's code: the rollout (``grpo.num_prompts_per_step x num_generations_per_prompt`` rows)
goes through ``Policy._shard_for_train`` (on a ``Policy`` holding only what that method reads: its
``__init__`` starts Ray workers), i.e. ``BatchedDataDict.shard_by_batch_size`` over the DP ranks with
``policy.train_global_batch_size`` rows per optimizer step (dynamic batching sorts each step's rows by
length; sequence packing bins them); each rank takes step ``b`` with ``get_batch`` (as
``process_global_batch``) and cuts it as ``get_microbatch_iterator`` does (``make_microbatch_iterator``
of ``policy.train_micro_batch_size``, ``..._with_dynamic_shapes`` or ``..._for_packable_sequences``).

Stock loss: ``ClippedPGLossFn`` (``grpo.setup()``'s, from ``loss_fn``) per micro-batch, on the
next-token log-probs (the leaves; its input is log-probs, so no logits are made), handed the step's
``global_valid_seqs`` / ``global_valid_toks``; under sequence packing through NeMo-RL's
``SequencePackingLossWrapper`` (per sequence), as ``LossPostProcessor`` wraps it. The counts are
``process_global_batch``'s (``nemo_rl/models/megatron/data.py``: ``sum(sample_mask)`` and
``sum(token_mask[:, 1:] * sample_mask)`` of the rank's step, all-reduced over DP): that module
imports Transformer Engine, so the two sums are taken here, the all-reduce being their sum over the
ranks. ``LossPostProcessor``'s ``x num_microbatches`` and megatron-core's ``/ num_microbatches``
cancel and the gradients are summed over DP: a step's J is the sum over ranks and micro-batches.

Plug-in line: ``++loss_fn.pg_agg.mode=token_mean`` through the same loader, the plug-in's
``PGAggLossFn`` around the same ``ClippedPGLossFn`` and ``step_batch`` on the driver's batch (what the
plug-in's ``Policy.train`` wrapper does), then the same sharding and micro-batches.
"""
from __future__ import annotations

import os
import sys
import types

import torch

from megatron_pg_agg.audit.batch import BatchShape
from megatron_pg_agg.audit.hosts import HostConfig, HostMissing, HostRefusal, flag_value, without_flags
from megatron_pg_agg.audit.measure import Split, SplitRefused

__all__ = ["INSTALL", "load", "plugin", "stock"]

INSTALL = ("a NeMo-RL checkout (NVIDIA-NeMo/RL, 0.6) in MEGATRON_PG_AGG_NEMO_RL or --nemo-rl PATH after --, with "
           "NeMo-RL's Python stack and megatron_pg_agg installed in its venv (docs/nemo-rl.md)")
PROMPT = 16
"""Prompt tokens of every synthetic row (NeMo-RL's dynamic batching and packing count whole sequences)."""
DEFAULT_CONFIGS = (("grpo_math_1B_megatron.yaml", []),
                   ("grpo_math_1B.yaml", ["policy.megatron_cfg.enabled=true", "policy.dtensor_cfg.enabled=false"]))
"""The checkout's stock GRPO config when ``--config`` is not given, the first present (with what turns
NeMo-RL's Megatron policy on, as docs/nemo-rl.md runs it)."""
FIX = "++loss_fn.pg_agg.mode=token_mean"


def _checkout(argv: list) -> str:
    from megatron_pg_agg.integrations.nemo_rl.plugin import CHECKOUT_ENV, checkout_problem  # noqa: PLC0415

    path = flag_value(argv, "--nemo-rl") or os.environ.get(CHECKOUT_ENV)
    problem = checkout_problem(path)
    if problem:
        raise HostMissing(f"{problem}; to install: {INSTALL}")
    path = os.path.abspath(path)
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        import nemo_rl.algorithms.grpo  # noqa: F401, PLC0415
        import nemo_rl.algorithms.loss.loss_functions  # noqa: F401, PLC0415
    except ImportError as error:
        raise HostMissing(f"NeMo-RL's GRPO does not import here ({error}); to install: {INSTALL}") from None
    return path


def _default_config(checkout: str) -> tuple:
    for name, overrides in DEFAULT_CONFIGS:
        path = os.path.join(checkout, "examples", "configs", name)
        if os.path.isfile(path):
            return path, overrides
    raise HostRefusal(f"no --config and the checkout {checkout} has none of {[n for n, _ in DEFAULT_CONFIGS]}")


def _master_config(path: str, overrides: list):
    """``MasterConfig`` as ``examples/run_grpo.py`` builds it; NeMo-RL's and Hydra's refusals as HostRefusal."""
    from nemo_rl.algorithms.grpo import MasterConfig  # noqa: PLC0415
    from nemo_rl.utils.config import load_config, parse_hydra_overrides, register_omegaconf_resolvers  # noqa: PLC0415
    from omegaconf import OmegaConf  # noqa: PLC0415

    register_omegaconf_resolvers()
    try:
        config = load_config(path)
        if overrides:
            config = parse_hydra_overrides(config, list(overrides))
        return MasterConfig(**OmegaConf.to_container(config, resolve=True))
    except Exception as error:  # noqa: BLE001  (NeMo-RL's, Hydra's and pydantic's own refusals, as they are)
        raise HostRefusal(f"NeMo-RL's config: {error}".replace("\n", " ")) from None


def _dp(master) -> int:
    mega, cluster = master.policy["megatron_cfg"], master.cluster
    model = (mega["tensor_model_parallel_size"] * mega["pipeline_model_parallel_size"]
             * mega["context_parallel_size"])
    return max(1, cluster["gpus_per_node"] * cluster["num_nodes"] // model)


def _mode(policy: dict) -> str:
    if policy["dynamic_batching"]["enabled"] and policy["sequence_packing"]["enabled"]:
        raise HostRefusal("NeMo-RL's Policy: Dynamic Batching is exclusive of Sequence Packing. Please disable "
                          "Sequence Packing to use Dynamic Batching")
    return ("dynamic" if policy["dynamic_batching"]["enabled"]
            else "packing" if policy["sequence_packing"]["enabled"] else "fixed")


def _split(mode: str, policy: dict, mbs: int, dp: int) -> Split:
    tokens = policy["dynamic_batching" if mode == "dynamic" else "sequence_packing"]["train_mb_tokens"]
    name = {"fixed": f"micro-batch {mbs}", "dynamic": f"dynamic {tokens} tokens",
            "packing": f"packing {tokens} tokens"}[mode]
    return Split(f"{name}, DP {dp}", {"mode": mode, "mbs": mbs, "dp": dp})


def _splits(policy: dict, dp: int) -> list:
    """The configured split first; then micro-batch size x1, /2, x2, dynamic batching and sequence packing
    (each alone), at the configured DP, DP 1 and, where the configured is 1, DP 2 (NeMo-RL's sharding)."""
    mbs, configured = policy["train_micro_batch_size"], _mode(policy)
    splits = {}
    for d in dict.fromkeys([dp, 1, 2 if dp == 1 else dp]):
        for mode, m in ((configured, mbs), ("fixed", mbs), ("fixed", max(1, mbs // 2)), ("fixed", 2 * mbs),
                        ("dynamic", mbs), ("packing", mbs)):
            split = _split(mode, policy, m, d)
            splits.setdefault(split.name, split)
    return list(splits.values())


def _formula(master, gbs: int) -> str:
    loss, beta = master.loss_fn, master.loss_fn.reference_policy_kl_penalty
    step = f"each optimizer step of policy.train_global_batch_size = {gbs} rows"
    kl = f"; plus the KL term (loss_fn.reference_policy_kl_penalty={beta}) reduced the same way" if beta else ""
    if loss.token_level_loss:
        return ("J_step = sum_t m_t l_t / G, G = global_valid_toks (the step's valid tokens over DP): a token mean "
                f"over {step} (ClippedPGLossFn, loss_fn.token_level_loss=true){kl}")
    return ("J_step = (1/S) sum_i (1/M_i) sum_t m_it l_it, S = global_valid_seqs, M_i the row's tokens: a mean of "
            f"sample means over {step} (loss_fn.token_level_loss=false){kl}")


def load(config, overrides: list, argv: list, options) -> HostConfig:
    checkout = _checkout(argv)
    overrides = list(overrides) + without_flags(argv, ("--nemo-rl",))
    prefix = []
    if not config:
        config, prefix = _default_config(checkout)
    master = _master_config(config, prefix + overrides)
    policy, grpo = master.policy, master.grpo
    group, prompts = grpo.num_generations_per_prompt, grpo.num_prompts_per_step
    response = policy["max_total_sequence_length"] - PROMPT
    if response < 1:
        raise HostRefusal(f"policy.max_total_sequence_length={policy['max_total_sequence_length']}: the audit's "
                          f"rows need more than its {PROMPT} prompt tokens")
    dp = options.dp or _dp(master)
    shape = BatchShape(group, prompts, response, options.seed)
    settings = {f"loss_fn.{k}": getattr(master.loss_fn, k) for k in ("token_level_loss", "reference_policy_kl_penalty")}
    settings.update({f"policy.{k}": policy[k] for k in ("train_global_batch_size", "train_micro_batch_size",
                                                        "max_total_sequence_length")})
    settings.update({"policy.dynamic_batching.enabled": policy["dynamic_batching"]["enabled"],
                     "policy.sequence_packing.enabled": policy["sequence_packing"]["enabled"],
                     "policy.sequence_packing.train_mb_tokens": policy["sequence_packing"]["train_mb_tokens"],
                     "policy.megatron_cfg.enabled": policy["megatron_cfg"]["enabled"],
                     "grpo.num_prompts_per_step": prompts, "grpo.num_generations_per_prompt": group,
                     "DP" + (" (--dp)" if options.dp else " (cluster GPUs / TP x PP x CP)"): dp,
                     "config": os.path.basename(config) + (" " + " ".join(prefix) if prefix else "")})
    fix = (f"launch/nemo_rl_grpo.py --config <the same config> <the same overrides> {FIX}  (docs/nemo-rl.md; or "
           "mode=seq_mean|prompt_mean|constant)")
    plugin_master = _master_config(config, prefix + overrides + [FIX])
    return HostConfig(shape, _formula(master, policy["train_global_batch_size"]), settings, _splits(policy, dp), fix,
                      types.SimpleNamespace(master=master, plugin_master=plugin_master))


def _driver_batch(batch):
    """The rollout as ``grpo_train`` hands it to ``Policy.train`` (a ``BatchedDataDict``, one row per
    response: prompt then response tokens), plus ``row`` to follow each row. A row without a valid token
    has ``sample_mask`` 0 (a removed or filtered response)."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # noqa: PLC0415

    rows, width = batch.rows, PROMPT + max(batch.lengths)
    token_mask, prev, ref = torch.zeros(rows, width), torch.zeros(rows, width), torch.zeros(rows, width)
    for i, n in enumerate(batch.lengths):
        token_mask[i, PROMPT:PROMPT + n] = batch.masks[i].float()
        prev[i, PROMPT:PROMPT + n] = batch.old_logprobs[i]
        ref[i, PROMPT:PROMPT + n] = batch.ref_logprobs[i]
    return BatchedDataDict({
        "input_ids": torch.ones(rows, width, dtype=torch.long),
        "input_lengths": torch.tensor([PROMPT + n for n in batch.lengths]),
        "token_mask": token_mask, "sample_mask": (token_mask.sum(1) > 0).float(),
        "advantages": batch.advantages.unsqueeze(1).expand(rows, width).clone(),
        "prev_logprobs": prev, "generation_logprobs": prev.clone(), "reference_policy_logprobs": ref,
        "row": torch.arange(rows)})


def _next_token_logprobs(batch, leaves: list) -> torch.Tensor:
    """``[rows, width - 1]``: NeMo-RL's next-token log-probs (column ``t`` predicts token ``t + 1``), the
    leaves on the response tokens, 0 elsewhere."""
    width = PROMPT + max(batch.lengths)
    return torch.stack([torch.cat([torch.zeros(PROMPT - 1), leaf, torch.zeros(width - PROMPT - leaf.numel())])
                        for leaf in leaves])


def _policy(master, split: Split):
    """A ``Policy`` with what ``_shard_for_train`` reads, set as ``Policy.__init__`` sets it
    (lm_policy.py: the sharding annotation's layout, the dynamic batching and packing arguments)."""
    import numpy as np  # noqa: PLC0415
    from nemo_rl.distributed.named_sharding import NamedSharding  # noqa: PLC0415
    from nemo_rl.models.policy.lm_policy import Policy  # noqa: PLC0415

    cfg = {**master.policy, "train_micro_batch_size": split.settings["mbs"]}
    for key, mode in (("dynamic_batching", "dynamic"), ("sequence_packing", "packing")):
        cfg[key] = {**cfg[key], "enabled": split.settings["mode"] == mode}
    policy = object.__new__(Policy)  # its __init__ starts Ray workers
    policy.cfg = cfg
    policy.sharding_annotations = NamedSharding(
        layout=np.arange(split.settings["dp"]).reshape(1, -1, 1, 1),
        names=["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"])
    policy.use_dynamic_batches = cfg["dynamic_batching"]["enabled"]
    policy.dynamic_batching_args = {"input_key": "input_ids", "input_lengths_key": "input_lengths",
                                    "sequence_length_round": cfg["dynamic_batching"]["sequence_length_round"],
                                    "max_tokens_per_microbatch": 0}
    policy.use_sequence_packing = cfg["sequence_packing"]["enabled"]
    policy.sequence_packing_args = {"algorithm": cfg["sequence_packing"]["algorithm"], "input_key": "input_ids",
                                    "input_lengths_key": "input_lengths",
                                    "sequence_length_pad_multiple": cfg["make_sequence_length_divisible_by"]}
    if cfg["sequence_packing"].get("microbatch_order") is not None:
        policy.sequence_packing_args["microbatch_order"] = cfg["sequence_packing"]["microbatch_order"]
    return policy


def _microbatches(step, split: Split) -> list:
    """The rank's step cut as ``get_microbatch_iterator`` cuts it (a split NeMo-RL asserts against is refused)."""
    try:
        if split.settings["mode"] == "dynamic":
            return list(step.make_microbatch_iterator_with_dynamic_shapes())
        if split.settings["mode"] == "packing":
            return list(step.make_microbatch_iterator_for_packable_sequences())
        return list(step.make_microbatch_iterator(split.settings["mbs"]))
    except AssertionError as error:  # e.g. a rank's rows not a multiple of the micro-batch size
        raise SplitRefused(f"NeMo-RL's BatchedDataDict: {error}") from None


def _micro_loss(loss_fn, lp: torch.Tensor, mb, split: Split, seqs, toks) -> torch.Tensor:
    """One micro-batch's loss as ``LossPostProcessor`` makes it: the loss on the micro-batch's log-probs,
    per sequence through ``SequencePackingLossWrapper`` under packing."""
    from nemo_rl.algorithms.loss.wrapper import SequencePackingLossWrapper  # noqa: PLC0415

    def logprobs(data):
        return lp[data["row"]][:, : data["input_ids"].shape[1] - 1]

    if split.settings["mode"] != "packing":
        return loss_fn(logprobs(mb), mb, seqs, toks)[0]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(mb["input_lengths"], 0)])
    wrapper = SequencePackingLossWrapper(loss_fn, lambda logits, data, loss_fn, **_: ({
        "next_token_logprobs": logprobs(data)}, data), cu_seqlens_q=cu, cu_seqlens_q_padded=cu)
    return wrapper(torch.zeros(1, int(cu[-1])), mb, seqs, toks)[0]


def _run(master, loss_fn, data, batch, split: Split, leaves: list) -> tuple:
    """``(J per step, rows per step)`` of NeMo-RL's ``Policy.train`` on ``data`` (module docstring)."""
    gbs, dp = master.policy["train_global_batch_size"], split.settings["dp"]
    try:
        shards = _policy(master, split)._shard_for_train(data, gbs)
    except AssertionError as error:  # shard_by_batch_size's own checks (rows, gbs and DP that do not divide)
        raise SplitRefused(f"NeMo-RL's shard_by_batch_size: {error}") from None
    lp = _next_token_logprobs(batch, leaves)
    objectives, steps = [], []
    for b in range(data.size // gbs):
        parts = [shard.get_batch(batch_idx=b, batch_size=gbs // dp) for shard in shards]
        seqs = sum(part["sample_mask"].sum() for part in parts)
        toks = sum((part["token_mask"][:, 1:] * part["sample_mask"].unsqueeze(-1)).sum() for part in parts)
        objectives.append(sum(_micro_loss(loss_fn, lp, mb, split, seqs, toks)
                              for part in parts for mb in _microbatches(part, split)))
        steps.append([int(i) for part in parts for i in part["row"].tolist()])
    return objectives, steps


def _stock_loss(master):
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossFn  # noqa: PLC0415

    fused = bool(master.policy["megatron_cfg"].get("use_fused_linear_logprobs", False))
    return ClippedPGLossFn(master.loss_fn, use_fused_linear_logprobs=fused)  # as grpo.setup() builds it


def stock(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    master = config.host.master
    return _run(master, _stock_loss(master), _driver_batch(batch), batch, split, leaves)


def plugin(config: HostConfig, batch, split: Split, leaves: list) -> tuple:
    from megatron_pg_agg.integrations.nemo_rl.loss import PGAggLossFn  # noqa: PLC0415
    from megatron_pg_agg.integrations.nemo_rl.plugin import settings_from_config, step_batch  # noqa: PLC0415

    master = config.host.plugin_master
    loss = PGAggLossFn(_stock_loss(master), settings_from_config(master))
    data = step_batch(_driver_batch(batch), loss, master.policy["train_global_batch_size"])
    return _run(master, loss, data, batch, split, leaves)
