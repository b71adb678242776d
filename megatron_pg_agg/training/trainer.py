"""PPO/GRPO actor training with megatron-core and the exact loss aggregation.

The torchrun entry point is ``launch/train_actor.py``; this module holds the pieces so tests can
use them: the built-in synthetic rollouts, checkpoints, and the training loop. The flags and
start-up validation (everything that can be refused is refused before a process group or model
exists) are :mod:`megatron_pg_agg.training.run_config`: the flags are parsed once into a typed
:class:`~megatron_pg_agg.training.run_config.RunConfig`, which every function here takes.

Offline (``--rollouts``), one iteration = one optimizer step = one rollout step (``step`` in the
JSONL). Iteration ``i`` trains on rollout step ``i mod (number of steps)``: the data position is
the iteration counter, saved with every checkpoint. Online (no ``--rollouts``: the main job's
command line, :mod:`megatron_pg_agg.online.cli`, hands the job to :mod:`megatron_pg_agg.online.main_job`),
one iteration = one batch sampled from the live policy and ``--updates-per-batch`` optimizer steps on
it (:func:`train_step` with ``advance`` False but for the last), in the same loop (:func:`run_iterations`).

Each step is planned when its iteration comes (nothing is kept from one step to the next). With
``--pg-plan-ahead`` (the default) iteration ``i + 1``'s plan is built on a background host thread
while iteration ``i`` runs (:class:`~megatron_pg_agg.data.plan_ahead.PlanAhead`, two plans held at
most); a plan's error is raised by the iteration that needs it, as without plan-ahead.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from megatron_pg_agg.core.losses import correction_values
from megatron_pg_agg.data.plan_ahead import PlanAhead
from megatron_pg_agg.data.planner import PlanConfig, padded_lengths, plan_step, policy_loss_notes, require_inputs
from megatron_pg_agg.data.rollouts import PlanError
from megatron_pg_agg.megatron.config_checks import check_megatron_config
from megatron_pg_agg.megatron.logprob_pass import planned_logprobs, with_current_logprobs
from megatron_pg_agg.megatron.model import (
    build_model_chunks,
    default_ddp_config,
    gather_parameters,
    hf_contract_settings,
    te_usable,
    transformer_config,
    wrap_in_ddp,
)
from megatron_pg_agg.megatron.moe import router_loss_values
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, shutdown_distributed
from megatron_pg_agg.megatron.step import StepGroups, StepResult, run_pg_step
from megatron_pg_agg.patches import apply_megatron_patches, rope_thd
from megatron_pg_agg.patches.cpu import optimizer_cpu

from .checkpoint import load_checkpoint, save_checkpoint
from .metrics import MetricsLog, new_run_id, run_start_record
from .model_source import ModelSourceError, open_model_source
from .resume import run_record, with_checkpoint_settings
from .rollout_steps import load_steps
from .run_config import RunConfig, StartupError
from .worker_process import die_with_launcher

logger = logging.getLogger(__name__)


class NonFiniteStepError(RuntimeError):
    """A step produced a non-finite loss or gradient (and --pg-skip-nonfinite-steps is off)."""


def _check_steps(steps: dict, cfg: RunConfig, plan_cfg: PlanConfig) -> dict:
    """Every step must be plannable before the first update: a step that would fail at iteration
    k must not let iterations 0..k-1 train first. ``steps``: ``{step: RolloutBatch}`` (checked and
    packed once by :func:`~megatron_pg_agg.training.rollout_steps.load_steps`); returned as is."""
    bins = plan_cfg.dp_size * (cfg.data.num_microbatches or 1)  # one per DP rank at least
    for key, batch in steps.items():
        try:
            padded_lengths(batch, plan_cfg)
            require_inputs(batch, cfg.loss)
            if len(batch) < bins:
                raise PlanError(f"has {len(batch)} responses, fewer than the {bins} "
                                f"microbatches ({plan_cfg.dp_size} DP ranks) it must fill")
        except PlanError as err:
            raise StartupError(f"step {key}: {err}") from err
    for note in policy_loss_notes(steps, cfg.loss):
        logger.info(f"note: {note}")
    return steps


@dataclass
class RunState:
    """What a checkpoint carries besides the weights and the optimizer."""

    iteration: int = 0
    """Iterations done: the data position (iteration ``i`` trains rollout step ``i mod S``)."""
    skipped: int = 0
    """Steps skipped so far (non-finite, or refused by the optimizer)."""
    run_id: Optional[str] = None
    """The run's id in the metrics records (kept across a resume; set at start-up)."""


