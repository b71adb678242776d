"""The NeMo-RL plug-in: NeMo-RL's GRPO on its Megatron policy trains the chosen objective exactly.

In NeMo-RL's YAML (or as a Hydra override, ``++loss_fn.pg_agg.mode=prompt_mean``)::

    loss_fn:
      pg_agg:
        mode: prompt_mean          # token_mean | seq_mean | prompt_mean | constant
        # divisor: 1024            # constant's L
        # seq_logprob_error_threshold: 1.5   # the filtered numerator (instead of grpo.seq_logprob_error_threshold)

and one line in NeMo-RL's ``examples/run_grpo.py``, between ``setup()`` and the trainer
(``launch/nemo_rl_grpo.py`` is that example with the line)::

    loss_fn = use_pg_agg(master_config, policy, loss_fn)

What it does, in NeMo-RL's terms (docs/nemo-rl.md):

* reads ``loss_fn.pg_agg`` and refuses, naming NeMo-RL's keys, what the objective cannot be exact
  under (:func:`check_config`: the launcher runs the same checks before ``setup()``), before any step;
* returns :class:`~megatron_pg_agg.integrations.nemo_rl.loss.PGAggLossFn`: the run's own
  ``ClippedPGLossFn`` (``setup()``'s object) handed the plug-in's advantages; NeMo-RL's trainer passes
  it to ``Policy.train`` and the Ray workers, as it did its own;
* wraps ``Policy.train`` of this ``policy`` object (on the driver, where the whole batch of every
  optimizer step is in hand before NeMo-RL shards it over DP): when the loss is the plug-in's, the
  step's token weights are computed over every ``policy.train_global_batch_size`` chunk and added to
  the batch as fields that travel with their rows (:mod:`.weights`); any other loss passes
  through unchanged.

NeMo-RL's workers, micro-batching (fixed, dynamic batching, sequence packing), schedule, counts,
optimizer and metrics are its own. With ``loss_fn.pg_agg`` absent nothing changes (NeMo-RL's
``ClippedPGLossConfig`` allows the extra key and ignores it).
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Optional

import torch

from megatron_pg_agg.core.modes import PROMPT_MEAN
from megatron_pg_agg.integrations.nemo_rl.loss import PGAggLossFn
from megatron_pg_agg.integrations.nemo_rl.weights import NemoRLSettings, batch_prompt_groups, step_fields
from megatron_pg_agg.integrations.objective import HostObjective, refused_as

__all__ = ["BLOCK", "CHECKOUT_ENV", "NemoRLConfigError", "check_config", "checkout_problem", "config_problems",
           "settings_from_config", "use_pg_agg", "step_batch"]

CHECKOUT_ENV = "MEGATRON_PG_AGG_NEMO_RL"
"""A NeMo-RL checkout (NeMo-RL is not on the package index): what the tests and
``launch/nemo_rl_grpo.py`` put on ``sys.path``."""
BLOCK = "pg_agg"
"""The plug-in's block inside NeMo-RL's ``loss_fn`` config."""
KEYS = ("mode", "divisor", "seq_logprob_error_threshold")


class NemoRLConfigError(ValueError):
    """A NeMo-RL configuration the plug-in refuses (names the keys)."""


def checkout_problem(path: Optional[str]) -> Optional[str]:
    """None when ``path`` is a NeMo-RL checkout whose loss the plug-in knows (``ClippedPGLossFn``
    with ``metric_normalizations``: NeMo-RL 0.6, 2026-08), else why not."""
    import os  # noqa: PLC0415

    if not path:
        return f"no NeMo-RL checkout: set {CHECKOUT_ENV} to one (docs/nemo-rl.md)"
    losses = os.path.join(path, "nemo_rl", "algorithms", "loss", "loss_functions.py")
    if not os.path.isfile(losses):
        return f"{CHECKOUT_ENV}={path} is not a NeMo-RL checkout (no nemo_rl/algorithms/loss/loss_functions.py)"
    with open(losses) as f:
        text = f.read()
    if "class ClippedPGLossFn" not in text or "metric_normalizations" not in text:
        return f"the NeMo-RL checkout {path} predates ClippedPGLossFn.metric_normalizations (2026-08): update it"
    return None


def _get(config, *path, default=None):
    """``config.a.b`` through NeMo-RL's mix of pydantic models (``MasterConfig``, ``GRPOConfig``,
    ``ClippedPGLossConfig``) and plain dicts (``policy``)."""
    for key in path:
        if config is None:
            return default
        config = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
    return default if config is None else config


def settings_from_config(master_config) -> NemoRLSettings:
    """The plug-in's settings of ``loss_fn.pg_agg`` (raises :class:`NemoRLConfigError` naming the key)."""
    block = _get(master_config, "loss_fn", BLOCK)
    if block is None:
        raise NemoRLConfigError(f"use_pg_agg needs loss_fn.{BLOCK}.mode in NeMo-RL's config (token_mean, seq_mean, "
                                f"prompt_mean or constant with loss_fn.{BLOCK}.divisor), e.g. "
                                f"++loss_fn.{BLOCK}.mode=prompt_mean")
    if not isinstance(block, Mapping):
        raise NemoRLConfigError(f"loss_fn.{BLOCK}={block!r} is not a block: loss_fn.{BLOCK} must be a block of keys "
                                f"{list(KEYS)}, e.g. ++loss_fn.{BLOCK}.mode={block} (not ++loss_fn.{BLOCK}={block})")
    block = dict(block)
    unknown = sorted(set(block) - set(KEYS))
    if unknown:
        raise NemoRLConfigError(f"loss_fn.{BLOCK} has unknown key(s) {unknown}; known: {list(KEYS)}")
    with refused_as(NemoRLConfigError, f"loss_fn.{BLOCK}={block}"):
        return NemoRLSettings(HostObjective(block.get("mode"), block.get("divisor")),
                              block.get("seq_logprob_error_threshold"))


