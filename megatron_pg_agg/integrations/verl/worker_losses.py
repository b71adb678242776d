"""The losses verl's workers train with under the plug-in: the actor's (:func:`worker_loss`) and the critic's
(:func:`critic_loss`), built from verl's own config nodes and checked before any step.

The engine patch (:mod:`.engine_patch`) calls them from the wrapped ``init_model`` and ``set_loss_fn``; the
plug-in (:mod:`.plugin`) records here whether that patch could be applied in this process
(:func:`record_engine_patch`), so a worker that would silently train with verl's per-micro-batch loss
refuses instead, saying why.
"""
from __future__ import annotations

from typing import Optional

from megatron_pg_agg.integrations.verl.config import ACTOR, LOSS_MODE, _get, engine_problems, loss_config_from_verl

_NOT_APPLIED: Optional[str] = None
"""Why the engine patch could not be applied in this process (None: applied, or not tried)."""


def record_engine_patch(problem: Optional[str]) -> None:
    """Record why the engine patch could not be applied in this process (None: it is applied)."""
    global _NOT_APPLIED
    _NOT_APPLIED = problem


def engine_patch_problem() -> Optional[str]:
    """Why the engine patch could not be applied in this process (None: applied, or not tried)."""
    return _NOT_APPLIED


def worker_loss(worker_config, role: str = "actor", distillation: bool = False):
    """The loss an ``ActorRolloutRefWorker`` with ``worker_config`` (verl's ``actor_rollout_ref``
    node) trains with: a :class:`VerlPGLoss` when ``actor.policy_loss.loss_mode`` is ``pg_agg``
    and the worker has an actor, else None (verl's own loss). Raises
    :class:`~megatron_pg_agg.integrations.verl.config.VerlConfigError` naming the verl keys."""
    from megatron_pg_agg.integrations.verl.config import VerlConfigError  # noqa: PLC0415
    from megatron_pg_agg.integrations.verl.loss import VerlPGLoss  # noqa: PLC0415

    actor = _get(worker_config, "actor")
    if "actor" not in role or _get(_get(actor, "policy_loss"), "loss_mode") != LOSS_MODE:
        return None
    if _NOT_APPLIED is not None:
        raise VerlConfigError(f"{ACTOR}.policy_loss.loss_mode={LOSS_MODE!r}, but the plug-in's engine patch is not "
                              f"applied: {_NOT_APPLIED}")
    if distillation:
        raise VerlConfigError(f"{ACTOR}.policy_loss.loss_mode={LOSS_MODE!r} with distillation: verl's distillation "
                              "loss replaces the policy loss; the plug-in does not combine them")
    strategy = _get(actor, "strategy")
    if strategy != "megatron":
        raise VerlConfigError(f"{ACTOR}.strategy={strategy!r}: the plug-in runs in verl's Megatron engine "
                              "(strategy megatron)")
    engine = engine_problems(worker_config)
    if engine:
        raise VerlConfigError("megatron_pg_agg's verl plug-in cannot run this configuration:\n  - "
                              + "\n  - ".join(engine))
    return VerlPGLoss(loss_config_from_verl(actor, _get(worker_config, "pg_agg")))


def critic_loss(loss_fn, engine=None):
    """The loss verl's critic worker (a ``TrainingWorker`` of ``engine``) trains with, given the one
    verl sets on it: for verl's ``partial(value_loss, config=CriticConfig)`` whose
    ``critic.loss_agg_mode`` names one of the plug-in's modes, a :class:`VerlValueLoss` of that mode
    (:func:`~megatron_pg_agg.integrations.verl.config.value_config_from_critic`); anything else (verl's
    names, the actor's losses) unchanged. Raises :class:`VerlConfigError` naming the ``critic.*``
    keys, at the worker's ``set_loss_fn``, before any step."""
    import functools  # noqa: PLC0415

    from verl.workers.utils import losses  # noqa: PLC0415

    from megatron_pg_agg.integrations.verl.config import CRITIC, VerlConfigError, value_config_from_critic  # noqa: PLC0415
    from megatron_pg_agg.integrations.verl.loss import VerlValueLoss  # noqa: PLC0415

    if not (isinstance(loss_fn, functools.partial) and loss_fn.func is losses.value_loss and not loss_fn.args):
        return loss_fn
    critic = loss_fn.keywords.get("config")
    value_cfg = value_config_from_critic(critic)
    if value_cfg is None:
        return loss_fn
    prefix = f"{CRITIC}.loss_agg_mode={value_cfg.mode!r} (the plug-in's critic)"
    if _NOT_APPLIED is not None:
        raise VerlConfigError(f"{prefix}, but the plug-in's engine patch is not applied: {_NOT_APPLIED}")
    if engine is not None:
        from verl.workers.engine.megatron.transformer_impl import MegatronEngine  # noqa: PLC0415

        if not isinstance(engine, MegatronEngine):
            raise VerlConfigError(f"{prefix} runs in verl's Megatron engine ({CRITIC}.strategy=megatron); this "
                                  f"critic's engine is {type(engine).__name__}")
    return VerlValueLoss(value_cfg)