def _param_checksum(model) -> float:
    """Sum of all local parameters in float64, all-reduced over the world (each parameter counted
    once per DP x CP replica): a cheap fingerprint to compare runs."""
    total = torch.zeros((), dtype=torch.float64)
    for chunk in model:
        for p in chunk.parameters():
            total += p.detach().double().sum()
    dist.all_reduce(total)
    return float(total)


def _grad_square_sum(model, device=None) -> float:
    """Sum of squared main gradients over every rank (replicas counted each time): 0 exactly
    when every gradient is 0."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for chunk in model:
        for p in chunk.parameters():
            if getattr(p, "main_grad", None) is not None:
                total += p.main_grad.detach().double().square().sum()
    dist.all_reduce(total)
    return float(total)


@dataclass
class Session:
    """Everything a running job holds, built once by :func:`setup` (parallel state, model,
    optimizer, resumed state, plan config, logger) and read by :func:`train_step`."""

    cfg: RunConfig
    """The run's typed configuration, built once from the flags and validated."""
    plan_cfg: PlanConfig
    """How each step is cut (:meth:`RunConfig.plan_config`), the same on every rank."""
    steps: dict
    """``{rollout step: RolloutBatch}``, checked before any process group."""
    model: list
    """This rank's model chunks (megatron-core DDP), one per virtual pipeline stage."""
    optimizer: MegatronOptimizer
    """megatron-core's optimizer over ``model``."""
    state: RunState
    """Iteration counter (the data position) and skipped-step count; saved with checkpoints."""
    log: MetricsLog
    """Rank 0's metrics output (inactive elsewhere)."""
    rank: int
    """Global rank."""
    device: Optional[torch.device]
    """``torch.device("cuda")`` on GPUs, None on CPU."""
    groups: StepGroups
    """The process groups a step uses (from megatron-core's parallel state)."""
    plans: PlanAhead
    """The plans of iterations ``state.iteration .. train_iters - 1``, in order, each built in the
    background while the previous one runs (``--pg-plan-ahead``) or when asked for (off);
    :func:`train_step` takes them, :func:`close` ends it."""

    @property
    def experts(self) -> bool:
        """A MoE model (router losses, the per-step aux-loss factor)."""
        return self.cfg.model.moe.enabled


