"""Megatron-Bridge's own training loop (``megatron.bridge.training.pretrain`` / ``finetune``) with
the project's objective.

    from megatron.bridge.training.pretrain import pretrain
    from megatron_pg_agg import PGLossConfig
    from megatron_pg_agg.integrations.bridge.loop import use_pg_loss

    cfg = my_recipe()   # a ConfigContainer: Bridge model provider, optimizer, scheduler, checkpoints ...
    forward_step, callbacks = use_pg_loss(cfg, PGLossConfig(mode="prompt_mean"), rollouts="steps.jsonl")
    pretrain(cfg, forward_step, callbacks=callbacks)

WHY
    Megatron-Bridge users train from a ``ConfigContainer`` recipe inside Bridge's loop (its
    optimizer and scheduler set-up, checkpoints, logging, fault tolerance). That loop calls
    megatron-core's forward-backward schedule with the recipe's ``calculate_per_token_loss``,
    reduces the ``[sum, count]`` report pairs over DP x CP and divides the gradients by the summed
    count in ``finalize_model_grads``: the same contract as Megatron-LM's ``pretrain()``. So the
    project's pieces plug in unchanged, as in :mod:`megatron_pg_agg.training.megatron_lm`:

    * the data: ``cfg.dataset`` becomes :class:`RolloutDataset` (``dataloader_type="external"``):
      per optimizer step, rollout step ``iteration mod S`` is planned on the host by the planner
      into exactly Bridge's ``get_num_microbatches()`` THD microbatches per DP rank, with the step
      weights computed once on the whole step (:class:`~megatron_pg_agg.data.feed.RolloutFeed`);
    * the forward step: :class:`PGForwardStep` (:class:`~megatron_pg_agg.megatron.planned_step.PlannedForward`,
      the per-token loss of :mod:`megatron_pg_agg.megatron.loss_func`);
    * the record: :class:`PGRecordCallback` (on ``on_train_step_end``) logs the objective and
      writes one JSON line per iteration (``iteration_record``, as the other entries).

    :func:`use_pg_loss` refuses, listing every problem, a recipe that would optimise something
    else: ``calculate_per_token_loss`` off (a mean of microbatch means), a micro-batch size other
    than 1 (a microbatch is one packed THD row), gradients averaged in the DP collective,
    validation iterations (an actor step has no validation set), a vocabulary that would be
    padded. It sets what only the data path decides: the dataset, and on CPU the THD core attention
    of the layer spec, gloo, and the ``bridge_cpu`` / ``bridge_loop_cpu`` patches.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.integrations.bridge.hf_folder import bridge_install_problem
from megatron_pg_agg.megatron import upstream_bugs
from megatron_pg_agg.training.rollout_steps import load_steps
from megatron_pg_agg.training.run_config import DataConfig, StartupError

logger = logging.getLogger(__name__)

__all__ = ["PGForwardStep", "pg_recipe_problems", "use_pg_loss"]


def bridge_classes():
    """Megatron-Bridge's base classes, imported after the CPU patches (``megatron.bridge`` imports
    Transformer Engine's LoRA layers at its top)."""
    if not torch.cuda.is_available():
        from megatron_pg_agg.integrations.bridge.cpu import apply_bridge_cpu_patches  # noqa: PLC0415

        apply_bridge_cpu_patches(loop=True)
    from megatron.bridge.data.base import DatasetProvider  # noqa: PLC0415
    from megatron.bridge.training.callbacks import Callback  # noqa: PLC0415

    return DatasetProvider, Callback


def pg_recipe_problems(cfg) -> list:
    """Every reason the ``ConfigContainer`` ``cfg`` would not optimise the chosen objective in
    Bridge's loop; empty when it may run. Reads ``cfg`` only."""
    problems = []
    model, train = cfg.model, cfg.train
    if not getattr(model, "calculate_per_token_loss", False):
        problems.append("cfg.model.calculate_per_token_loss is False: Bridge's loop would divide each microbatch's "
                        "loss by its own count and average the microbatch means; set it to True")
    if train.micro_batch_size != 1:
        problems.append(f"cfg.train.micro_batch_size = {train.micro_batch_size}: a microbatch is one packed THD row "
                        "of whole sequences; set it to 1 (and the tokens per row with the planner's capacity)")
    if getattr(cfg.ddp, "average_in_collective", False):
        problems.append("cfg.ddp.average_in_collective is True: the gradients would be averaged over DP before "
                        "the division by the step's weight; set it to False")
    eval_iters = getattr(cfg.validation, "eval_iters", 0) or 0
    if eval_iters:
        problems.append(f"cfg.validation.eval_iters = {eval_iters}: an actor step has no validation set; set 0")
    if getattr(model, "should_pad_vocab", False):
        problems.append("cfg.model.should_pad_vocab is True: padded vocabulary rows add probability mass to every "
                        "softmax, so the log-probs are no longer the HF model's; set it to False")
    if getattr(model, "mtp_num_layers", None):
        problems.append("cfg.model.mtp_num_layers: multi-token prediction is not supported in Bridge's loop yet")
    problems.extend(upstream_bugs.bridge_recipe_problems(cfg))  # megatron-core's known silent bugs
    if not torch.cuda.is_available():
        backend = getattr(cfg.dist, "distributed_backend", "nccl")
        if backend != "gloo":
            problems.append(f"cfg.dist.distributed_backend = {backend!r} on a machine without CUDA: use 'gloo'")
        for name in ("bf16", "fp16"):
            if getattr(model, name, False):
                problems.append(f"cfg.model.{name} on CPU: megatron-core's mixed-precision optimizer wraps CUDA "
                                "tensors only")
    return problems


