"""The verl plug-in: ``actor.policy_loss.loss_mode=pg_agg`` makes verl's Megatron engine exact.

Loaded by verl itself in every process that imports it: through the ``verl.plugins`` entry point
this package installs (verl's default ``VERL_USE_EXTERNAL_PLUGINS=auto``), or by naming it in
``VERL_USE_EXTERNAL_MODULES=megatron_pg_agg.integrations.verl_plugin``. Loading it

* registers ``pg_agg`` in verl's policy-loss registry, so that verl's configuration accepts the
  name. verl never calls it while the plug-in works: the worker's whole loss is replaced (below);
  if it is called, the engine patch is not in place and it raises saying why;
* applies the ``verl_engine`` patch (:mod:`megatron_pg_agg.patches.verl_engine`): the actor
  worker checks the configuration at ``init_model`` (before building anything) and sets
  :class:`~megatron_pg_agg.integrations.verl_loss.VerlPGLoss` as its loss; the engine computes the
  step weights on each mini-batch before splitting it;
* the critic: verl's start-up check settles the critic's mode on the whole config (by default the
  policy's, when the actor is on the plug-in: :func:`~megatron_pg_agg.integrations.verl_config.
  critic_for_run`), and the critic worker's ``set_loss_fn`` turns verl's ``value_loss`` into a
  :class:`~megatron_pg_agg.integrations.verl_loss.VerlValueLoss` when ``critic.loss_agg_mode``
  names one of the plug-in's modes (:func:`critic_loss`).

With any other loss_mode and a verl ``critic.loss_agg_mode`` nothing changes in verl. The
configuration: docs/verl.md.
"""
from __future__ import annotations

from typing import Optional

from .verl_config import ACTOR, BLOCK, LOSS_MODE, _get, engine_problems, loss_config_from_verl

_NOT_APPLIED: Optional[str] = None
"""Why the engine patch could not be applied in this process (None: applied, or not tried)."""


def worker_loss(worker_config, role: str = "actor", distillation: bool = False):
    """The loss an ``ActorRolloutRefWorker`` with ``worker_config`` (verl's ``actor_rollout_ref``
    node) trains with: a :class:`VerlPGLoss` when ``actor.policy_loss.loss_mode`` is ``pg_agg``
    and the worker has an actor, else None (verl's own loss). Raises
    :class:`~megatron_pg_agg.integrations.verl_config.VerlConfigError` naming the verl keys."""
    from .verl_config import VerlConfigError  # noqa: PLC0415
    from .verl_loss import VerlPGLoss  # noqa: PLC0415

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
    (:func:`~megatron_pg_agg.integrations.verl_config.value_config_from_critic`); anything else (verl's
    names, the actor's losses) unchanged. Raises :class:`VerlConfigError` naming the ``critic.*``
    keys, at the worker's ``set_loss_fn``, before any step."""
    import functools  # noqa: PLC0415

    from verl.workers.utils import losses  # noqa: PLC0415

    from .verl_config import CRITIC, VerlConfigError, value_config_from_critic  # noqa: PLC0415
    from .verl_loss import VerlValueLoss  # noqa: PLC0415

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


def _unpatched_policy_loss(*args, **kwargs):
    raise RuntimeError(
        f"verl called the registered policy loss {LOSS_MODE!r} per micro-batch: the plug-in's engine patch did not "
        f"replace the worker's loss ({_NOT_APPLIED or 'not an ActorRolloutRefWorker of verl Megatron engine'}). "
        f"The {LOSS_MODE!r} objective needs the step weights of the whole mini-batch; it runs only through "
        f"megatron_pg_agg.integrations.verl_plugin in verl's Megatron engine ({BLOCK}: docs/verl.md)")


def apply_verl_plugin() -> Optional[str]:
    """Register ``pg_agg`` and apply the engine patch (idempotent). Returns None when applied,
    else the reason it could not be (kept, and raised at the actor's ``init_model``)."""
    global _NOT_APPLIED
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss  # noqa: PLC0415

    if LOSS_MODE not in POLICY_LOSS_REGISTRY:
        register_policy_loss(LOSS_MODE)(_unpatched_policy_loss)
    try:
        from megatron_pg_agg.patches import apply_megatron_patches  # noqa: PLC0415

        apply_megatron_patches(cpu_gloo=False, verl_engine=True)
        _NOT_APPLIED = None
    except (ImportError, RuntimeError) as exc:
        _NOT_APPLIED = str(exc)
    return _NOT_APPLIED


apply_verl_plugin()