def setup(cfg: RunConfig, steps: Optional[dict] = None, *, data: Optional[str] = None) -> Session:
    """Checks (before any process group), patches, process groups, model, optimizer and resume.
    ``steps``: ``{step: RolloutBatch}`` to train on instead of ``--rollouts`` / the built-in set
    (an online source passes an empty dict and fills it as it samples: megatron_pg_agg.online).
    ``data``: what the start line says the run trains on (default: the mode and the step count)."""
    die_with_launcher()
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world, backend=backend, te=te_usable())  # a resume's checks too (training.resume)
    cfg = with_checkpoint_settings(cfg)  # --use-checkpoint-opt_param-scheduler: the checkpoint's lr, ...
    plan_cfg = cfg.plan_config(world)
    if steps is None:
        steps = load_steps(cfg.data, cfg.loss, vocab_size=cfg.model.vocab_size, seed=cfg.training.seed)
    steps = _check_steps(steps, cfg, plan_cfg)  # host checks, before any process group
    par = cfg.parallel
    # cpu_gloo: CPU/gloo shim (MoE layers included); moe_aux_loss: router aux/z losses keep
    # Megatron's default strength under the per-token contract (patches/moe_aux_loss.py)
    # mtp_loss: the MTP loss is a token mean over the step's valid tokens (patches/mtp_loss.py)
    # optimizer_cpu: megatron-core's mixed-precision and distributed optimizers on CPU (the type
    # strings they sort parameters by); a GPU runs them unpatched
    # rope_thd: 0.19's unfused packed RoPE in one shot instead of a loop over sequences (patches/rope_thd.py)
    apply_megatron_patches(cpu_gloo=not cuda, moe_aux_loss=cfg.model.moe.enabled, rope_thd=rope_thd.needed(),
                           mtp_loss=cfg.model.mtp_num_layers is not None,
                           optimizer_cpu=optimizer_cpu.needed(cuda=cuda, bf16=cfg.model.bf16,
                                                              distributed_optimizer=par.use_distributed_optimizer))
    init_distributed(backend=backend, timeout_s=par.distributed_timeout_minutes * 60)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = dist.get_rank()
    # every group megatron creates (DP, TP, PP, ...) gets the timeout too, not only the default one
    init_parallel(cfg.layout, seed=cfg.training.seed, ep=par.ep, timeout_minutes=par.distributed_timeout_minutes)
    model = _build_model(cfg, cuda=cuda, backend=backend)
    train_cfg = cfg.training
    optimizer = new_optimizer(cfg, model)
    state = _resume(cfg.checkpoint.load, model, optimizer, rank)
    ids = [state.run_id or new_run_id()]
    dist.broadcast_object_list(ids, src=0)  # one id on every rank (each rank's checkpoint keeps it)
    state.run_id = ids[0]
    model_name = cfg.model.hf_model or (f"built-in GPT ({cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
                                        f"vocabulary {cfg.model.vocab_size})")
    log = MetricsLog(cfg.logging.metrics_file, cfg.logging.tensorboard_dir, train_cfg.train_iters,
                     enabled=rank == 0,
                     run_start=run_start_record(state.run_id, argv=sys.argv, model=model_name,
                                                start_iteration=state.iteration,
                                                extra={"mode": cfg.loss.mode, "world_size": world,
                                                       **_online_record(cfg)}))
    _log_layout(cfg, world, backend, data or f"mode={cfg.loss.mode} steps={len(steps)}", state.iteration)
    plans = PlanAhead(_iteration_planner(cfg, plan_cfg, steps, parallel_state.get_context_parallel_rank()),
                      range(state.iteration, max(state.iteration, train_cfg.train_iters)),
                      enabled=cfg.data.plan_ahead)
    return Session(cfg=cfg, plan_cfg=plan_cfg, steps=steps, model=model, optimizer=optimizer,
                   state=state, log=log, rank=rank, device=torch.device("cuda") if cuda else None,
                   groups=StepGroups.from_parallel_state(), plans=plans)


def new_optimizer(cfg: RunConfig, model: list) -> MegatronOptimizer:
    """megatron-core's Adam over ``model`` with the run's rate, weight decay, clipping and dtype
    (a fresh one: no moments yet)."""
    train_cfg = cfg.training
    return get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
                        clip_grad=train_cfg.clip_grad, bf16=cfg.model.bf16,
                        params_dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
                        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer), model)


def step_key(steps: dict, iteration: int):
    """The rollout step iteration ``iteration`` trains on: ``sorted(steps)[iteration mod S]``."""
    keys = sorted(steps)
    return keys[iteration % len(keys)]


def _iteration_planner(cfg: RunConfig, plan_cfg: PlanConfig, steps: dict, cp_rank: int):
    """``plan(iteration)`` of this rank: its rollout step through :func:`plan_step` (looked up in
    this module at each call, where a test may replace it)."""
    def plan(iteration: int):
        return plan_step(steps[step_key(steps, iteration)], cfg.loss, plan_cfg, cp_rank=cp_rank)

    return plan