def use_pg_loss(cfg, loss_cfg: PGLossConfig, *, rollouts: Optional[str] = None, seed: int = 1234,
                metrics_file: Optional[str] = None) -> tuple:
    """Make the recipe ``cfg`` train the policy-gradient objective ``loss_cfg`` on ``rollouts``
    (a rollout JSON Lines file; None: the built-in synthetic set over the model's vocabulary,
    seeded by ``seed``). Returns ``(forward_step, callbacks)`` for
    ``pretrain(cfg, forward_step, callbacks=callbacks)``. Raises
    :class:`~megatron_pg_agg.training.run_config.StartupError` listing every problem
    (:func:`pg_recipe_problems`, the rollout file's format, token ids outside the vocabulary)."""
    problem = bridge_install_problem()
    if problem is not None:
        raise StartupError(problem)
    problems = pg_recipe_problems(cfg)
    if problems:
        raise StartupError(problems)
    DatasetProvider, Callback = bridge_classes()
    moe = bool(getattr(cfg.model, "num_moe_experts", None))
    from megatron_pg_agg.patches import apply_megatron_patches, rope_thd  # noqa: PLC0415

    # moe_aux_loss: the routers' aux/z losses keep Megatron's strength under every mode; rope_thd:
    # 0.19's unfused packed RoPE in one shot (patches/)
    apply_megatron_patches(cpu_gloo=False, moe_aux_loss=moe, rope_thd=rope_thd.needed())
    vocab = cfg.model.vocab_size
    steps = load_steps(DataConfig(rollouts=rollouts), loss_cfg, vocab_size=vocab, seed=seed)
    step = PGForwardStep(loss_cfg, moe=moe)
    # with PP and fixed p2p shapes every microbatch is padded to the recipe's sequence length
    fixed = cfg.model.pipeline_model_parallel_size > 1 and not cfg.model.variable_seq_lengths
    cfg.dataset = _dataset_class(DatasetProvider)(
        dataloader_type="external", num_workers=0, pin_memory=False, persistent_workers=False, steps=steps,
        loss_cfg=loss_cfg, vocab_size=vocab, sequence_parallel=bool(cfg.model.sequence_parallel),
        microbatch_tokens=cfg.model.seq_length if fixed else None, forward=step)
    if not torch.cuda.is_available():
        from megatron_pg_agg.integrations.bridge.hf_model import _layer_spec  # noqa: PLC0415

        cfg.model.transformer_layer_spec = _layer_spec  # the THD core attention on the local spec
    return step, [_record_class(Callback)(step, metrics_file)]


class PGForwardStep:
    """Bridge's forward step ``(state, data_iterator, model) -> (output, loss_func)`` over the
    planned microbatches (the iterator is :class:`RolloutDataset`'s)."""

    def __init__(self, loss_cfg: PGLossConfig, *, moe: bool):
        self.loss_cfg, self.moe = loss_cfg, moe
        self.feed = None
        """The run's :class:`~megatron_pg_agg.data.feed.RolloutFeed` (set when Bridge builds the data)."""
        self._forward = None
        self._start: Optional[int] = None

    def __call__(self, state, data_iterator, model):
        if self._forward is None:
            from megatron.core.utils import get_model_config  # noqa: PLC0415

            from megatron_pg_agg.megatron.config_checks import (  # noqa: PLC0415
                MegatronConfigError,
                check_megatron_config,
            )
            from megatron_pg_agg.megatron.planned_step import PlannedForward  # noqa: PLC0415

            try:
                check_megatron_config(get_model_config(model), getattr(model, "ddp_config", None))
            except MegatronConfigError as err:
                raise StartupError(str(err)) from err
            plan_cfg = self.feed.plan_cfg
            self._forward = PlannedForward(self.loss_cfg, cuda=torch.cuda.is_available(), moe=self.moe, mtp=False,
                                           num_microbatches=plan_cfg.num_microbatches, dp_size=plan_cfg.dp_size)
        if self._start is None:
            self._start = state.train_state.step  # the loaded iteration on a resume
        return self._forward(next(data_iterator), model)

    def items(self):
        """This rank's planned microbatches from the first step this run trains on."""
        if self._start is None:
            raise RuntimeError("the rollout iterator is read by PGForwardStep only")
        return self.feed.microbatches(self._start)


