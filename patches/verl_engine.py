"""verl's Megatron engine: the step weights before the micro-batch split, and the worker's loss.

WHY
    verl's engine (``MegatronEngine.forward_backward_batch``, verl 0.9) receives one mini-batch per
    optimizer step on each DP rank and cuts it into micro-batches itself (fixed size or dynamic by
    tokens) before the first loss call. The exact objective needs the step's token weights computed
    once on the whole mini-batch (``megatron_pg_agg.integrations.verl_loss``), and verl has no hook
    between receiving the mini-batch and splitting it. The worker that owns the actor
    (``ActorRolloutRefWorker.init_model``) builds its loss as ``partial(ppo_loss, config=actor)``,
    which calls a registered policy loss per micro-batch with the response fields only, so a
    registered policy loss alone cannot see the step's weights; verl's own ``set_loss_fn`` is
    the seam for a whole loss function.

HOW (wrappers only, never a copy of an upstream function)
    * ``MegatronEngine.forward_backward_batch``: when the loss function is a
      :class:`~megatron_pg_agg.integrations.verl_loss.VerlPGLoss` and the call trains
      (``forward_only`` false), ``loss_function.prepare_step(data, dp_group)`` runs first, then the
      original. Any other loss (verl's own, a critic's, a log-prob pass) goes straight through.
    * ``ActorRolloutRefWorker.init_model``: when ``actor.policy_loss.loss_mode`` is ``pg_agg``, the
      configuration is checked first (a wrong one fails before any model is built, naming its
      verl keys), the original runs, and the worker's loss is then set through verl's own
      ``set_loss_fn``. With any other loss_mode the original runs alone.

TARGETS (verl 0.9.x; megatron-core 0.19, the release verl 0.9.1 was tested with here)
    ``verl.workers.engine.megatron.transformer_impl.MegatronEngine.forward_backward_batch``,
    ``verl.workers.engine_workers.ActorRolloutRefWorker.init_model``. Any device.
"""
from __future__ import annotations

import inspect

from ._machinery import Patch, Target

NAME = "verl_engine"
SUPPORTED = ">=0.19,<0.20"
SUPPORTED_VERL = ">=0.9,<0.10"
ENGINE = "verl.workers.engine.megatron.transformer_impl"
WORKERS = "verl.workers.engine_workers"


def _require_verl() -> None:
    from megatron_pg_agg.versions import distribution_version, in_range  # noqa: PLC0415

    version = distribution_version("verl")
    if version is None or not in_range(version, SUPPORTED_VERL):
        raise RuntimeError(f"patch 'verl_engine' supports verl {SUPPORTED_VERL!r}, but "
                           f"{'none' if version is None else version} is installed; nothing was patched.")


def _make_forward_backward_batch(original):
    signature = inspect.signature(original)

    def forward_backward_batch(self, *args, **kwargs):
        from megatron_pg_agg.integrations.verl_loss import VerlPGLoss  # noqa: PLC0415

        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        loss_function = bound.arguments["loss_function"]
        if isinstance(loss_function, VerlPGLoss) and not bound.arguments["forward_only"]:
            loss_function.prepare_step(bound.arguments["data"], self.get_data_parallel_group())
        return original(*bound.args, **bound.kwargs)

    return forward_backward_batch


def _make_init_model(original):
    def init_model(self, *args, **kwargs):
        from megatron_pg_agg.integrations.verl_plugin import worker_loss  # noqa: PLC0415

        loss = worker_loss(self.config, getattr(self, "role", ""), getattr(self, "distillation_enabled", False))
        out = original(self, *args, **kwargs)
        if loss is not None:
            self.set_loss_fn(loss)
        return out

    return init_model


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    precondition=_require_verl,
    targets=(Target(ENGINE, "MegatronEngine.forward_backward_batch", _make_forward_backward_batch),
             Target(WORKERS, "ActorRolloutRefWorker.init_model", _make_init_model)),
    unsupported_reason="verl 0.9.1 was tested here with megatron-core 0.19.2; install 0.19.x.",
)
