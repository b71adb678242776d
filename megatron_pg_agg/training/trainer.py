"""PPO/GRPO actor training with megatron-core and the exact loss aggregation.

The torchrun entry point is ``launch/train_actor.py``; this module holds the pieces so tests can
use them: the built-in synthetic rollouts, checkpoints, and the training loop. The flags and
start-up validation (everything that can be refused is refused before a process group or model
exists) are :mod:`megatron_pg_agg.training.run_config`: the flags are parsed once into a typed
:class:`~megatron_pg_agg.training.run_config.RunConfig`, which every function here takes.

One iteration = one optimizer step = one rollout step (``step`` in the JSONL). Iteration ``i``
trains on rollout step ``i mod (number of steps)``: the data position is the iteration counter,
saved with every checkpoint.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from .checkpoint import load_checkpoint, save_checkpoint
from megatron_pg_agg.core.losses import REPORT_KEYS
from megatron_pg_agg.megatron.config_checks import check_megatron_config
from megatron_pg_agg.megatron.loss_func import make_forward_step, run_schedule
from .metrics import MetricsLog
from megatron_pg_agg.megatron.model import build_model_chunks, default_ddp_config, te_usable, transformer_config, wrap_in_ddp
from megatron_pg_agg.megatron.moe import begin_moe_step, router_loss_pairs, router_loss_values
from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, shutdown_distributed
from megatron_pg_agg.patches import apply_megatron_patches
from megatron_pg_agg.data.planner import PlanConfig, padded_lengths, plan_step, policy_loss_notes, require_inputs
from megatron_pg_agg.data.rollout_files import RolloutFormatError, load_rollouts
from megatron_pg_agg.data.rollouts import PlanError, RolloutBatch
from .run_config import RunConfig, StartupError
from megatron_pg_agg.data.synthetic import synthetic_rollouts
from .worker_process import die_with_launcher


class NonFiniteStepError(RuntimeError):
    """A step produced a non-finite loss or gradient (and --pg-skip-nonfinite-steps is off)."""


def load_steps(cfg: RunConfig) -> dict:
    """``{step: [Rollout, ...]}`` from ``cfg.data.rollouts`` (format errors: StartupError) or the
    built-in synthetic set (vocabulary ``cfg.model.vocab_size``, seeded by ``cfg.training.seed``)."""
    vocab_size = cfg.model.vocab_size
    if cfg.data.rollouts is None:
        return synthetic_rollouts(vocab_size=vocab_size, seed=cfg.training.seed)

    try:
        return load_rollouts(cfg.data.rollouts, vocab_size=vocab_size, require_ref=cfg.loss.needs_reference)
    except RolloutFormatError as err:
        raise StartupError(f"refusing to start: {err}") from err


def _check_steps(steps: dict, cfg: RunConfig, world: int) -> dict:
    """Every step must be plannable before the first update: a step that would fail at iteration
    k must not let iterations 0..k-1 train first. Returns the steps packed as RolloutBatch."""

    par, data, loss_cfg = cfg.parallel, cfg.data, cfg.loss
    dp = par.dp_size(world)
    plan_cfg = PlanConfig(dp_size=dp, max_tokens_per_microbatch=data.max_tokens_per_microbatch, tp_size=par.tp,
                          sequence_parallel=par.sequence_parallel, cp_size=par.cp)
    bins = dp * (data.num_microbatches or 1)  # one per DP rank at least (a token cap sets no count)
    packed = {}
    for key, rollouts in steps.items():
        try:
            if not rollouts:
                raise PlanError(f"step {key} has no rollouts")
            # packed once: each iteration then plans from flat tensors (vectorised, fast)
            packed[key] = RolloutBatch.from_rollouts(rollouts, vocab_size=cfg.model.vocab_size)
            padded_lengths(packed[key], plan_cfg, step=key)
            require_inputs(packed[key], loss_cfg)
            if len(rollouts) < bins:
                raise PlanError(f"step {key} has {len(rollouts)} responses, fewer than the {bins} "
                                f"microbatches ({dp} DP ranks) it must fill")
        except PlanError as err:
            where = "" if str(err).startswith("step ") else f"step {key}: "
            raise StartupError(f"refusing to start: {where}{err}") from err
    if int(os.environ.get("RANK", "0")) == 0:
        for note in policy_loss_notes(packed, loss_cfg):
            print(f"[train] note: {note}", file=sys.stderr, flush=True)
    return packed


@dataclass
class RunState:
    iteration: int = 0
    skipped: int = 0


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
    plan_cfg: object
    """The ``PlanConfig``, built once from the config and the parallel sizes."""
    steps: dict
    """``{rollout step: RolloutBatch}``, checked before any process group."""
    model: list
    """This rank's model chunks (megatron-core DDP), one per virtual pipeline stage."""
    optimizer: object
    """megatron-core's optimizer over ``model``."""
    state: RunState
    """Iteration counter (the data position) and skipped-step count; saved with checkpoints."""
    log: MetricsLog
    """Rank 0's metrics output (inactive elsewhere)."""
    rank: int
    """Global rank."""
    device: object
    """``torch.device("cuda")`` on GPUs, None on CPU."""

    @property
    def experts(self) -> bool:
        """A MoE model (router losses, the per-step aux-loss factor)."""
        return self.cfg.model.moe.enabled


