"""The AReaL plug-in: one line makes AReaL 1.0.4's Megatron actor (and critic) train the chosen objective exactly.

In the training script, after AReaL's own ``load_expr_config``::

    config, _ = load_expr_config(args, GRPOConfig)
    use_pg_agg(config)       # the objective of MEGATRON_PG_AGG_AREAL, e.g. prompt_mean or constant:512
    use_pg_agg(config, "prompt_mean")          # or name it here

(``launch/areal_gsm8k_grpo.py`` is AReaL's GSM8K GRPO example with that line.)

What it does, in AReaL's own terms (docs/areal.md):

* checks ``config`` and refuses, naming the AReaL keys, what the objective cannot be exact under
  (:func:`actor_problems`, :func:`critic_problems`), before anything is built; the actor and critic
  classes run the same checks on their own sections when built (as a single-controller worker
  builds them);
* writes the mode to ``MEGATRON_PG_AGG_AREAL`` in this process and in every
  ``config.actor.scheduling_spec[i].env_vars`` (and ``config.critic``'s: AReaL's own way to reach its
  engine worker processes and its launcher's trainer processes);
* makes ``areal.engine.MegatronPPOActor`` this module's :class:`PGAggMegatronPPOActor`, the class
  AReaL's trainer builds for the Megatron backend, and, where ``config.critic`` is set,
  ``areal.engine.MegatronPPOCritic`` its :class:`PGAggMegatronPPOCritic`. In single-controller mode
  AReaL sends the classes to its workers by their import paths, so the workers import this module
  and read the mode from the environment; nothing else needs to run there.

The actor is AReaL's own, with two methods wrapped: ``ppo_update`` marks each token with its prompt
group (AReaL hands one dict per group), so the ``areal_actor`` patch cuts the optimizer steps
along whole groups; ``train_batch`` computes the step's token weights over every DP rank before
AReaL's engine splits the step, and hands AReaL's own loss the scaled advantages
(:mod:`megatron_pg_agg.integrations.areal.loss`). AReaL's weight function, micro-batching,
schedule, optimizer and statistics are its own. The critic is AReaL's own too, with the same two
methods wrapped: its steps hold whole groups, and ``train_batch`` weighs the value loss in the value
term's mode (``value_mode``, by default the policy's) over every DP rank, AReaL's clipped squared
error per token (:func:`~megatron_pg_agg.integrations.areal.loss.exact_value_loss_fn`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from megatron_pg_agg.core.modes import CONSTANT
from megatron_pg_agg.core.value import ValueLossConfig
from megatron_pg_agg.integrations.objective import HostObjective, refused_as

ENV = "MEGATRON_PG_AGG_AREAL"
"""The objective of the AReaL actor and critic: ``<mode>`` or ``constant:<divisor>``, optionally
followed by ``;group_baseline=response_mean`` or ``;group_baseline=response_mean_std``, and by
``;value_mode=<mode>`` or ``;value_mode=constant:<divisor>`` (the critic's own mode)."""
GROUP_BASELINES = (None, "response_mean", "response_mean_std")
OPTIONS = ("group_baseline", "value_mode")
VALUE_FACTOR = 0.5
"""AReaL's factor of the squared value error (its ``_mse_loss``: ``0.5 (x - y)^2``)."""


class ArealConfigError(ValueError):
    """An AReaL configuration the plug-in refuses (names the keys)."""


@dataclass(frozen=True)
class ArealSettings:
    """What the plug-in trains on AReaL: the objective and AReaL's own options (:data:`ENV` carries
    them to AReaL's workers)."""

    objective: HostObjective
    """The policy term's mode (and constant's L): ``<mode>[:<L>]``."""
    group_baseline: Optional[str] = None
    """None: AReaL's own ``actor.adv_norm``; ``response_mean`` (Dr. GRPO) or ``response_mean_std``
    (GRPO): the group baseline per response (:class:`~megatron_pg_agg.integrations.areal.loss.
    ResponseGroupBaseline`) in its place."""
    value_mode: Optional[str] = None
    """The critic's aggregation mode (aliases resolved); None: the policy's (``objective.mode``)."""
    value_divisor: Optional[float] = None
    """constant's L for the critic; None for every other value mode (or with ``value_mode`` None)."""

    def __post_init__(self) -> None:
        if self.group_baseline not in GROUP_BASELINES:
            raise ValueError(f"group_baseline={self.group_baseline!r}: one of {list(GROUP_BASELINES)}")
        value = ValueLossConfig(self.value_mode, self.value_divisor)  # resolves and checks the value mode
        object.__setattr__(self, "value_mode", value.mode)
        object.__setattr__(self, "value_divisor", value.divisor)

    def value_loss(self, clip_eps: Optional[float]) -> ValueLossConfig:
        """The critic's value term: its mode (the policy's where ``value_mode`` is None), AReaL's
        clip range ``critic.eps_clip`` and AReaL's factor 0.5."""
        return ValueLossConfig(self.value_mode, self.value_divisor, clip_eps, VALUE_FACTOR).with_policy_mode(
            self.objective.mode, self.objective.divisor)

    def encode(self) -> str:
        text = _encode_mode(self.objective.mode, self.objective.divisor)
        text += f";group_baseline={self.group_baseline}" if self.group_baseline else ""
        return text + (f";value_mode={_encode_mode(self.value_mode, self.value_divisor)}" if self.value_mode else "")

    @staticmethod
    def decode(text: str) -> "ArealSettings":
        policy_mode, *options = text.split(";")
        with refused_as(ArealConfigError, f"{ENV}={text!r}"):
            mode, divisor = _decode_mode(policy_mode)
            values = {}
            for option in filter(str.strip, options):  # a trailing ';' names no option
                key, _, value = option.partition("=")
                if key.strip() not in OPTIONS:
                    raise ValueError(f"unknown option {option!r} (group_baseline=... or value_mode=...)")
                if key.strip() in values:
                    raise ValueError(f"option {key.strip()!r} given twice")
                values[key.strip()] = value.strip() or None
            value_mode, value_divisor = _decode_mode(values["value_mode"]) if values.get("value_mode") else (None, None)
            return ArealSettings(HostObjective(mode, divisor), values.get("group_baseline"), value_mode, value_divisor)


def _encode_mode(mode: str, divisor: Optional[float]) -> str:
    return f"{mode}:{divisor:g}" if mode == CONSTANT else mode


def _decode_mode(text: str) -> tuple:
    mode, _, divisor = text.partition(":")
    return mode.strip(), float(divisor) if divisor else None


def settings_from_env() -> ArealSettings:
    text = os.environ.get(ENV)
    if not text:
        raise ArealConfigError(f"{ENV} is not set: the AReaL actor of megatron_pg_agg needs the objective "
                               "(call megatron_pg_agg.integrations.areal.plugin.use_pg_agg(config, mode))")
    return ArealSettings.decode(text)


REWARD_KEYS_CONSTANT_IN_RESPONSE = (("kl_ctl", 0.0), ("discount", 1.0), ("gae_lambda", 1.0))
"""AReaL's ``actor`` keys, with the value under which ``compute_advantages`` gives every valid token
of a response the same advantage (no critic): a KL in the reward (``kl_ctl``), a discount or a GAE
lambda below 1 make the advantages vary along the response."""


def min_microbatches(mb_spec, pp_size: int = 1) -> int:
    """The fewest sequences AReaL's engine can cut one optimizer step of a DP rank into: its
    ``MegatronEngine._prepare_mb_list`` asks for ``max(2 * pp if pp > 1 else 1, mb_spec.n_mbs)``
    micro-batches (a multiple of the pipeline stages), and its allocator (``ffd_allocate``,
    ``kk_allocate``) raises when a step has fewer sequences than that."""
    n_mbs = int(getattr(mb_spec, "n_mbs", None) or 1)
    return max(2 * pp_size if pp_size > 1 else 1, n_mbs, pp_size)


def config_problems(actor_config, settings: ArealSettings, *, prompts_per_step: Optional[int] = None,
                    dp_size: Optional[int] = None, samples_per_prompt: Optional[int] = None,
                    pp_size: int = 1) -> list:
    """Every reason the plug-in cannot make ``actor_config`` (AReaL's ``PPOActorConfig``) exact,
    or AReaL's engine would fail on the plug-in's steps, naming AReaL's keys.
    ``prompts_per_step``/``dp_size``/``samples_per_prompt``/``pp_size``: the step's prompt groups,
    DP ranks, responses per prompt (``gconfig.n_samples``) and pipeline stages, where known (a rank
    needs at least one group per optimizer step, and each step enough sequences for its
    micro-batches)."""
    problems = _step_problems(actor_config, "actor", prompts_per_step, dp_size, samples_per_prompt, pp_size)
    problems += _wrapper_problems(actor_config, "actor")
    if settings.group_baseline is not None:
        varying = [f"actor.{key}={getattr(actor_config, key)}" for key, constant in REWARD_KEYS_CONSTANT_IN_RESPONSE
                   if getattr(actor_config, key, constant) != constant]
        if varying:
            problems.append(f"group_baseline={settings.group_baseline} takes one value per response, but "
                            f"{', '.join(varying)} make the advantages vary along a response (a KL in the reward, "
                            "a discount or GAE lambda below 1): set actor.kl_ctl=0 (a KL penalty belongs in the "
                            "loss), actor.discount=1 and actor.gae_lambda=1, or drop group_baseline")
    if getattr(actor_config, "enable_tree_training", False):
        problems.append("actor.enable_tree_training=True: tree training has no per-sequence boundaries in the "
                        "loss inputs; the plug-in supports packed (non-tree) training")
    if getattr(actor_config, "m2_threshold", None) is not None and \
            getattr(actor_config, "prox_logp_method", "recompute") == "loglinear" and \
            getattr(actor_config, "use_decoupled_loss", False):
        problems.append("actor.m2_threshold with actor.prox_logp_method=loglinear: M2PO's selection would depend "
                        "on the current log-probs, so it cannot be made once per step; use recompute or metrics")
    if getattr(actor_config, "is_critic", False):
        problems.append("actor.is_critic=True: the actor is a language model (AReaL's critic is configured under "
                        "critic, with critic.is_critic=true)")
    return problems


def critic_config_problems(critic_config, settings: ArealSettings, *, prompts_per_step: Optional[int] = None,
                           dp_size: Optional[int] = None, samples_per_prompt: Optional[int] = None,
                           pp_size: int = 1, cp_size: int = 1) -> list:
    """:func:`config_problems` for AReaL's critic (``PPOCriticConfig``, its ``critic`` keys):
    the same step shape (its own ``critic.ppo_n_minibatches`` steps of whole groups, ``critic.mb_spec``),
    and what the plug-in's critic cannot take. ``cp_size``: the context-parallel size of
    ``critic.backend`` (AReaL 1.0.4's critic hands its loss a CP shard of the values beside whole
    sequences: docs/areal.md)."""
    problems = _step_problems(critic_config, "critic", prompts_per_step, dp_size, samples_per_prompt, pp_size)
    problems += _wrapper_problems(critic_config, "critic")
    if not getattr(critic_config, "is_critic", True):
        problems.append("critic.is_critic=False: AReaL's critic needs its value head (critic.is_critic=true)")
    eps = getattr(critic_config, "eps_clip", None)
    if eps is not None and not eps > 0:
        problems.append(f"critic.eps_clip={eps}: AReaL's value clip range must be positive")
    if getattr(critic_config, "enable_tree_training", False):
        problems.append("critic.enable_tree_training=True: AReaL 1.0.4's critic does not support tree training")
    backend = getattr(critic_config, "backend", None)
    if cp_size > 1:
        problems.append(f"critic.backend={backend} has context parallelism ({cp_size}): AReaL 1.0.4's critic hands "
                        "its loss this rank's CP shard of the values beside whole sequences of old values, returns "
                        "and mask (its actor reassembles the shards, its critic does not); use a critic without cp")
    if pp_size > 1:
        problems.append(f"critic.backend={backend} has {pp_size} pipeline stages: AReaL 1.0.4 puts its value head on "
                        "every stage (no output layer before the last: it raises); use a critic without pp")
    if getattr(getattr(critic_config, "megatron", None), "bridge_type", "mbridge") != "mbridge":
        problems.append(f"critic.megatron.bridge_type={critic_config.megatron.bridge_type}: AReaL 1.0.4 puts the "
                        "value head in after megatron-core's DDP is built, outside its gradient buffers; the plug-in "
                        "puts it in before DDP through mbridge (AReaL's default bridge_type=mbridge) only")
    return problems


def _wrapper_problems(config, role: str) -> list:
    """megatron-core's FSDP wrappers through AReaL's ``<role>.megatron`` (mbridge's ``get_model``): the
    plug-in's objective is verified under megatron-core's DDP only (AReaL 1.0.4 marks both switches
    "pending test"). Megatron-FSDP is refused as on every entry (Megatron-LM #7452 finding 12); torch
    FSDP2's wrapper does not scale gradients (:data:`~megatron_pg_agg.megatron.config_checks.
    TORCH_FSDP2_REASON`). AReaL runs without ``calculate_per_token_loss``, where FSDP2's own average
    over DP x CP stands in for DDP's 1/(DP x CP), so that lost division does not arise here by
    reading; the wrapper is refused as unverified."""
    megatron = getattr(config, "megatron", None)
    problems = []
    if getattr(megatron, "use_torch_fsdp2", False):
        from megatron_pg_agg.megatron.config_checks import TORCH_FSDP2_REASON  # noqa: PLC0415

        problems.append(f"{role}.megatron.use_torch_fsdp2=True: the plug-in's objective is verified with "
                        f"megatron-core's DDP only (AReaL 1.0.4 marks the switch 'pending test'); {TORCH_FSDP2_REASON}")
    if getattr(megatron, "use_custom_fsdp", False):
        problems.append(f"{role}.megatron.use_custom_fsdp=True: a Megatron-FSDP checkpoint saved at one pipeline size "
                        "loads the wrong layers at another without an error (Megatron-LM #7452, finding 12), and the "
                        "plug-in's objective is verified with megatron-core's DDP only; leave it False")
    return problems


def _step_problems(config, role: str, prompts_per_step: Optional[int], dp_size: Optional[int],
                   samples_per_prompt: Optional[int], pp_size: int) -> list:
    """The optimizer steps of whole prompt groups that ``role``'s (``actor`` or ``critic``)
    ``ppo_n_minibatches`` and ``mb_spec`` ask for, against the groups a DP rank holds."""
    n_steps = int(getattr(config, "ppo_n_minibatches", 1))
    if n_steps < 1:
        return [f"{role}.ppo_n_minibatches={n_steps} must be >= 1"]
    if prompts_per_step is None or not dp_size:
        return []
    per_rank = prompts_per_step // dp_size
    if per_rank < n_steps:
        return [f"{role}.ppo_n_minibatches={n_steps} optimizer steps of whole prompt groups need at least "
                f"{n_steps} groups per DP rank, but train_dataset.batch_size={prompts_per_step} over "
                f"{dp_size} DP rank(s) gives {per_rank}: lower {role}.ppo_n_minibatches or raise "
                "train_dataset.batch_size"]
    if samples_per_prompt:
        return _microbatch_problem(config, role, n_steps, prompts_per_step, dp_size, per_rank, samples_per_prompt,
                                   pp_size)
    return []


def _microbatch_problem(config, role: str, n_steps: int, prompts_per_step: int, dp_size: int, per_rank: int,
                        samples_per_prompt: int, pp_size: int) -> list:
    """The micro-batch count no optimizer step can be cut into: ``per_rank`` groups of
    ``samples_per_prompt`` responses in ``n_steps`` steps of whole groups leave some step with at
    most ``per_rank // n_steps`` groups (pigeonhole), whatever the balancing."""
    needed = min_microbatches(getattr(config, "mb_spec", None), pp_size)
    fewest = samples_per_prompt * (per_rank // n_steps)
    if fewest >= needed:
        return []
    n_mbs = getattr(getattr(config, "mb_spec", None), "n_mbs", None)
    pipeline = f" (AReaL asks for at least 2 x {pp_size} pipeline stages)" if pp_size > 1 else ""
    return [f"{role}.mb_spec.n_mbs={n_mbs}{pipeline} needs {needed} sequences in every optimizer step of every DP "
            f"rank, but some step holds at most {fewest}: train_dataset.batch_size={prompts_per_step} over "
            f"{dp_size} DP rank(s) gives {per_rank} prompt group(s) of gconfig.n_samples={samples_per_prompt} per "
            f"rank, cut into {role}.ppo_n_minibatches={n_steps} optimizer steps of whole groups; lower "
            f"{role}.mb_spec.n_mbs or {role}.ppo_n_minibatches, or raise train_dataset.batch_size"]


def step_too_small(batch: dict, config, pp_size: int, role: str) -> Optional[str]:
    """Why AReaL's micro-batch allocator would fail on this optimizer step of whole groups (fewer
    sequences than the micro-batches ``role``'s ``mb_spec`` asks for), or None."""
    needed = min_microbatches(config.mb_spec, pp_size)
    rows = batch["attention_mask"].shape[0]
    if rows >= needed:
        return None
    return (f"this optimizer step holds {rows} sequence(s) of whole prompt groups on this DP rank, fewer than the "
            f"{needed} micro-batches {role}.mb_spec.n_mbs={config.mb_spec.n_mbs} asks for: lower {role}.mb_spec.n_mbs "
            f"or {role}.ppo_n_minibatches, or raise train_dataset.batch_size or gconfig.n_samples")


def _parallel(config, role: str = "actor"):
    """``role``'s parallel strategy from AReaL's own parser of ``<role>.backend`` (e.g.
    ``megatron:d4p1t1``), or None."""
    allocation = _allocation(getattr(config, role, None), role)
    return None if allocation is None else allocation.parallel


def _allocation(part, role: str):
    try:
        from areal.api.alloc_mode import ModelAllocation  # noqa: PLC0415

        return ModelAllocation.from_str(part.backend, name=role)
    except Exception:  # noqa: BLE001  (no or an unparsable backend: checked per step instead)
        return None


def _absolute_model_paths(config) -> None:
    """``actor.path``, ``critic.path`` and ``ref.path`` made absolute where they name an existing
    folder relative to the working directory: AReaL's Megatron engine hands the path to mbridge,
    which joins a relative one onto itself again (``model/model/model.safetensors``)."""
    for name in ("actor", "critic", "ref"):
        part = getattr(config, name, None)
        path = getattr(part, "path", None)
        if isinstance(path, str) and path and not os.path.isabs(path) and os.path.isdir(path):
            part.path = os.path.abspath(path)


def use_pg_agg(config, mode: Optional[str] = None, divisor: Optional[float] = None, *,
               group_baseline: Optional[str] = None, value_mode: Optional[str] = None,
               value_divisor: Optional[float] = None) -> ArealSettings:
    """Turn the plug-in on for an AReaL run configured by ``config`` (AReaL's ``GRPOConfig`` /
    ``PPOConfig``, as ``load_expr_config`` returns it). ``mode`` None: the objective of
    ``MEGATRON_PG_AGG_AREAL`` (set on the launch, or in ``actor.scheduling_spec[i].env_vars`` of
    AReaL's config). ``group_baseline``: see :attr:`ArealSettings.group_baseline`; ``value_mode``
    (and constant's ``value_divisor``): the critic's own mode, by default the policy's. Raises
    :class:`ArealConfigError` naming every refused key; on success nothing else needs to change.
    Returns the settings."""
    settings = _settings(config, mode, divisor, group_baseline, value_mode, value_divisor)
    critic = getattr(config, "critic", None)
    problems = _run_problems(config, settings)
    if problems:
        raise ArealConfigError("megatron_pg_agg refuses this AReaL configuration:\n- " + "\n- ".join(problems))
    _absolute_model_paths(config)
    encoded = settings.encode()
    os.environ[ENV] = encoded
    for part in (config.actor, critic):
        for spec in getattr(part, "scheduling_spec", None) or ():
            spec.env_vars[ENV] = encoded
    import areal.engine  # noqa: PLC0415

    areal.engine.MegatronPPOActor = actor_class()
    if critic is not None:
        areal.engine.MegatronPPOCritic = critic_class()
    return settings


def _settings(config, mode, divisor, group_baseline, value_mode, value_divisor) -> ArealSettings:
    if mode is None:
        if divisor is not None or group_baseline is not None or value_mode is not None or value_divisor is not None:
            raise ArealConfigError("use_pg_agg: divisor, group_baseline and value_mode go with a mode (or all in "
                                   f"{ENV}=<mode>[:<L>][;group_baseline=...][;value_mode=<mode>[:<L>]])")
        specs = [spec.env_vars.get(ENV) for spec in getattr(config.actor, "scheduling_spec", None) or ()]
        text = os.environ.get(ENV) or next((t for t in specs if t), None)
        if not text:
            raise ArealConfigError(f"use_pg_agg(config) without a mode reads {ENV}, which is set neither in this "
                                   "process nor in actor.scheduling_spec[*].env_vars")
        return ArealSettings.decode(text)
    with refused_as(ArealConfigError, None):  # use_pg_agg's own arguments: the reason names them
        return ArealSettings(HostObjective(mode, divisor), group_baseline, value_mode, value_divisor)


def _run_problems(config, settings: ArealSettings) -> list:
    """:func:`actor_problems` of ``config.actor`` and, where a critic is configured,
    :func:`critic_problems` of ``config.critic``, with the run's step shape."""
    dataset = getattr(config, "train_dataset", None)
    shape = dict(prompts_per_step=getattr(dataset, "batch_size", None),
                 samples_per_prompt=getattr(getattr(config, "gconfig", None), "n_samples", None))
    problems = actor_problems(config.actor, settings, **shape)
    critic = getattr(config, "critic", None)
    return problems if critic is None else problems + critic_problems(critic, settings, **shape)


def actor_problems(actor_config, settings: ArealSettings, *, prompts_per_step: Optional[int] = None,
                   samples_per_prompt: Optional[int] = None) -> list:
    """Every refusal of AReaL's actor section (``config.actor``, a ``PPOActorConfig``): a backend other
    than Megatron (``actor.backend``, AReaL's allocation string, e.g. ``megatron:d4p1t1``), then
    :func:`config_problems` with that backend's DP and PP sizes. What :func:`use_pg_agg` runs, and the
    plug-in's actor class on its own (its constructor, and ``initialize`` with AReaL's ``FinetuneSpec``)."""
    allocation = _allocation(actor_config, "actor")
    problems = []
    if allocation is not None and allocation.backend != "megatron":
        problems.append(f"actor.backend={actor_config.backend}: the plug-in serves AReaL's Megatron actor "
                        f"(MegatronPPOActor); AReaL's trainer builds another actor for the {allocation.backend} "
                        "backend, which the plug-in does not reach: use actor.backend=megatron:...")
    parallel = None if allocation is None else allocation.parallel
    return problems + config_problems(actor_config, settings, prompts_per_step=prompts_per_step,
                                      dp_size=getattr(parallel, "dp_size", None),
                                      samples_per_prompt=samples_per_prompt, pp_size=getattr(parallel, "pp_size", 1))


def critic_problems(critic_config, settings: ArealSettings, *, prompts_per_step: Optional[int] = None,
                    samples_per_prompt: Optional[int] = None) -> list:
    """Every refusal of AReaL's critic section (``config.critic``, a ``PPOCriticConfig``): a backend
    other than Megatron (``critic.backend``), :func:`critic_config_problems` with that backend's DP, PP
    and CP sizes, and a group baseline beside a critic. What :func:`use_pg_agg` runs, and the plug-in's
    critic class on its own (its constructor, and ``initialize`` with AReaL's ``FinetuneSpec``): a
    single-controller worker builds the critic from its section alone."""
    allocation = _allocation(critic_config, "critic")
    problems = []
    if allocation is not None and allocation.backend != "megatron":
        problems.append(f"critic.backend={critic_config.backend}: the plug-in serves AReaL's Megatron critic "
                        "(MegatronPPOCritic); use critic.backend=megatron:...")
    parallel = None if allocation is None else allocation.parallel
    problems += critic_config_problems(critic_config, settings, prompts_per_step=prompts_per_step,
                                       dp_size=getattr(parallel, "dp_size", None),
                                       samples_per_prompt=samples_per_prompt, pp_size=getattr(parallel, "pp_size", 1),
                                       cp_size=getattr(parallel, "cp_size", 1))
    if settings.group_baseline is not None:
        problems.append(f"group_baseline={settings.group_baseline} takes one value per response, but with a critic "
                        "(critic is set) AReaL's GAE advantages follow the critic's values along the response: "
                        "drop group_baseline, or the critic")
    return problems


class _WholeGroupSteps:
    """What the plug-in's actor and critic add to AReaL's classes alike (a mixin before AReaL's base):
    ``ppo_update`` tags AReaL's per-group records with their groups, and each PPO step is prepared
    over every DP rank before AReaL's engine splits it (:meth:`_exact_step`)."""

    pg_agg_role = "actor"
    """AReaL's config section of the class (named in refusals)."""

    def _refuse(self, config, **shape) -> None:
        """What :func:`use_pg_agg` refuses of this class's section (:func:`actor_problems`,
        :func:`critic_problems`), checked by the class itself: a single-controller worker builds it
        from its section alone. ``shape``: ``prompts_per_step`` where known."""
        check = critic_problems if self.pg_agg_role == "critic" else actor_problems
        problems = check(config, self.pg_agg_settings, **shape)
        if problems:
            raise ArealConfigError(f"megatron_pg_agg refuses this AReaL {self.pg_agg_role}:\n- "
                                   + "\n- ".join(problems))

    def initialize(self, addr, ft_spec, *args, **kwargs):
        """AReaL's ``initialize``, after the checks with the step's prompt count (``ft_spec.train_batch_size``,
        AReaL's ``train_dataset.batch_size``), before any model is built."""
        self._refuse(self.config, prompts_per_step=getattr(ft_spec, "train_batch_size", None))
        return super().initialize(addr, ft_spec, *args, **kwargs)

    def ppo_update(self, data, *args, **kwargs):
        from megatron_pg_agg.integrations.areal.loss import tag_groups  # noqa: PLC0415

        if not isinstance(data, list):
            raise ArealConfigError(f"the {self.pg_agg_role}'s ppo_update needs AReaL's per-group records (a list of "
                                   f"dicts, one per prompt group); got {type(data).__name__}")
        return super().ppo_update(tag_groups(data), *args, **kwargs)

    def _exact_step(self, input_, loss_fn, loss_weight_fn, *, mode: str, divisor: Optional[float],
                    m2_threshold: Optional[float] = None):
        """AReaL's ``train_batch`` on one marked PPO step: its micro-batch count checked, its weights
        prepared over every DP rank (:func:`.loss.prepare_step`), ``loss_fn`` the exact loss."""
        from megatron.core import parallel_state as mpu  # noqa: PLC0415

        from megatron_pg_agg.integrations.areal.loss import ArealBatchError, prepare_step  # noqa: PLC0415

        problem = step_too_small(input_, self.config, self.parallel_strategy.pipeline_parallel_size, self.pg_agg_role)
        if problem:  # before AReaL's allocator fails deep in the step
            raise ArealBatchError(problem)
        batch = prepare_step(input_, mode=mode, divisor=divisor, m2_threshold=m2_threshold,
                             dp_group=mpu.get_data_parallel_group())
        return super().train_batch(batch, loss_fn, loss_weight_fn)


def _built(cls: type) -> type:
    """``cls`` named as this module's attribute (AReaL's single-controller workers import it by this
    path) and kept, so that it is built once."""
    cls.__module__, cls.__qualname__ = __name__, cls.__name__
    globals()[cls.__name__] = cls
    return cls


def actor_class():
    """:class:`PGAggMegatronPPOActor`, built on first use (AReaL is an optional extra)."""
    if "PGAggMegatronPPOActor" in globals():
        return globals()["PGAggMegatronPPOActor"]
    from areal.engine.megatron_engine import MegatronPPOActor  # noqa: PLC0415

    from megatron_pg_agg.integrations.areal import actor_patch  # noqa: PLC0415
    from megatron_pg_agg.integrations.areal.loss import GROUP, ResponseGroupBaseline, exact_loss_fn  # noqa: PLC0415
    from megatron_pg_agg.patches._machinery import apply as apply_patch  # noqa: PLC0415

    class PGAggMegatronPPOActor(_WholeGroupSteps, MegatronPPOActor):
        """AReaL's ``MegatronPPOActor`` training megatron_pg_agg's objective (module docstring)."""

        def __init__(self, config, *args, **kwargs):
            self.pg_agg_settings = settings_from_env()
            self._refuse(config)
            apply_patch(actor_patch.PATCH)
            super().__init__(config, *args, **kwargs)
            self.pg_agg_baseline = None
            if self.pg_agg_settings.group_baseline is not None:
                norm = getattr(config, "adv_norm", None)  # AReaL's eps and std convention, where it has them
                self.pg_agg_baseline = ResponseGroupBaseline(
                    std=self.pg_agg_settings.group_baseline == "response_mean_std",
                    eps=getattr(norm, "eps", 1e-5), unbiased=getattr(norm, "std_unbiased", True))

        def compute_advantages(self, data, *args, **kwargs):
            baseline = self.pg_agg_baseline
            if baseline is None:
                return super().compute_advantages(data, *args, **kwargs)
            if not isinstance(data, list):
                raise ArealConfigError("group_baseline needs AReaL's per-group records in compute_advantages (a list "
                                       f"of dicts, one per prompt group); got {type(data).__name__}")
            baseline.group_sizes = [d["attention_mask"].shape[0] for d in data]  # concat_batch keeps this order
            own, self.actor.adv_norm = self.actor.adv_norm, baseline
            try:
                return super().compute_advantages(data, *args, **kwargs)
            finally:
                self.actor.adv_norm, baseline.group_sizes = own, None

        def train_batch(self, input_, loss_fn, loss_weight_fn):
            if not (isinstance(input_, dict) and GROUP in input_):  # not one of the actor's PPO steps
                return super().train_batch(input_, loss_fn, loss_weight_fn)
            objective = self.pg_agg_settings.objective
            return self._exact_step(input_, exact_loss_fn(loss_fn), loss_weight_fn, mode=objective.mode,
                                    divisor=objective.divisor, m2_threshold=self.actor.m2_threshold)

    return _built(PGAggMegatronPPOActor)


def critic_class():
    """:class:`PGAggMegatronPPOCritic`, built on first use (AReaL is an optional extra)."""
    if "PGAggMegatronPPOCritic" in globals():
        return globals()["PGAggMegatronPPOCritic"]
    from areal.engine.megatron_engine import MegatronPPOCritic  # noqa: PLC0415

    from megatron_pg_agg.integrations.areal import actor_patch  # noqa: PLC0415
    from megatron_pg_agg.integrations.areal.loss import GROUP, exact_value_loss_fn, value_clip_eps  # noqa: PLC0415
    from megatron_pg_agg.patches._machinery import apply as apply_patch  # noqa: PLC0415

    class PGAggMegatronPPOCritic(_WholeGroupSteps, MegatronPPOCritic):
        """AReaL's ``MegatronPPOCritic`` training the value term in megatron_pg_agg's objective
        (module docstring): the mode of ``value_mode`` (default: the policy's) over the step of
        every DP rank, AReaL's clipped squared error per token, steps of whole prompt groups."""

        pg_agg_role = "critic"

        def __init__(self, config, *args, **kwargs):
            self.pg_agg_settings = settings_from_env()
            self._refuse(config)
            apply_patch(actor_patch.PATCH)
            super().__init__(config, *args, **kwargs)

        def train_batch(self, input_, loss_fn, loss_weight_fn):
            if not (isinstance(input_, dict) and GROUP in input_):  # not one of the critic's PPO steps
                return super().train_batch(input_, loss_fn, loss_weight_fn)
            value = self.pg_agg_settings.value_loss(value_clip_eps(loss_fn))
            return self._exact_step(input_, exact_value_loss_fn(loss_fn, value), loss_weight_fn, mode=value.mode,
                                    divisor=value.divisor)

    return _built(PGAggMegatronPPOCritic)


def __getattr__(name: str):
    # AReaL's single-controller workers import the actor and critic classes by this module's path
    if name == "PGAggMegatronPPOActor":
        return actor_class()
    if name == "PGAggMegatronPPOCritic":
        return critic_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