def _build_model(cfg: RunConfig, *, cuda: bool, backend: str) -> list:
    """This rank's model chunks in megatron-core DDP, with the config checked."""
    model_cfg, par = cfg.model, cfg.parallel
    dtype = torch.bfloat16 if model_cfg.bf16 else torch.float32
    # fusions follow the device (model.device_settings); the dtypes follow --bf16
    settings = dict(
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_size, context_parallel_size=par.cp,
        sequence_parallel=par.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=model_cfg.bf16,
        use_cpu_initialization=not cuda,
        variable_seq_lengths=par.pp > 1 and not cfg.uniform_microbatch_tokens,
        batch_p2p_comm=par.batch_p2p_comm,
        calculate_per_token_loss=par.calculate_per_token_loss,
        **moe_settings(cfg),
    )
    if model_cfg.hf_model:  # shape and weights from the HF folder, through Megatron-Bridge
        for shape_field in ("num_moe_experts", "add_bias_linear"):  # the HF config's
            settings.pop(shape_field, None)
        try:
            chunks = open_model_source("hf", model_cfg.hf_model).build_chunks(**{**hf_contract_settings(), **settings})
        except ModelSourceError as err:  # missing or extra tensors: found once the model's names are known
            raise StartupError(str(err)) from err
        config = get_model_config(chunks[0])
    else:
        config = transformer_config(
            num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
            ffn_hidden_size=model_cfg.ffn_hidden_size, num_attention_heads=model_cfg.num_attention_heads,
            mtp_num_layers=model_cfg.mtp_num_layers, mtp_loss_scaling_factor=model_cfg.mtp_loss_scaling_factor,
            **settings)
        torch.manual_seed(cfg.training.seed)
        tied = not model_cfg.untie_embeddings_and_output_weights
        chunks = build_model_chunks(config, model_cfg.vocab_size, model_cfg.max_position_embeddings,
                                    share_embeddings_and_output_weights=tied)
    if cuda:
        chunks = [c.cuda() for c in chunks]
    if model_cfg.bf16:
        # as Megatron-LM's get_model: every parameter bf16 (the local spec's torch norms are built
        # fp32, and megatron-core's distributed optimizer mis-maps a group that mixes dtypes), the
        # last stage's logits handed to the loss in fp32
        chunks = [Float16Module(config, c) for c in chunks]
    model = wrap_in_ddp(chunks, config, ddp_config(cfg))
    config.finalize_model_grads_func = finalize_model_grads
    check_megatron_config(config, model[0].ddp_config, backend=backend)
    return model


def moe_settings(cfg: RunConfig) -> dict:
    """The ``TransformerConfig`` fields of the run's experts (empty for a dense model)."""
    moe, par = cfg.model.moe, cfg.parallel
    if not moe.enabled:
        return {}
    return dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.router_topk,
        moe_aux_loss_coeff=moe.aux_loss_coeff, moe_z_loss_coeff=moe.z_loss_coeff,
        expert_model_parallel_size=par.ep, moe_token_dispatcher_type=moe.token_dispatcher_type,
        # megatron-core 0.16's expert MLP cannot add a bias under autograd (check_megatron_config
        # says why): MoE models here have no linear biases, as most MoE LLMs; and without biases
        # megatron-core refuses the bias-activation fusion that the CUDA settings turn on
        add_bias_linear=False, bias_activation_fusion=False,
    )


def ddp_config(cfg: RunConfig):
    """megatron-core DDP settings of the run, as Megatron-LM makes them from the same flags: fp32
    main gradients (Megatron-LM forces them with --bf16; here always), the distributed optimizer,
    the two overlaps, the parameter gather aligned across pipeline stages only under the
    interleaved schedule (Megatron-LM turns ``align_param_gather`` off elsewhere), and the bucket
    size (``--ddp-bucket-size``, else megatron-core's default; one bucket without overlap)."""
    par = cfg.parallel
    return default_ddp_config(
        grad_reduce_in_fp32=True, use_distributed_optimizer=par.use_distributed_optimizer,
        overlap_grad_reduce=par.overlap_grad_reduce, overlap_param_gather=par.overlap_param_gather,
        align_param_gather=par.overlap_param_gather and cfg.virtual_pipeline_size is not None,
        bucket_size=par.ddp_bucket_size if par.overlap_grad_reduce else None)


def _resume(load, model, optimizer, rank: int) -> RunState:
    """The state ``--load`` holds (weights and optimizer restored in place), else a fresh one."""
    if not load:
        return RunState()
    loaded = load_checkpoint(load, model, optimizer, rank)
    if loaded:
        return RunState(iteration=loaded["iteration"], skipped=loaded.get("skipped", 0), run_id=loaded.get("run_id"))
    logger.info(f"--load {load}: no complete checkpoint yet (no 'latest'); starting from the initial weights")
    return RunState()


def _online_record(cfg: RunConfig) -> dict:
    """The run-start record's ``online`` entry: the online run's settings (nothing offline)."""
    if cfg.online is None:
        return {}
    return {"online": {"task": "reach", **dataclasses.asdict(cfg.online)}}