def setup(cfg: RunConfig) -> Session:
    """Checks (before any process group), patches, process groups, model, optimizer and resume."""

    die_with_launcher()

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world, backend=backend, te=te_usable())
    loss_cfg, model_cfg, par, moe = cfg.loss, cfg.model, cfg.parallel, cfg.model.moe
    steps = load_steps(cfg)  # rollouts are validated on the host before any process group
    steps = _check_steps(steps, cfg, world)

    experts = moe.enabled

    # cpu_gloo: CPU/gloo shim (MoE layers included); moe_aux_loss: router aux/z losses keep
    # Megatron's default strength under the per-token contract (patches/moe_aux_loss.py)
    apply_megatron_patches(cpu_gloo=not cuda, moe_aux_loss=experts)
    init_distributed(backend=backend, timeout_s=par.distributed_timeout_minutes * 60)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = dist.get_rank()

    tp, pp, cp, ep = par.tp, par.pp, par.cp, par.ep
    vpp = cfg.virtual_pipeline_size
    # every group megatron creates (DP, TP, PP, ...) gets the timeout too, not only the default one
    init_parallel(tp, pp, vpp, cp, seed=cfg.training.seed, ep=ep, timeout_minutes=par.distributed_timeout_minutes)
    dtype = torch.bfloat16 if model_cfg.bf16 else torch.float32
    # the allgather dispatcher refuses variable_seq_lengths, and on gloo its EP all-gather needs
    # one token count per microbatch on every rank: pad microbatches to one length there
    allgather = experts and moe.token_dispatcher_type == "allgather"
    uniform_tokens = vpp is not None or (allgather and (pp > 1 or ep > 1))
    moe_kwargs = {} if not experts else dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.router_topk,
        moe_aux_loss_coeff=moe.aux_loss_coeff, moe_z_loss_coeff=moe.z_loss_coeff,
        expert_model_parallel_size=ep, moe_token_dispatcher_type=moe.token_dispatcher_type,
        # megatron-core 0.16's expert MLP cannot add a bias under autograd (check_megatron_config
        # says why): MoE models here have no linear biases, as most MoE LLMs
        add_bias_linear=False,
    )
    # fusions follow the device (model.device_settings); the dtypes follow --bf16
    config = transformer_config(
        num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        sequence_parallel=par.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=model_cfg.bf16,
        use_cpu_initialization=not cuda,
        variable_seq_lengths=pp > 1 and not uniform_tokens,
        batch_p2p_comm=par.batch_p2p_comm,
        calculate_per_token_loss=par.calculate_per_token_loss,
        **moe_kwargs,
    )
    torch.manual_seed(cfg.training.seed)
    chunks = build_model_chunks(config, model_cfg.vocab_size, model_cfg.max_position_embeddings,
                                share_embeddings_and_output_weights=not model_cfg.untie_embeddings_and_output_weights)
    if cuda:
        chunks = [c.cuda() for c in chunks]
    ddp_config = default_ddp_config(grad_reduce_in_fp32=True)
    model = wrap_in_ddp(chunks, config, ddp_config)
    config.finalize_model_grads_func = finalize_model_grads
    check_megatron_config(config, ddp_config, backend=backend)
    train_cfg = cfg.training
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
                        clip_grad=train_cfg.clip_grad, bf16=model_cfg.bf16, params_dtype=dtype), model)

    state = RunState()
    load = cfg.checkpoint.load
    if load:
        loaded = load_checkpoint(load, model, optimizer, rank)
        if loaded:
            state = RunState(iteration=loaded["iteration"], skipped=loaded.get("skipped", 0))
        elif rank == 0:
            print(f"[train] --load {load}: no complete checkpoint yet (no 'latest'); starting "
                  "from the initial weights", file=sys.stderr, flush=True)
    log = MetricsLog(cfg.logging.metrics_file, cfg.logging.tensorboard_dir, train_cfg.train_iters,
                     enabled=rank == 0)
    if rank == 0:
        print(f"[train] world={world} TP={tp} PP={pp}{f' (vpp={vpp})' if vpp else ''} CP={cp} "
              f"DP={parallel_state.get_data_parallel_world_size()} backend={backend} "
              f"mode={loss_cfg.canonical_mode} steps={len(steps)} start_iteration={state.iteration}"
              + (f" experts={moe.num_experts} top{moe.router_topk} EP={ep} "
                 f"dispatcher={moe.token_dispatcher_type}" if experts else ""),
              file=sys.stderr, flush=True)
    plan_cfg = PlanConfig(
        dp_size=parallel_state.get_data_parallel_world_size(),
        num_microbatches=cfg.data.num_microbatches,
        max_tokens_per_microbatch=cfg.data.max_tokens_per_microbatch,
        tp_size=tp, sequence_parallel=par.sequence_parallel, cp_size=cp, vocab_size=model_cfg.vocab_size,
        uniform_microbatch_tokens=uniform_tokens,
    )
    return Session(cfg=cfg, plan_cfg=plan_cfg, steps=steps, model=model, optimizer=optimizer, state=state,
                   log=log, rank=rank, device=torch.device("cuda") if cuda else None)


