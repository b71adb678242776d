"""verl's Megatron engine: the step weights before the micro-batch split, and the workers' losses.

WHY
    verl's engine (``MegatronEngine.forward_backward_batch``, verl 0.9) receives one mini-batch per
    optimizer step on each DP rank and cuts it into micro-batches itself (fixed size or dynamic by
    tokens) before the first loss call. The exact objective needs the step's token weights computed
    once on the whole mini-batch (``megatron_pg_agg.integrations.verl.loss``), and verl has no hook
    between receiving the mini-batch and splitting it. The worker that owns the actor
    (``ActorRolloutRefWorker.init_model``) builds its loss as ``partial(ppo_loss, config=actor)``,
    which calls a registered policy loss per micro-batch with the response fields only, so a
    registered policy loss alone cannot see the step's weights; verl's own ``set_loss_fn`` is
    the seam for a whole loss function. verl's critic is a ``TrainingWorker`` of its own whose loss
    arrives through the same ``set_loss_fn`` as ``partial(value_loss, config=CriticConfig)``, and
    it sees only its own config: the critic's mode is settled on the whole trainer config at
    verl's start-up check (``validate_config``) and travels in ``critic.loss_agg_mode``.

HOW (wrappers only, never a copy of an upstream function)
    * ``MegatronEngine.forward_backward_batch``: when the loss function is one of the plug-in's
      (:class:`~megatron_pg_agg.integrations.verl.loss.VerlStepLoss`: the actor's ``VerlPGLoss``,
      the critic's ``VerlValueLoss``) and the call trains (``forward_only`` false),
      ``loss_function.prepare_step(data, dp_group)`` runs first, then the original. Any other loss
      (verl's own, a log-prob or value pass) goes straight through.
    * ``ActorRolloutRefWorker.init_model``: when ``actor.policy_loss.loss_mode`` is ``pg_agg``, the
      configuration is checked first (a wrong one fails before any model is built, naming its
      verl keys), the original runs, and the worker's loss is then set through verl's own
      ``set_loss_fn``. With any other loss_mode the original runs alone.
    * ``TrainingWorker.train_mini_batch`` (the actor's and the critic's steps over one rollout): under a
      prompt_mean loss of the plug-in, :func:`~megatron_pg_agg.integrations.verl.groups.check_worker_steps`
      first refuses steps that would cut a prompt group (whatever driver built the batch); then the original.
    * ``TrainingWorker.set_loss_fn``: verl's ``partial(value_loss, config=CriticConfig)`` whose
      ``critic.loss_agg_mode`` names one of the plug-in's modes becomes a ``VerlValueLoss`` (a
      critic engine other than Megatron is refused); any other loss is set unchanged.
    * ``verl.utils.config.validate_config`` (verl's start-up check of the whole trainer config, on
      the driver): with a critic, :func:`~megatron_pg_agg.integrations.verl.config.critic_for_run`
      first (the actor on the plug-in puts the critic on it, by default in the policy's mode; a
      critic it cannot make exact is refused naming ``critic.*`` keys), then the original.
      Callers bind it by name after ``import verl``, which loads the plug-in first. Then what would
      cut a prompt_mean group across optimizer steps is refused, naming its keys
      (:func:`~megatron_pg_agg.integrations.verl.groups.group_problems`), and a run with a
      prompt_mean term gets :data:`TRAINER_PATCH` (below) in that process.
    * ``RayPPOTrainer._balance_batch`` (verl's v0 trainer, ``trainer.balance_batch``;
      :data:`TRAINER_PATCH`, applied by the start-up check above, in the processes that validate a
      prompt_mean run: verl's driver and its TaskRunner, which builds the trainer, never the
      workers): :func:`~megatron_pg_agg.integrations.verl.groups.balance_whole_groups` reorders the
      rollout in its place so that every optimizer step holds whole groups; otherwise the original.

TARGETS (verl 0.9.x; megatron-core 0.19, the release verl 0.9.1 was tested with here)
    ``verl.workers.engine.megatron.transformer_impl.MegatronEngine.forward_backward_batch``,
    ``verl.workers.engine_workers.ActorRolloutRefWorker.init_model``,
    ``verl.workers.engine_workers.TrainingWorker.set_loss_fn`` and ``.train_mini_batch`` (verl's
    ``@register`` attributes kept: the wrapper copies the original's ``__dict__``),
    ``verl.utils.config.validate_config``, ``verl.trainer.ppo.ray_trainer.RayPPOTrainer._balance_batch``.
    Any device.
"""
from __future__ import annotations

import inspect

from megatron_pg_agg.patches._machinery import Patch, Target, require_distribution

NAME = "verl_engine"
SUPPORTED = ">=0.19,<0.20"
SUPPORTED_VERL = ">=0.9,<0.10"
ENGINE = "verl.workers.engine.megatron.transformer_impl"
WORKERS = "verl.workers.engine_workers"
CONFIG = "verl.utils.config"
TRAINER = "verl.trainer.ppo.ray_trainer"


def _require_verl() -> None:
    from megatron_pg_agg.versions import distribution_version  # noqa: PLC0415

    require_distribution(NAME, "verl", distribution_version("verl"), SUPPORTED_VERL)