def _log_layout(cfg: RunConfig, world: int, backend: str, data: str, start: int) -> None:
    par, moe, vpp = cfg.parallel, cfg.model.moe, cfg.virtual_pipeline_size
    logger.info(f"world={world} TP={par.tp} PP={par.pp}{f' (vpp={vpp})' if vpp else ''} CP={par.cp} "
              f"DP={parallel_state.get_data_parallel_world_size()} backend={backend} "
              f"{data} start_iteration={start}"
              + (f" experts={moe.num_experts} top{moe.router_topk} EP={par.ep} "
                 f"dispatcher={moe.token_dispatcher_type}" if moe.enabled else ""))


def train_step(s: Session, *, recompute_old_logprobs: bool = False, advance: bool = True) -> dict:
    """One optimizer step on rollout step ``iteration mod S``: plan -> forward-backward (the step
    runner) -> checks -> optimizer -> metrics. Returns the step's metrics record.

    ``recompute_old_logprobs``: before the step, a forward-only pass over the same microbatches
    replaces the rollouts' old log-probs with the current weights' (PPO's ratio is then 1 at the
    step's start; with advantage 1 the step is supervised learning: megatron_pg_agg.online).
    ``advance=False``: the iteration counter stays, so the next step trains the same iteration's
    plan again (the online run's several updates on one sampled batch)."""
    cfg, state, model = s.cfg, s.state, s.model
    key = step_key(s.steps, state.iteration)
    t0 = time.perf_counter()
    plan = s.plans.get(state.iteration)  # built while the previous step ran (--pg-plan-ahead)
    dp_rank = parallel_state.get_data_parallel_rank()
    microbatches = None
    if recompute_old_logprobs:
        mine = plan.for_rank(dp_rank)
        current = planned_logprobs(model, mine, tp_group=s.groups.tensor, is_last_stage=s.groups.is_last_stage,
                                   device=s.device)
        # only the last pipeline stage reads old log-probs (in its loss function)
        microbatches = with_current_logprobs(mine, current) if s.groups.is_last_stage else mine
    s.optimizer.zero_grad()
    result = run_pg_step(model, plan, cfg.loss, s.groups, dp_rank=dp_rank, experts=s.experts, device=s.device,
                         microbatches=microbatches)
    skipped, grad_norm = _optimizer_step(s, result, plan.totals.pg_weight, key)
    state.iteration += 1 if advance else 0
    elapsed = time.perf_counter() - t0
    record = {
        "iteration": state.iteration, "rollout_step": key,
        **result.values(plan.totals.pg_weight), **correction_values(plan.correction_stats),
        "weight": plan.totals.pg_weight, "valid_tokens": plan.totals.valid_tokens, "grad_norm": grad_norm,
        # the rate this step's update used (constant here: the trainer has no schedule)
        "learning_rate": s.optimizer.param_groups[0]["lr"],
        "tokens_per_s": plan.stats["tokens"] / elapsed, "step_s": elapsed,
        "microbatches": plan.stats["microbatches_per_rank"],
        "microbatch_balance": plan.stats["microbatch_balance"],
        "skipped": skipped, "skipped_total": state.skipped,
    }
    if s.experts:
        record.update(router_loss_values(result.router_pairs))
    return record


def _optimizer_step(s: Session, result: StepResult, pg_weight: int, key) -> tuple:
    """The update after a step's forward-backward: ``(skipped, grad_norm)``.

    A non-finite loss or gradient on any rank skips the step (``--pg-skip-nonfinite-steps``) or
    raises NonFiniteStepError; a ``W = 0`` step has every gradient 0 and makes no update (Adam's
    momentum would still move the weights); the optimizer may refuse an update itself (a
    mixed-precision loss scaler found inf)."""
    grads_finite = [torch.isfinite(p.main_grad).all() for chunk in s.model for p in chunk.parameters()
                    if p.requires_grad and getattr(p, "main_grad", None) is not None]
    finite = torch.stack([torch.isfinite(result.pairs).all(), *grads_finite]).all().double().reshape(1)
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # one host sync per step, after the schedule
    if finite.item() < 1:
        if not s.cfg.training.skip_nonfinite_steps:
            raise NonFiniteStepError(
                f"iteration {s.state.iteration} (rollout step {key}): non-finite loss or gradient; "
                "nothing was updated. Check the rollouts' advantages/log-probs, or pass "
                "--pg-skip-nonfinite-steps to skip such steps.")
        s.state.skipped += 1
        return True, float("nan")
    if pg_weight == 0:
        # J = 0 and every gradient is 0 by the contract: the logged grad_norm is 0 exactly when
        # every gradient is
        return False, _grad_square_sum(s.model, s.device) ** 0.5
    ok, grad_norm, _ = s.optimizer.step()
    if not ok:
        s.state.skipped += 1
    return not ok, float(grad_norm) if grad_norm is not None else float("nan")