def train_step(s: Session) -> dict:
    """One optimizer step on rollout step ``iteration mod S``: plan -> schedule -> finalize ->
    checks -> optimizer -> metrics. Returns the step's metrics record."""

    cfg, state, model, device = s.cfg, s.state, s.model, s.device
    step_keys = sorted(s.steps)
    key = step_keys[state.iteration % len(step_keys)]
    t0 = time.perf_counter()
    plan = plan_step(s.steps[key], cfg.loss, s.plan_cfg, cp_rank=parallel_state.get_context_parallel_rank())
    mbs = plan.for_rank(parallel_state.get_data_parallel_rank())
    for chunk in model:
        chunk.zero_grad_buffer()
    s.optimizer.zero_grad()
    if s.experts:  # the router losses' per-step factor W / M_total (host integers, no collective)
        begin_moe_step(plan.totals.pg_weight, len(mbs), s.plan_cfg.dp_size)
    forward_step = make_forward_step(cfg.loss, plan.totals, device=device,
                                     tp_group=parallel_state.get_tensor_model_parallel_group(),
                                     cp_group=parallel_state.get_context_parallel_group())
    store = run_schedule(model, mbs, forward_step)
    # step-level reductions (never per microbatch): report pairs and a finiteness flag
    pairs = torch.zeros(len(REPORT_KEYS), 2, dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for report in store:
            for i, name in enumerate(REPORT_KEYS):
                if name in report:
                    pairs[i] += report[name].double()
    dist.all_reduce(pairs, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if s.experts:  # router aux/z losses as [sum, count] pairs over every rank (exact logging)
        moe_pairs = router_loss_pairs(model, len(mbs), device=device)
        dist.all_reduce(moe_pairs)
    grads_finite = [torch.isfinite(p.main_grad).all() for chunk in model for p in chunk.parameters()
                    if p.requires_grad and getattr(p, "main_grad", None) is not None]
    finite = torch.stack([torch.isfinite(pairs).all(), *grads_finite]).all().double().reshape(1)
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # one host sync per step, after the schedule
    skipped = False
    if finite.item() < 1:
        if not cfg.training.skip_nonfinite_steps:
            raise NonFiniteStepError(
                f"iteration {state.iteration} (rollout step {key}): non-finite loss or gradient; "
                "nothing was updated. Check the rollouts' advantages/log-probs, or pass "
                "--pg-skip-nonfinite-steps to skip such steps.")
        skipped = True
        state.skipped += 1
        grad_norm = float("nan")
    elif plan.totals.pg_weight == 0:
        # W = 0 (every response token masked): J = 0 and every gradient is 0 by the contract.
        # Nothing to learn, so no optimizer step (Adam's momentum would still move the weights
        # and advance its step count); the logged grad_norm is 0 exactly when every gradient is.
        grad_norm = _grad_square_sum(model, device) ** 0.5
    else:
        ok, grad_norm, _ = s.optimizer.step()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        if not ok:  # the optimizer refused the update (a mixed-precision loss scaler found inf)
            skipped = True
            state.skipped += 1
    state.iteration += 1
    elapsed = time.perf_counter() - t0
    # only the last pipeline stage fills the report pairs: share them for logging
    pairs_all = pairs.clone()
    if cfg.parallel.pp > 1:
        dist.broadcast(pairs_all, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    values = {name: float(pairs_all[i, 0] / pairs_all[i, 1]) if pairs_all[i, 1] > 0 else None
              for i, name in enumerate(REPORT_KEYS)}
    values["objective"] = values["objective"] or 0.0  # W = 0: J = 0 by the contract
    record = {
        "iteration": state.iteration, "rollout_step": key,
        "objective": values["objective"], "pg_loss": values["pg_loss"],
        "weight": plan.totals.pg_weight, "valid_tokens": plan.totals.valid_tokens,
        "clip_fraction": values["clip_fraction"], "ratio": values["ratio"],
        "kl": values["kl"], "entropy": values["entropy"], "grad_norm": grad_norm,
        "tokens_per_s": plan.stats["tokens"] / elapsed, "step_s": elapsed,
        "microbatches": plan.stats["microbatches_per_rank"],
        "microbatch_balance": plan.stats["microbatch_balance"],
        "skipped": skipped, "skipped_total": state.skipped,
    }
    if s.experts:
        record.update(router_loss_values(moe_pairs))
    return record


def close(s: Session, record: dict) -> dict:
    """The final checkpoint (unless the last step saved one), the parameter checksum, the last
    log lines, and the process group."""

    ckpt, state = s.cfg.checkpoint, s.state
    if ckpt.save and not ckpt.interval_save_due(state.iteration):
        _save(s)
    checksum = _param_checksum(s.model)
    if s.rank == 0:
        record["param_checksum"] = checksum
        if s.log.file:
            s.log.file.write(json.dumps({"final": True, "iteration": state.iteration,
                                         "param_checksum": checksum, "skipped_total": state.skipped}) + "\n")
        print(f"[train] done: {state.iteration} iterations, objective={record.get('objective', float('nan')):.6g}, "
              f"param_checksum={checksum:.10g}, skipped={state.skipped}", file=sys.stderr, flush=True)
    s.log.close()
    shutdown_distributed()
    return record


def train(cfg: RunConfig) -> dict:
    """Run the whole job: setup, steps, close. Returns rank 0's last metrics record (empty dict
    elsewhere)."""
    s = setup(cfg)
    iters, interval = cfg.training.train_iters, cfg.logging.log_interval
    record = {}
    while s.state.iteration < iters:
        record = train_step(s)
        if s.state.iteration % interval == 0 or s.state.iteration == iters:
            s.log.log(record)
        if cfg.checkpoint.interval_save_due(s.state.iteration):
            _save(s)
    return close(s, record)


def _save(s: Session) -> None:
    """This iteration's checkpoint under ``--save`` (with the skipped-step count)."""
    save_checkpoint(s.cfg.checkpoint.save, s.state.iteration, s.model, s.optimizer, s.rank,
                    {"skipped": s.state.skipped})