def config_problems(master_config, objective: HostObjective) -> list:
    """Every reason the plug-in cannot make this NeMo-RL run exact, naming NeMo-RL's keys."""
    problems = []
    if _get(master_config, "data_plane", "enabled", default=False):
        problems.append("data_plane.enabled=true: the plug-in reaches NeMo-RL's Policy.train (the legacy driver "
                        "path), not the data plane's TQPolicy.train_from_meta")
    if not _get(master_config, "policy", "megatron_cfg", "enabled", default=False):
        problems.append("policy.megatron_cfg.enabled is false: the plug-in is tested on NeMo-RL's Megatron policy "
                        "(the DTensor workers are not covered)")
    threshold = _get(master_config, "grpo", "seq_logprob_error_threshold")
    if threshold is not None:
        problems.append(f"grpo.seq_logprob_error_threshold={threshold} removes the rejected sequences from the "
                        "step's counts (the survivor denominator of NeMo-RL #4242); under the plug-in a filtered "
                        "sequence leaves the numerator and keeps its place in the denominator: set "
                        f"loss_fn.{BLOCK}.seq_logprob_error_threshold={threshold} instead (the same rejection, "
                        "NeMo-RL's own compute_and_apply_seq_logprob_error_masking)")
    if objective.mode == PROMPT_MEAN:
        gbs = _get(master_config, "policy", "train_global_batch_size")
        group = _get(master_config, "grpo", "num_generations_per_prompt")
        if gbs and group and gbs % group:
            problems.append(f"prompt_mean needs every prompt group inside one optimizer step, but "
                            f"policy.train_global_batch_size={gbs} is not a multiple of "
                            f"grpo.num_generations_per_prompt={group}: some group is cut across two steps")
    return problems


