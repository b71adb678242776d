"""verl's actor keys and the plug-in's ``pg_agg`` block -> one :class:`PGLossConfig` (host only).

Imports nothing of verl: the keys are read from the mapping verl gives (an OmegaConf node or verl's
``ActorConfig`` dataclass, both readable as mappings), so the rules are testable without verl.

Turned on by ``actor_rollout_ref.actor.policy_loss.loss_mode=pg_agg``. The aggregation comes from
``actor_rollout_ref.pg_agg.mode`` (one of ours or a verl ``loss_agg_mode`` name) or, without it,
from ``actor.loss_agg_mode`` through the alias table (:data:`megatron_pg_agg.core.modes.ALIASES`).
verl's own keys keep their meaning where ours is the same quantity (docs/verl.md has the table):

==========================================  =======================================================
verl key (``actor_rollout_ref.actor.``)     ours
==========================================  =======================================================
``clip_ratio_low`` / ``clip_ratio_high``    ``clip_eps_low`` / ``clip_eps_high``
``clip_ratio_c``                            ``dual_clip`` (ppo only, as verl's vanilla loss)
``entropy_coeff``                           ``entropy_coef`` (a token mean, whatever the mode)
``use_kl_loss`` / ``kl_loss_coef``          ``kl_coef`` (0 unless use_kl_loss; a token mean)
``kl_loss_type``                            ``kl_estimator``: kl/k1, mse/k2, low_var_kl/k3
``loss_scale_factor``                       ``divisor`` of ``constant`` (when the block has none)
==========================================  =======================================================

Every problem is found at start-up and reported at once, each naming its verl key.

The critic (verl's ``critic`` node, its ``CriticConfig``): the value term's mode is
``critic.loss_agg_mode``, by default the policy's (:func:`critic_for_run`, on the whole trainer
config at verl's start-up check); the critic worker's loss from its own config
(:func:`value_config_from_critic`): ``cliprange_value`` is the value clip, ``loss_scale_factor``
L of constant. docs/verl.md, "The critic".
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from typing import Any, Mapping, Optional

from megatron_pg_agg.core.losses import POLICY_LOSSES, ROLLOUT_CORRECTIONS, PGLossConfig
from megatron_pg_agg.core.modes import ALIASES, CONSTANT, MODES, REFUSED_ALIASES
from megatron_pg_agg.core.value import ValueLossConfig

LOSS_MODE = "pg_agg"
"""The value of ``actor.policy_loss.loss_mode`` that turns the plug-in on."""
ACTOR = "actor_rollout_ref.actor"
BLOCK = "actor_rollout_ref.pg_agg"
"""Where the plug-in's own keys live: a sibling of verl's ``actor`` (verl's ActorConfig dataclass
refuses unknown keys, the ``actor_rollout_ref`` node does not)."""
BLOCK_KEYS = {
    "mode": "token_mean, seq_mean, prompt_mean (groups = verl's uid) or constant; default: actor.loss_agg_mode",
    "divisor": "L of constant (default: actor.loss_scale_factor)",
    "policy_loss": f"one of {POLICY_LOSSES} (default ppo)",
    "rollout_correction": f"one of {ROLLOUT_CORRECTIONS} from the batch's rollout_log_probs (default off)",
    "rollout_correction_max": "C of the rollout correction (default 2.0)",
    "rollout_correction_min": "c of the rollout correction (default 0.0)",
}
KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
"""verl's ``kl_loss_type`` values with the same estimator here (verl clamps low_var_kl to [-10, 10];
ours does not: docs/verl.md)."""
VERL_DEFAULT_AGG = "token-mean"
VERL_VERSION = "0.9.1"
"""The verl release the plug-in is tested with (verl's engine code is read by version: 0.9.x)."""
VERL_INSTALL = ('pip install torch==2.14.1 && pip install --no-deps megatron-bridge==0.6.2 verl==0.9.1 && '
                'pip install -e ".[verl]"')
"""The install line of the verl plug-in (Python 3.12; docs/verl.md says why ``--no-deps``)."""


def verl_install_problem() -> Optional[str]:
    """Why the verl plug-in cannot run in this interpreter, or None."""
    if (sys.version_info.major, sys.version_info.minor) != (3, 12):
        return (f"the verl plug-in runs verl {VERL_VERSION}'s Megatron engine, which builds through Megatron-Bridge "
                f"and needs Python 3.12 (this is {sys.version_info.major}.{sys.version_info.minor}); in a Python 3.12 "
                f"venv: {VERL_INSTALL}")
    for package in ("verl", "megatron-bridge", "tensordict"):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return f"{package} is not installed (the verl plug-in needs it); install: {VERL_INSTALL}"
    version = importlib.metadata.version("verl")
    if not version.startswith("0.9."):
        return (f"verl {version} is installed; the plug-in is written for verl 0.9.x ({VERL_VERSION} tested): "
                f"{VERL_INSTALL}")
    # verl 0.9 builds through Megatron-Bridge 0.6, which is megatron-core 0.19's (the engine patch's range)
    try:
        core = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        core = None
    if core is None or not core.startswith("0.19."):
        return (f"the verl plug-in runs with megatron-core 0.19 (verl {VERL_VERSION} builds through Megatron-Bridge "
                f"0.6.2, built on 0.19); this environment has megatron-core {core or 'none'}: {VERL_INSTALL}")
    return None


class VerlConfigError(ValueError):
    """A verl run configured for the plug-in in a way it cannot honour exactly (names the keys)."""


def _get(node: Any, key: str, default=None):
    if node is None:
        return default
    if isinstance(node, Mapping):
        return node.get(key, default)
    return getattr(node, key, default)


def _canonical(name: str) -> Optional[str]:
    return name if name in MODES else (ALIASES[name].mode if name in ALIASES else None)


def _mode(actor, block, problems: list) -> tuple[Optional[str], Optional[float]]:
    """``(mode as given, divisor)``: the block's mode, else verl's loss_agg_mode by alias."""
    agg = _get(actor, "loss_agg_mode", VERL_DEFAULT_AGG)
    mode = _get(block, "mode")
    if agg in REFUSED_ALIASES:
        problems.append(f"{ACTOR}.loss_agg_mode={agg!r}: {REFUSED_ALIASES[agg].note}")
        return None, None
    if mode is None:
        mode = agg
    if _canonical(mode) is None:
        problems.append(f"{BLOCK}.mode={mode!r} is not a mode: use one of {list(MODES)} or a verl "
                        f"loss_agg_mode ({[k for k, a in ALIASES.items() if a.source == 'verl']})")
        return None, None
    if agg != VERL_DEFAULT_AGG and _canonical(agg) != _canonical(mode):
        # verl's default says nothing; any other value the user set must agree with the block
        problems.append(f"{BLOCK}.mode={mode!r} and {ACTOR}.loss_agg_mode={agg!r} ask for different "
                        f"aggregations ({_canonical(mode)} against {_canonical(agg)}); set only one of them")
        return None, None
    divisor = _get(block, "divisor")
    implied = ALIASES[mode].divisor if mode in ALIASES else None
    if _canonical(mode) == CONSTANT and divisor is None and implied is None:
        divisor = _get(actor, "loss_scale_factor")
        if divisor is None:
            problems.append(f"{BLOCK}.mode={mode!r} needs L: set {BLOCK}.divisor or {ACTOR}.loss_scale_factor "
                            "(for example the maximum response length); verl's fallback, the padded width of "
                            "each micro-batch, changes with the micro-batch split and is not used")
    return mode, divisor


def loss_config_from_verl(actor: Mapping, block: Optional[Mapping]) -> PGLossConfig:
    """The :class:`PGLossConfig` a verl actor config plus the ``pg_agg`` block ask for.

    ``actor``: verl's ``actor_rollout_ref.actor`` (node or ActorConfig); ``block``:
    ``actor_rollout_ref.pg_agg`` or None. Raises :class:`VerlConfigError` listing every problem.
    """
    problems = []
    loss_mode = _get(_get(actor, "policy_loss"), "loss_mode")
    if loss_mode != LOSS_MODE:
        problems.append(f"{ACTOR}.policy_loss.loss_mode is {loss_mode!r}: the plug-in runs with {LOSS_MODE!r}")
    block = {} if block is None else dict(block)
    unknown = sorted(set(block) - set(BLOCK_KEYS))
    if unknown:
        problems.append(f"unknown keys {[f'{BLOCK}.{k}' for k in unknown]}; the block takes: "
                        + "; ".join(f"{k}: {v}" for k, v in BLOCK_KEYS.items()))
    mode, divisor = _mode(actor, block, problems)
    policy_loss = block.get("policy_loss", "ppo")
    if policy_loss not in POLICY_LOSSES:
        problems.append(f"{BLOCK}.policy_loss={policy_loss!r}: use one of {POLICY_LOSSES}")
    kl_coef = 0.0
    kl_estimator = "k3"
    if _get(actor, "use_kl_loss", False):
        kl_coef = float(_get(actor, "kl_loss_coef", 0.001))
        kl_type = _get(actor, "kl_loss_type", "low_var_kl")
        if kl_type not in KL_TYPES:
            problems.append(f"{ACTOR}.kl_loss_type={kl_type!r} has no estimator here: use one of {sorted(KL_TYPES)}")
        kl_estimator = KL_TYPES.get(kl_type, "k3")
    if problems:
        raise VerlConfigError("megatron_pg_agg's verl plug-in cannot run this configuration:\n  - "
                              + "\n  - ".join(problems))
    clip_c = _get(actor, "clip_ratio_c")
    try:
        return PGLossConfig(
            mode=mode, divisor=divisor, policy_loss=policy_loss,
            clip_eps_low=float(_get(actor, "clip_ratio_low", 0.2)),
            clip_eps_high=float(_get(actor, "clip_ratio_high", 0.2)),
            dual_clip=float(clip_c) if policy_loss == "ppo" and clip_c is not None else None,
            kl_coef=kl_coef, kl_estimator=kl_estimator,
            entropy_coef=float(_get(actor, "entropy_coeff", 0.0)), report_entropy=False,
            rollout_correction=block.get("rollout_correction"),
            rollout_correction_max=float(block.get("rollout_correction_max", 2.0)),
            rollout_correction_min=float(block.get("rollout_correction_min", 0.0)),
        )
    except (TypeError, ValueError) as exc:
        raise VerlConfigError(f"megatron_pg_agg's verl plug-in: {exc} (keys: {BLOCK}.*, "
                              f"{ACTOR}.clip_ratio_low/high/c, entropy_coeff, kl_loss_coef)") from exc


MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""The HF ``config.json`` keys that give a model's routed experts (Qwen-MoE, Mixtral, DeepSeek, ...)."""


def _routed_experts(model_path: Any) -> Optional[int]:
    """The routed experts of the HF model at ``model_path`` (a local folder), 0 for a dense one,
    None when its config cannot be read here (a hub name, say)."""
    config = os.path.join(str(model_path), "config.json") if model_path else None
    if not config or not os.path.isfile(config):
        return None
    with open(config) as f:
        found = json.load(f)
    return max((int(found.get(k) or 0) for k in MOE_CONFIG_KEYS), default=0)


def engine_problems(worker_config: Any) -> list:
    """What the plug-in refuses in verl's Megatron engine settings (``actor_rollout_ref``), each
    naming its key. Megatron-LM #7452 finding 10: with ``actor.megatron.dynamic_context_parallel``
    verl passes a router padding mask to the model, and megatron-core 0.16 to 0.19's
    ``get_tokens_per_expert_and_token_count`` then all-reduces the local token count in place,
    multiplying the MoE aux-loss gradient by the TP x CP group size (fix PR #7481, open). A
    dense model, or the default ``dynamic_context_parallel: false`` (no mask), is exact. And
    Megatron-FSDP (:func:`megatron_fsdp_problems`), refused as on every entry."""
    actor = _get(worker_config, "actor")
    megatron = _get(actor, "megatron")
    problems = megatron_fsdp_problems(ACTOR, actor)
    if not _get(megatron, "dynamic_context_parallel", False):
        return problems
    experts = _routed_experts(_get(_get(worker_config, "model"), "path"))
    if experts == 0:
        return problems
    model = "a MoE model" if experts else "a model whose config.json cannot be read here (MoE unknown)"
    return problems + [
        f"{ACTOR}.megatron.dynamic_context_parallel=True with {model}: verl passes a router padding mask, "
        "and megatron-core 0.16-0.19 then multiply the MoE aux-loss gradient by the TP x CP size "
        "(Megatron-LM #7452, finding 10; fix PR #7481). Set it to False (or train a dense model)"]


def megatron_fsdp_problems(key: str, node: Any) -> list:
    """verl's ``<key>.megatron.use_megatron_fsdp`` (its engine wraps the model in Megatron-FSDP):
    refused as on the Megatron-LM and Megatron-Bridge entries (Megatron-LM #7452 finding 12, and the
    per-token loss contract is verified with megatron-core's DDP only). verl has no switch that
    reaches torch FSDP2: its engine never passes ``use_torch_fsdp2`` to Megatron-Bridge's
    ``provide_distributed_model``, and megatron-core's DDP config (``override_ddp_config``) has no
    such field."""
    if not _get(_get(node, "megatron"), "use_megatron_fsdp", False):
        return []
    return [f"{key}.megatron.use_megatron_fsdp=True: a Megatron-FSDP checkpoint saved at one pipeline size loads the "
            "wrong layers at another without an error (Megatron-LM #7452, finding 12), and the per-token loss "
            "contract is verified with megatron-core's DDP only; set it to False (megatron-core's DDP, optionally "
            f"{key}.megatron.use_distributed_optimizer=True)"]


# ------------------------------------------------------------------------------------------ the critic

CRITIC = "critic"
"""verl's critic node (its ``CriticConfig``): ``critic.loss_agg_mode`` is the value term's mode."""


def _set(node: Any, key: str, value) -> None:
    if isinstance(node, Mapping):
        node[key] = value
    else:
        setattr(node, key, value)


def _strategy_problem(critic: Any, agg: str) -> list:
    strategy = _get(critic, "strategy", "megatron")
    if strategy == "megatron":
        return megatron_fsdp_problems(CRITIC, critic)
    return [f"{CRITIC}.strategy={strategy!r}: the plug-in's critic ({CRITIC}.loss_agg_mode={agg!r}) runs in verl's "
            "Megatron engine (strategy megatron); a verl loss_agg_mode keeps verl's critic"]


def value_config_from_critic(critic: Any) -> Optional[ValueLossConfig]:
    """The plug-in's value loss for verl's critic configuration (the ``CriticConfig`` verl's critic
    worker receives in ``partial(value_loss, config=...)``, or the ``critic`` node): None when
    ``critic.loss_agg_mode`` is a verl name (verl's own ``value_loss`` runs, unchanged), else the
    :class:`ValueLossConfig` of that mode (one of ours) with verl's value loss: ``eps`` =
    ``critic.cliprange_value``, factor 0.5, L of constant = ``critic.loss_scale_factor``. Raises
    :class:`VerlConfigError` naming the ``critic.*`` keys."""
    agg = _get(critic, "loss_agg_mode", VERL_DEFAULT_AGG)
    if agg not in MODES:
        return None
    problems = []
    divisor = _get(critic, "loss_scale_factor") if agg == CONSTANT else None
    if agg == CONSTANT and divisor is None:
        problems.append(f"{CRITIC}.loss_agg_mode='constant' needs L: set {CRITIC}.loss_scale_factor (for example the "
                        "maximum response length)")
    problems += _strategy_problem(critic, agg)
    eps = _get(critic, "cliprange_value", 0.5)
    if not problems:
        try:
            return ValueLossConfig(mode=agg, divisor=divisor, clip_eps=float(eps), factor=0.5)
        except (TypeError, ValueError) as exc:
            problems.append(f"{exc} (keys: {CRITIC}.loss_agg_mode, {CRITIC}.loss_scale_factor, "
                            f"{CRITIC}.cliprange_value={eps!r})")
    raise VerlConfigError("megatron_pg_agg's verl plug-in cannot run this critic:\n  - " + "\n  - ".join(problems))


def _critic_mode(critic: Any, agg: str, problems: list) -> tuple[Optional[str], Optional[float]]:
    """``(canonical mode, L)`` of a ``critic.loss_agg_mode`` read like the actor's (ours, or verl's
    through the alias table) with the critic's ``loss_scale_factor``."""
    if agg in REFUSED_ALIASES:
        problems.append(f"{CRITIC}.loss_agg_mode={agg!r}: {REFUSED_ALIASES[agg].note}")
        return None, None
    mode = _canonical(agg)
    if mode is None:
        problems.append(f"{CRITIC}.loss_agg_mode={agg!r} is not a mode: use one of {list(MODES)} or a verl "
                        f"loss_agg_mode ({[k for k, a in ALIASES.items() if a.source == 'verl']})")
        return None, None
    divisor = ALIASES[agg].divisor if agg in ALIASES else None
    if mode == CONSTANT and divisor is None:
        divisor = _get(critic, "loss_scale_factor")
        if divisor is None:
            problems.append(f"{CRITIC}.loss_agg_mode={agg!r} needs L: set {CRITIC}.loss_scale_factor (for example "
                            "the maximum response length); verl's fallback, the padded width of each micro-batch, "
                            "changes with the micro-batch split and is not used")
    return mode, divisor


def critic_for_run(config: Any, use_critic: bool) -> Optional[str]:
    """The critic's mode for a verl run, settled at start-up on the whole trainer ``config`` (verl's
    ``validate_config`` calls it through the engine patch; the critic worker sees only its own
    ``CriticConfig``, so the mode travels in ``critic.loss_agg_mode``). Returns what it set (a line
    for the log), or None when nothing changed.

    * The actor on the plug-in (``actor.policy_loss.loss_mode=pg_agg``): the critic is on it too.
      ``critic.loss_agg_mode`` equal to ``actor.loss_agg_mode`` (verl's default: it interpolates
      it) means the policy's mode, ``pg_agg.mode`` included; any other value is read like the
      actor's (ours, or verl's through the alias table, L from ``critic.loss_scale_factor``).
      The canonical mode (and L for constant) is written into ``critic.loss_agg_mode``
      (``critic.loss_scale_factor``).
    * Otherwise the critic is on the plug-in only when ``critic.loss_agg_mode`` names one of ours.

    Raises :class:`VerlConfigError` listing the problems, each naming its key."""
    if not use_critic:
        return None
    worker = _get(config, "actor_rollout_ref")
    actor, critic = _get(worker, "actor"), _get(config, CRITIC)
    agg = _get(critic, "loss_agg_mode", VERL_DEFAULT_AGG)
    if _get(_get(actor, "policy_loss"), "loss_mode") != LOSS_MODE:
        value_config_from_critic(critic)  # ours: checked now; verl's: None, verl's critic
        return None
    problems = []
    if agg == _get(actor, "loss_agg_mode", VERL_DEFAULT_AGG):
        policy = loss_config_from_verl(actor, _get(worker, "pg_agg"))
        mode, divisor = policy.mode, policy.divisor
        why = f"the policy's mode ({ACTOR}.policy_loss.loss_mode={LOSS_MODE!r})"
    else:
        mode, divisor = _critic_mode(critic, agg, problems)
        why = f"{CRITIC}.loss_agg_mode={agg!r}"
    problems += _strategy_problem(critic, agg)
    if problems:
        raise VerlConfigError("megatron_pg_agg's verl plug-in cannot run this critic:\n  - " + "\n  - ".join(problems))
    before = (agg, _get(critic, "loss_scale_factor"))
    _set(critic, "loss_agg_mode", mode)
    if mode == CONSTANT:
        _set(critic, "loss_scale_factor", int(divisor) if float(divisor).is_integer() else float(divisor))
    value_config_from_critic(critic)
    if (mode, _get(critic, "loss_scale_factor")) == before:
        return None  # already settled (verl's v0 trainer checks the config twice)
    return (f"{CRITIC}.loss_agg_mode={mode}" + (f", {CRITIC}.loss_scale_factor={divisor:g}" if mode == CONSTANT else "")
            + f": {why}, exact under megatron_pg_agg")
