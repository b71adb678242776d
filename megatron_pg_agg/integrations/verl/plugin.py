"""The verl plug-in: ``actor.policy_loss.loss_mode=pg_agg`` makes verl's Megatron engine exact.

Loaded by verl itself in every process that imports it: through the ``verl.plugins`` entry point
this package installs (verl's default ``VERL_USE_EXTERNAL_PLUGINS=auto``), or by naming it in
``VERL_USE_EXTERNAL_MODULES=megatron_pg_agg.integrations.verl.plugin``. Loading it

* registers ``pg_agg`` in verl's policy-loss registry, so that verl's configuration accepts the
  name. verl never calls it while the plug-in works: the worker's whole loss is replaced (below);
  if it is called, the engine patch is not in place and it raises saying why;
* applies the ``verl_engine`` patch (:mod:`megatron_pg_agg.integrations.verl.engine_patch`): the actor
  worker checks the configuration at ``init_model`` (before building anything) and sets
  :class:`~megatron_pg_agg.integrations.verl.loss.VerlPGLoss` as its loss; the engine computes the
  step weights on each mini-batch before splitting it;
* the critic: verl's start-up check settles the critic's mode on the whole config (by default the
  policy's, when the actor is on the plug-in: :func:`~megatron_pg_agg.integrations.verl.config.
  critic_for_run`), and the critic worker's ``set_loss_fn`` turns verl's ``value_loss`` into a
  :class:`~megatron_pg_agg.integrations.verl.loss.VerlValueLoss` when ``critic.loss_agg_mode``
  names one of the plug-in's modes (:func:`critic_loss`).

With any other loss_mode and a verl ``critic.loss_agg_mode`` nothing changes in verl. The
configuration: docs/verl.md.
"""
from __future__ import annotations

from typing import Optional

from megatron_pg_agg.integrations.verl import engine_patch
from megatron_pg_agg.integrations.verl.config import BLOCK, LOSS_MODE
from megatron_pg_agg.integrations.verl.worker_losses import engine_patch_problem, record_engine_patch
from megatron_pg_agg.patches import _machinery


def _unpatched_policy_loss(*args, **kwargs):
    raise RuntimeError(
        f"verl called the registered policy loss {LOSS_MODE!r} per micro-batch: the plug-in's engine patch did not "
        f"replace the worker's loss "
        f"({engine_patch_problem() or 'not an ActorRolloutRefWorker of verl Megatron engine'}). "
        f"The {LOSS_MODE!r} objective needs the step weights of the whole mini-batch; it runs only through "
        f"megatron_pg_agg.integrations.verl.plugin in verl's Megatron engine ({BLOCK}: docs/verl.md)")


def apply_verl_plugin() -> Optional[str]:
    """Register ``pg_agg`` and apply the engine patch (idempotent). Returns None when applied,
    else the reason it could not be (kept, and raised at the actor's ``init_model``)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss  # noqa: PLC0415

    if LOSS_MODE not in POLICY_LOSS_REGISTRY:
        register_policy_loss(LOSS_MODE)(_unpatched_policy_loss)
    try:
        _machinery.apply(engine_patch.PATCH)
        problem = None
    except (ImportError, RuntimeError) as exc:
        problem = str(exc)
    record_engine_patch(problem)
    return problem


apply_verl_plugin()