def _make_forward_backward_batch(original):
    signature = inspect.signature(original)

    def forward_backward_batch(self, *args, **kwargs):
        from megatron_pg_agg.integrations.verl.loss import VerlStepLoss  # noqa: PLC0415

        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        loss_function = bound.arguments["loss_function"]
        if isinstance(loss_function, VerlStepLoss) and not bound.arguments["forward_only"]:
            loss_function.prepare_step(bound.arguments["data"], self.get_data_parallel_group())
        return original(*bound.args, **bound.kwargs)

    return forward_backward_batch


def _make_init_model(original):
    def init_model(self, *args, **kwargs):
        from megatron_pg_agg.integrations.verl.worker_losses import worker_loss  # noqa: PLC0415

        loss = worker_loss(self.config, getattr(self, "role", ""), getattr(self, "distillation_enabled", False))
        out = original(self, *args, **kwargs)
        if loss is not None:
            self.set_loss_fn(loss)
        return out

    return init_model


def _make_set_loss_fn(original):
    signature = inspect.signature(original)

    def set_loss_fn(self, *args, **kwargs):
        from megatron_pg_agg.integrations.verl.worker_losses import critic_loss  # noqa: PLC0415

        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["loss_fn"] = critic_loss(bound.arguments["loss_fn"], getattr(self, "engine", None))
        return original(*bound.args, **bound.kwargs)

    return set_loss_fn


def _make_train_mini_batch(original):
    signature = inspect.signature(original)

    def train_mini_batch(self, *args, **kwargs):
        from megatron_pg_agg.integrations.verl.groups import check_worker_steps  # noqa: PLC0415

        bound = signature.bind(self, *args, **kwargs)
        check_worker_steps(self, bound.arguments["data"])
        return original(*bound.args, **bound.kwargs)

    return train_mini_batch


def _make_validate_config(original):
    signature = inspect.signature(original)

    def validate_config(*args, **kwargs):
        from megatron_pg_agg.integrations.verl.config import VerlConfigError, critic_for_run  # noqa: PLC0415
        from megatron_pg_agg.integrations.verl.groups import group_problems, group_terms  # noqa: PLC0415

        bound = signature.bind(*args, **kwargs)
        config, use_critic = bound.arguments["config"], bound.arguments["use_critic"]
        note = critic_for_run(config, use_critic)
        if note:
            print(f"[megatron_pg_agg] {note}", flush=True)
        problems = group_problems(config, use_critic)
        if problems:
            raise VerlConfigError("megatron_pg_agg's verl plug-in cannot keep prompt groups whole:\n  - "
                                  + "\n  - ".join(problems))
        if group_terms(config, use_critic):
            apply_trainer_patch()
        return original(*args, **kwargs)

    return validate_config


def apply_trainer_patch() -> None:
    """:data:`TRAINER_PATCH` in this process (idempotent); a trainer that cannot be patched is refused."""
    from megatron_pg_agg.integrations.verl.config import VerlConfigError  # noqa: PLC0415
    from megatron_pg_agg.patches import _machinery  # noqa: PLC0415

    try:
        _machinery.apply(TRAINER_PATCH)
    except (ImportError, RuntimeError) as exc:
        raise VerlConfigError(f"prompt_mean needs whole prompt groups in every optimizer step, and the plug-in could "
                              f"not patch verl's trainer ({TRAINER}.RayPPOTrainer._balance_batch): {exc}") from exc


def _make_balance_batch(original):
    signature = inspect.signature(original)

    def _balance_batch(self, *args, **kwargs):
        from megatron_pg_agg.integrations.verl.groups import balance_whole_groups  # noqa: PLC0415

        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if balance_whole_groups(self, bound.arguments["batch"], bound.arguments["metrics"],
                                bound.arguments["logging_prefix"]):
            return None
        return original(*bound.args, **bound.kwargs)

    return _balance_batch


PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    precondition=_require_verl,
    targets=(Target(ENGINE, "MegatronEngine.forward_backward_batch", _make_forward_backward_batch),
             Target(WORKERS, "ActorRolloutRefWorker.init_model", _make_init_model),
             Target(WORKERS, "TrainingWorker.set_loss_fn", _make_set_loss_fn),
             Target(WORKERS, "TrainingWorker.train_mini_batch", _make_train_mini_batch),
             Target(CONFIG, "validate_config", _make_validate_config)),
    unsupported_reason="verl 0.9.1 was tested here with megatron-core 0.19.2; install 0.19.x.",
)

TRAINER_PATCH = Patch(
    name="verl_trainer_groups",
    supported=SUPPORTED,
    why=__doc__,
    precondition=_require_verl,
    targets=(Target(TRAINER, "RayPPOTrainer._balance_batch", _make_balance_batch),),
    unsupported_reason="verl 0.9.1 was tested here with megatron-core 0.19.2; install 0.19.x.",
)
"""verl's v0 trainer balancing whole prompt groups: applied by the start-up check of a prompt_mean run only
(verl's trainer module imports its rollout servers: never in the workers)."""