def check_config(master_config) -> NemoRLSettings:
    """Every start-up check of the plug-in on NeMo-RL's config (``MasterConfig``, or the dict it is built
    from): the settings of ``loss_fn.pg_agg`` (:func:`settings_from_config`) and
    :func:`config_problems`. What :func:`use_pg_agg` runs, and ``launch/nemo_rl_grpo.py`` as soon as
    the config is loaded, before NeMo-RL's ``setup()`` (Ray, tokenizer, data, workers). Returns the
    settings; raises :class:`NemoRLConfigError` naming every refused key."""
    settings = settings_from_config(master_config)
    problems = config_problems(master_config, settings.objective)
    if problems:
        raise NemoRLConfigError("megatron_pg_agg refuses this NeMo-RL configuration:\n- " + "\n- ".join(problems))
    return settings


def use_pg_agg(master_config, policy, loss_fn) -> PGAggLossFn:
    """Turn the plug-in on for a NeMo-RL GRPO run: ``master_config``, ``policy`` and ``loss_fn``
    as ``grpo.setup()`` returns them. Returns the loss object to hand NeMo-RL's trainer instead of
    ``loss_fn``; raises :class:`NemoRLConfigError` naming every refused key (module docstring)."""
    from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossFn  # noqa: PLC0415

    if not isinstance(loss_fn, ClippedPGLossFn):
        raise NemoRLConfigError(f"use_pg_agg takes the ClippedPGLossFn that grpo.setup() built; got "
                                f"{type(loss_fn).__name__}")
    loss = PGAggLossFn(loss_fn, check_config(master_config))
    if not isinstance(policy.train, StepWeightedTrain):
        policy.train = StepWeightedTrain(policy)
    return loss


class StepWeightedTrain:
    """``Policy.train`` of one policy object, adding the plug-in's fields to the batch first when the
    loss is a :class:`PGAggLossFn` (arguments bound by name: NeMo-RL's own signature)."""

    def __init__(self, policy):
        self.policy = policy
        self.__wrapped__ = policy.train  # the bound method (or whatever another layer put there)
        self.signature = inspect.signature(self.__wrapped__)

    def __call__(self, *args: Any, **kwargs: Any):
        bound = self.signature.bind(*args, **kwargs)
        loss_fn = bound.arguments.get("loss_fn")
        if isinstance(loss_fn, PGAggLossFn):
            gbs = bound.arguments.get("gbs") or self.policy.cfg["train_global_batch_size"]
            bound.arguments["data"] = step_batch(bound.arguments["data"], loss_fn, gbs)
        return self.__wrapped__(*bound.args, **bound.kwargs)


def _kept_rows(data, threshold: Optional[float]) -> Optional[torch.Tensor]:
    """The rows NeMo-RL's own sequence-level log-prob error masking keeps at ``threshold`` (run on
    a copy: the batch's ``sample_mask`` is left as it was), or None when off."""
    if threshold is None:
        return None
    from nemo_rl.algorithms.grpo import compute_and_apply_seq_logprob_error_masking  # noqa: PLC0415

    probe = {key: data[key] for key in ("token_mask", "sample_mask", "prev_logprobs", "generation_logprobs")}
    compute_and_apply_seq_logprob_error_masking(probe, torch.zeros(probe["sample_mask"].shape[0]), threshold)
    return probe["sample_mask"] > 0


def step_batch(data, loss: PGAggLossFn, gbs: int):
    """``data`` (NeMo-RL's training batch on the driver) with the plug-in's fields added, computed over
    each optimizer step of ``gbs`` rows (a new ``BatchedDataDict``; the caller's is left as it was)."""
    settings = loss.settings
    objective = settings.objective
    groups = batch_prompt_groups(data) if objective.mode == PROMPT_MEAN else None
    rewards = data["rewards"] if loss.nll_weight > 0 and "rewards" in data else None
    fields = step_fields(data["token_mask"].cpu(), data["sample_mask"].cpu(), gbs=gbs, objective=objective,
                         sequence_level=loss.sequence_level, groups=groups,
                         kept_rows=_kept_rows(data, settings.seq_logprob_error_threshold),
                         rewards=None if rewards is None else rewards.cpu(), dtype=data["advantages"].dtype)
    out = type(data)(dict(data))
    out.update(fields)
    return out