def close(s: Session, record: dict) -> dict:
    """The final checkpoint (unless the last step saved one), the parameter checksum, the last
    log lines, and the process group."""

    ckpt, state = s.cfg.checkpoint, s.state
    s.plans.close()
    gather_parameters(s.model)  # --overlap-param-gather: the last step's shards, before reading them
    if ckpt.save and not ckpt.interval_save_due(state.iteration):
        _save(s, gathered=True)
    if ckpt.save_hf and not ckpt.interval_save_hf_due(state.iteration):
        _save_hf(s, gathered=True)
    checksum = _param_checksum(s.model)
    if s.rank == 0:
        record["param_checksum"] = checksum
        s.log.write({"final": True, "iteration": state.iteration, "param_checksum": checksum,
                     "skipped_total": state.skipped})
        accuracy = f"accuracy={record['accuracy']:.4g}, " if "accuracy" in record else ""
        logger.info(f"done: {state.iteration} iterations, {accuracy}objective="
                    f"{record.get('objective', float('nan')):.6g}, param_checksum={checksum:.10g}, "
                    f"skipped={state.skipped}")
    s.log.close()
    shutdown_distributed()
    return record


def train(cfg: RunConfig) -> dict:
    """Run the whole job on the run's rollouts: setup, steps, close. Returns rank 0's last metrics
    record (empty dict elsewhere). A run without rollouts (``cfg.online``) is the online main job,
    :func:`megatron_pg_agg.online.main_job.train_online` (chosen by the main job's command line,
    :mod:`megatron_pg_agg.online.cli`), which runs through :func:`run_iterations` too."""
    if cfg.online is not None:
        raise ValueError("a RunConfig without rollouts (cfg.online) is the online main job: run it with "
                         "megatron_pg_agg.online.main_job.train_online, not trainer.train")
    s = setup(cfg)
    return run_iterations(s, lambda: train_step(s))


def run_iterations(s: Session, iteration: Callable[[], dict]) -> dict:
    """The loop of a job from ``s.state.iteration`` to ``--train-iters``: ``iteration()`` (one
    iteration, returning its record and advancing ``s.state.iteration`` by one), the record
    logged every ``--log-interval``, the interval checkpoints, then :func:`close`."""
    cfg = s.cfg
    iters, interval = cfg.training.train_iters, cfg.logging.log_interval
    record = {}
    try:
        while s.state.iteration < iters:
            record = iteration()
            if s.state.iteration % interval == 0 or s.state.iteration == iters:
                s.log.log(record)
            if cfg.checkpoint.interval_save_due(s.state.iteration):
                _save(s)
            if cfg.checkpoint.interval_save_hf_due(s.state.iteration):
                _save_hf(s)
    finally:  # a step that raised leaves no planning thread behind (close() ends it otherwise)
        s.plans.close()
    return close(s, record)


def _save(s: Session, *, gathered: bool = False) -> None:
    """This iteration's checkpoint under ``--save`` (with the skipped-step count and the run record
    a resume is checked against); ``gathered``: the parameters are current already."""
    if not gathered:
        gather_parameters(s.model)
    save_checkpoint(s.cfg.checkpoint.save, s.state.iteration, s.model, s.optimizer, s.rank,
                    {"skipped": s.state.skipped, "run_id": s.state.run_id},
                    record=run_record(s.cfg, dist.get_world_size()))


def _save_hf(s: Session, *, gathered: bool = False) -> None:
    """The live model as an HF folder under ``--save-hf`` (every rank exports; rank 0 writes)."""
    t0 = time.perf_counter()
    if not gathered:
        gather_parameters(s.model)
    out = open_model_source("hf", s.cfg.model.hf_model).save(s.model, s.cfg.checkpoint.save_hf, rank=s.rank)
    logger.info(f"iteration {s.state.iteration}: wrote the HF folder {out} ({time.perf_counter() - t0:.1f} s)")