class _Items:
    """The iterator Bridge's loop holds: it starts at the first forward step (the loaded iteration
    is known there, not when Bridge builds the data)."""

    def __init__(self, step: PGForwardStep):
        self.step, self._it = step, None

    def __iter__(self):
        return self

    def __next__(self):
        if self._it is None:
            self._it = self.step.items()
        return next(self._it)


def _dataset_class(DatasetProvider):
    @dataclass(kw_only=True)
    class RolloutDataset(DatasetProvider):
        """``cfg.dataset``: the rollouts, planned per iteration (an external iterator)."""

        steps: dict = field(default_factory=dict, repr=False)
        """``{rollout step: RolloutBatch}``, checked and packed on the host."""
        loss_cfg: Any = None
        """The objective (``PGLossConfig``): the step weights."""
        vocab_size: Optional[int] = None
        """Token ids are checked against it when each step is planned."""
        sequence_parallel: bool = False
        """The recipe's sequence parallelism (microbatches are padded to a multiple of TP)."""
        microbatch_tokens: Optional[int] = None
        """Every microbatch padded to this length (PP with fixed p2p shapes); None: its own length."""
        forward: Any = field(default=None, repr=False)
        """The :class:`PGForwardStep` that reads the iterator."""

        def build_datasets(self, context):
            from megatron.core import parallel_state as mpu  # noqa: PLC0415
            from megatron.core.num_microbatches_calculator import get_num_microbatches  # noqa: PLC0415

            from megatron_pg_agg.data.feed import RolloutFeed  # noqa: PLC0415
            from megatron_pg_agg.data.planner import policy_loss_notes  # noqa: PLC0415

            if self.forward.feed is None:
                plan_cfg = DataConfig(num_microbatches=None).plan_config(
                    dp_size=mpu.get_data_parallel_world_size(), tp_size=mpu.get_tensor_model_parallel_world_size(),
                    sequence_parallel=self.sequence_parallel, cp_size=mpu.get_context_parallel_world_size(),
                    num_microbatches=get_num_microbatches(), vocab_size=self.vocab_size,
                    microbatch_tokens=self.microbatch_tokens)
                feed = RolloutFeed(self.steps, self.loss_cfg, plan_cfg, dp_rank=mpu.get_data_parallel_rank(),
                                   cp_rank=mpu.get_context_parallel_rank())
                problems = feed.problems()
                if problems:
                    raise StartupError([f"the rollouts do not fit the recipe ({plan_cfg.num_microbatches} "
                                        f"microbatches per DP rank, vocabulary {self.vocab_size}): {p}"
                                        for p in problems])
                for note in policy_loss_notes(self.steps, self.loss_cfg):
                    logger.info(f"note: {note}")
                self.forward.feed = feed
            return _Items(self.forward), None, None

    RolloutDataset.__qualname__ = RolloutDataset.__name__ = "RolloutDataset"
    return RolloutDataset



def _record_class(Callback):
    class PGRecordCallback(Callback):
        """Every rank, every iteration: the reduced report shared from the last rank, then rank 0
        logs the objective and appends a JSON line to ``metrics_file``."""

        def __init__(self, step: PGForwardStep, metrics_file: Optional[str]):
            self.step, self.metrics_file = step, metrics_file

        def on_train_step_end(self, context) -> None:
            import torch.distributed as dist  # noqa: PLC0415

            from megatron_pg_agg.megatron.planned_step import iteration_record  # noqa: PLC0415

            iteration = context.state.train_state.step  # 0-based: Bridge counts it up after the callbacks
            plan = self.step.feed.plan(iteration)
            record, _ = iteration_record(context.loss_dict or {}, plan, iteration=iteration + 1, mtp=False,
                                         cuda=torch.cuda.is_available())
            record.update(rollout_step=self.step.feed.step_key(iteration), grad_norm=context.grad_norm,
                          learning_rate=context.optimizer.param_groups[0]["lr"] if context.optimizer else None,
                          skipped=bool(context.skipped_iter))
            if dist.get_rank() != 0:
                return
            logger.info(f"[pg] iteration {record['iteration']} | objective {record['objective']:.6g} | weight "
                        f"{record['weight']} | grad_norm {record['grad_norm']:.6g}")
            if self.metrics_file:
                os.makedirs(os.path.dirname(os.path.abspath(self.metrics_file)), exist_ok=True)
                with open(self.metrics_file, "a") as f:
                    f.write(json.dumps(record) + "\n")

    return PGRecordCallback
