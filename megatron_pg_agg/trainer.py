"""PPO/GRPO actor training with megatron-core and the exact loss aggregation.

The torchrun entry point is ``launch/train_actor.py``; this module holds the pieces so tests can
use them: flags, start-up validation (everything that can be refused is refused before a process
group or model exists), the built-in synthetic rollouts, checkpoints, and the training loop.

One iteration = one optimizer step = one rollout step (``step`` in the JSONL). Iteration ``i``
trains on rollout step ``i mod (number of steps)``: the data position is the iteration counter,
saved with every checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Optional

from .args import add_pg_agg_args, config_from_args
from .versions import SUPPORTED_MEGATRON_CORE
from .worker_process import die_with_launcher, keep_freed_memory, quiet_cpu_fallbacks



class StartupError(ValueError):
    """A run configuration refused before any process group or model is built."""


class NonFiniteStepError(RuntimeError):
    """A step produced a non-finite loss or gradient (and --pg-skip-nonfinite-steps is off)."""


# ----------------------------------------------------------------------------- flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_actor", description="Train a PPO/GRPO actor with megatron-core (torchrun entry point).")
    model = parser.add_argument_group("model (Megatron-style)")
    model.add_argument("--num-layers", type=int, default=2)
    model.add_argument("--hidden-size", type=int, default=64)
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    model.add_argument("--num-attention-heads", type=int, default=4)
    model.add_argument("--vocab-size", type=int, default=128, help="must cover every token id of the rollouts")
    model.add_argument("--max-position-embeddings", type=int, default=256)
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    model.add_argument("--bf16", action="store_true", help="bf16 parameters and compute (fp32 grads/optimizer)")
    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                     help="process-group timeout: a dead or hung rank fails the job after this")
    par.add_argument("--batch-p2p-comm", action="store_true",
                     help="batched pipeline p2p (refused with the interleaved schedule on gloo)")
    par.add_argument("--no-calculate-per-token-loss", dest="calculate_per_token_loss", action="store_false",
                     help="(refused) Megatron's default mean-of-microbatch-means")
    moe = parser.add_argument_group("mixture of experts (Megatron-style; every layer's MLP is a MoE layer)")
    moe.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: dense model)")
    moe.add_argument("--moe-router-topk", type=int, default=2, help="experts per token (>= 2)")
    moe.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="load-balancing (aux) loss coefficient")
    moe.add_argument("--moe-z-loss-coeff", type=float, default=None, help="router z-loss coefficient")
    moe.add_argument("--expert-model-parallel-size", type=int, default=1)
    moe.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather")
    batching = parser.add_argument_group("batching").add_mutually_exclusive_group()
    batching.add_argument("--max-tokens-per-microbatch", type=int, default=None)
    batching.add_argument("--num-microbatches", type=int, default=None, help="per DP rank (default 2)")
    train = parser.add_argument_group("training")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--train-iters", type=int, default=20)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--rollouts", default=None, help="rollout JSONL (README: schema); default: built-in synthetic set")
    train.add_argument("--save", default=None, help="checkpoint directory")
    train.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    train.add_argument("--load", default=None, help="resume from this checkpoint directory")
    train.add_argument("--metrics-file", default=None,
                       help="per-step metrics JSONL (default: <save>/metrics.jsonl, else runs/train_actor/metrics.jsonl)")
    train.add_argument("--tensorboard-dir", default=None, help="TensorBoard logs, if tensorboard is installed")
    train.add_argument("--log-interval", type=int, default=1)
    add_pg_agg_args(parser)
    return parser


# ----------------------------------------------------------------------------- start-up checks


def megatron_core_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def validate_startup(args, world_size: int, *, backend: str, te: bool) -> None:
    """Refuse every invalid combination before any process group or model is built."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    problems = []
    try:
        config_from_args(args)
    except ValueError as err:
        problems.append(str(err))
    installed = megatron_core_version()
    if Version(installed) not in SpecifierSet(SUPPORTED_MEGATRON_CORE, prereleases=True):
        problems.append(f"megatron-core {installed} is outside the supported range {SUPPORTED_MEGATRON_CORE}")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for name, size in (("tensor", tp), ("pipeline", pp), ("context", cp)):
        if size < 1:
            problems.append(f"--{name}-model-parallel-size must be >= 1" if name != "context"
                            else "--context-parallel-size must be >= 1")
    if tp >= 1 and pp >= 1 and cp >= 1 and world_size % (tp * pp * cp):
        problems.append(
            f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp}")
    if pp >= 1 and args.num_layers % pp:
        problems.append(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // max(pp, 1)
        if pp < 2:
            problems.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
        elif per_stage % args.num_layers_per_virtual_pipeline_stage:
            problems.append(f"{per_stage} layers per pipeline stage are not divisible by "
                            f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}")
        elif backend == "gloo" and args.batch_p2p_comm:
            problems.append("the interleaved pipeline with --batch-p2p-comm on gloo matches p2p messages out "
                            "of order (wrong gradients): drop --batch-p2p-comm")
    if not args.calculate_per_token_loss:
        problems.append("calculate_per_token_loss off gives a mean of microbatch means, not the chosen objective")
    if args.hidden_size % args.num_attention_heads or args.num_attention_heads % tp:
        problems.append(f"--num-attention-heads {args.num_attention_heads} must divide --hidden-size "
                        f"{args.hidden_size} and be divisible by TP={tp}")
    if args.vocab_size % tp:
        problems.append(f"--vocab-size {args.vocab_size} must be divisible by TP={tp}")
    if not te and args.sequence_parallel and tp > 1:
        problems.append("--sequence-parallel needs Transformer Engine's layer norm (the local spec's torch "
                        "LayerNorm does not support it); run on a GPU with TE or drop the flag")
    if not te and cp > 1:
        problems.append("--context-parallel-size > 1 needs Transformer Engine's THD attention (GPU); on CPU "
                        "the CP loss side is covered by the parity suite")
    if args.bf16 and backend == "gloo":
        problems.append("--bf16 needs CUDA: megatron-core's mixed-precision optimizer only wraps CUDA "
                        "bf16 parameters (run fp32 on CPU)")
    problems.extend(_moe_startup_problems(args, world_size, te=te))
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        problems.append("--save-interval needs --save and a value >= 1")
    if args.train_iters < 1:
        problems.append("--train-iters must be >= 1")
    if args.load and not os.path.isdir(args.load):
        problems.append(f"--load {args.load}: no such directory")
    if args.rollouts and not os.path.isfile(args.rollouts):
        problems.append(f"--rollouts {args.rollouts}: no such file")
    if problems:
        raise StartupError("refusing to start:\n- " + "\n- ".join(problems))


def _moe_startup_problems(args, world_size: int, *, te: bool) -> list:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep, experts = args.expert_model_parallel_size, args.num_experts
    if experts is None:
        given = [flag for flag, on in (("--expert-model-parallel-size", ep != 1),
                                       ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff != 0.0),
                                       ("--moe-z-loss-coeff", args.moe_z_loss_coeff is not None)) if on]
        return [f"{', '.join(given)} need(s) --num-experts"] if given else []
    problems = []
    if experts < 2:
        problems.append(f"--num-experts {experts} must be >= 2")
    if not 2 <= args.moe_router_topk <= max(experts, 2):
        problems.append(f"--moe-router-topk {args.moe_router_topk} must be between 2 and --num-experts "
                        f"{experts} (top-1 needs Megatron's pre-softmax routing, not offered here)")
    if args.moe_aux_loss_coeff < 0 or (args.moe_z_loss_coeff is not None and args.moe_z_loss_coeff < 0):
        problems.append("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
    if ep < 1 or experts % max(ep, 1):
        problems.append(f"--expert-model-parallel-size {ep} must be >= 1 and divide --num-experts {experts}")
    elif tp >= 1 and pp >= 1 and (world_size // max(pp, 1)) % (ep * tp):
        problems.append(f"world size / PP = {world_size // max(pp, 1)} is not divisible by EP x TP = {ep} x {tp}")
    if tp > 1 and not args.sequence_parallel:
        problems.append("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core "
                        "refuses MoE training under TP without it)" + ("" if te else "; on CPU that needs TE too"))
    return problems


# ----------------------------------------------------------------------------- data


def synthetic_rollouts(*, num_steps: int = 4, prompts_per_step: int = 6, group_size: int = 4,
                       vocab_size: int = 128, seed: int = 0) -> dict:
    """A deterministic GRPO-like rollout set: per step, prompts with ``group_size`` responses of
    ragged length; reward = share of even token ids in the response, advantages = reward minus the
    group mean (so the actor learns to favour even tokens); old log-probs near uniform; reference
    log-probs for a KL term; some tokens masked out and some filtered from the numerator."""
    from .rollouts import Rollout

    rng = random.Random(seed)
    uniform = -math.log(vocab_size)
    steps = {}
    for step in range(num_steps):
        rollouts = []
        for p in range(prompts_per_step):
            prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(3, 10))]
            responses = [[rng.randrange(vocab_size) for _ in range(rng.randint(4, 28))] for _ in range(group_size)]
            rewards = [sum(1 for t in r if t % 2 == 0) / len(r) for r in responses]
            mean = sum(rewards) / len(rewards)
            for resp, reward in zip(responses, rewards):
                mask = [1 if rng.random() > 0.05 else 0 for _ in resp]
                rollouts.append(Rollout(
                    prompt_ids=prompt, response_ids=resp, loss_mask=mask,
                    advantages=[reward - mean] * len(resp),
                    old_logprobs=[uniform + rng.uniform(-0.05, 0.05) for _ in resp],
                    ref_logprobs=[uniform + rng.uniform(-0.05, 0.05) for _ in resp],
                    numerator_mask=[m if rng.random() > 0.05 else 0 for m in mask],
                    group_id=f"s{step}-p{p}",
                ))
        steps[step] = rollouts
    return steps


def load_steps(args) -> dict:
    if args.rollouts is None:
        return synthetic_rollouts(vocab_size=args.vocab_size, seed=args.seed)
    from .rollout_io import RolloutFormatError, load_rollouts

    try:
        return load_rollouts(args.rollouts, vocab_size=args.vocab_size, require_ref=args.pg_kl_coef > 0)
    except RolloutFormatError as err:
        raise StartupError(f"refusing to start: {err}") from err


def _check_steps(steps: dict, args, world: int) -> dict:
    """Every step must be plannable before the first update: a step that would fail at iteration
    k must not let iterations 0..k-1 train first. Returns the steps packed as RolloutBatch."""
    from .planner import PlanConfig, padded_lengths, policy_loss_notes, require_inputs
    from .rollouts import PlanError, RolloutBatch

    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    dp = world // (tp * pp * cp)
    cfg = PlanConfig(dp_size=dp, max_tokens_per_microbatch=args.max_tokens_per_microbatch, tp_size=tp,
                     sequence_parallel=args.sequence_parallel, cp_size=cp)
    bins = dp * (args.num_microbatches or 2) if args.max_tokens_per_microbatch is None else dp
    loss_cfg = config_from_args(args)
    packed = {}
    for key, rollouts in steps.items():
        try:
            if not rollouts:
                raise PlanError(f"step {key} has no rollouts")
            # packed once: each iteration then plans from flat tensors (vectorised, fast)
            packed[key] = RolloutBatch.from_rollouts(rollouts, vocab_size=args.vocab_size)
            padded_lengths(packed[key], cfg, step=key)
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


# ----------------------------------------------------------------------------- checkpoints


def _atomic_write(path: str, write) -> None:
    """``write(binary_file)`` into a temp file beside ``path``, flushed to disk, then renamed over
    ``path``: readers see the old file or the whole new one, never a torn one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(directory: str, iteration: int, model, optimizer, rank: int, extra: dict) -> str:
    """Per-rank files under ``iter_XXXXXXX/``; ``latest`` is rewritten (atomically, by rank 0) only
    after every rank's file is complete, so a kill mid-save leaves the previous checkpoint usable."""
    import torch
    import torch.distributed as dist

    path = os.path.join(directory, f"iter_{iteration:07d}")
    os.makedirs(path, exist_ok=True)
    state = {
        "iteration": iteration,
        "model": [chunk.state_dict() for chunk in model],
        "optimizer": optimizer.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        **extra,
    }
    _atomic_write(os.path.join(path, f"rank_{rank:05d}.pt"), lambda f: torch.save(state, f))
    dist.barrier()
    if rank == 0:
        _atomic_write(os.path.join(directory, "latest"), lambda f: f.write(f"{iteration}\n".encode()))
    dist.barrier()
    return path


def load_checkpoint(directory: str, model, optimizer, rank: int) -> dict:
    """Restore this rank's state from the checkpoint ``latest`` names; {} when there is none."""
    import torch

    latest = os.path.join(directory, "latest")
    if not os.path.exists(latest):
        return {}
    with open(latest) as f:
        iteration = int(f.read().strip())
    path = os.path.join(directory, f"iter_{iteration:07d}", f"rank_{rank:05d}.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    for chunk, sd in zip(model, state["model"]):
        chunk.load_state_dict(sd)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state


# ----------------------------------------------------------------------------- logging


class MetricsLog:
    """Rank 0's per-step record: a progress line on stderr, a JSONL file, TensorBoard if present."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str], total: int, enabled: bool):
        self.enabled, self.total = enabled, total
        self.file = None
        self.tb = None
        if not enabled:
            return
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(tensorboard_dir)
            except ImportError:
                print("[train] tensorboard is not installed: --tensorboard-dir ignored", file=sys.stderr)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        it = record["iteration"]
        width = 24
        done = int(width * it / self.total)
        bar = "#" * done + "-" * (width - done)
        shown = " ".join(
            f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}"
            for k in ("objective", "weight", "clip_fraction", "kl", "entropy", "grad_norm", "tokens_per_s")
            if record.get(k) is not None)
        moe = {k: v[0] / v[1] for k, v in record.items() if k.startswith("moe_") and isinstance(v, list) and v[1]}
        shown += "".join(f" {k}={v:.4g}" for k, v in moe.items())
        print(f"[train] [{bar}] {it}/{self.total} {shown}", file=sys.stderr, flush=True)
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb:
            for k, v in {**record, **moe}.items():
                if isinstance(v, (int, float)) and k != "iteration":
                    self.tb.add_scalar(k, v, it)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


# ----------------------------------------------------------------------------- training


@dataclass
class RunState:
    iteration: int = 0
    skipped: int = 0


def _param_checksum(model) -> float:
    """Sum of all local parameters in float64, all-reduced over the world (each parameter counted
    once per DP x CP replica): a cheap fingerprint to compare runs."""
    import torch
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64)
    for chunk in model:
        for p in chunk.parameters():
            total += p.detach().double().sum()
    dist.all_reduce(total)
    return float(total)


def _grad_square_sum(model, device=None) -> float:
    """Sum of squared main gradients over every rank (replicas counted each time): 0 exactly
    when every gradient is 0."""
    import torch
    import torch.distributed as dist

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

    args: argparse.Namespace
    loss_cfg: object
    """The typed loss config (``PGLossConfig``), built once from the flags."""
    plan_cfg: object
    """The ``PlanConfig``, built once from the flags and the parallel sizes."""
    steps: dict
    """``{rollout step: RolloutBatch}``, checked before any process group."""
    model: list
    optimizer: object
    state: RunState
    log: MetricsLog
    rank: int
    device: object
    experts: bool


def setup(args) -> Session:
    """Checks (before any process group), patches, process groups, model, optimizer and resume."""
    import torch
    import torch.distributed as dist

    die_with_launcher()

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    from .model import te_usable

    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_startup(args, world, backend=backend, te=te_usable())
    loss_cfg = config_from_args(args)
    steps = load_steps(args)  # rollouts are validated on the host before any process group
    steps = _check_steps(steps, args, world)

    from .parallel import init_distributed, init_parallel

    experts = args.num_experts is not None
    from .patches import apply_megatron_patches

    # cpu_gloo: CPU/gloo shim (MoE layers included); moe_aux_loss: router aux/z losses keep
    # Megatron's default strength under the per-token contract (patches/moe_aux_loss.py)
    apply_megatron_patches(cpu_gloo=not cuda, moe_aux_loss=experts)
    init_distributed(backend=backend, timeout_s=args.distributed_timeout_minutes * 60)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank = dist.get_rank()

    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from .megatron_loss import check_megatron_config
    from .model import build_model_chunks, default_ddp_config, tiny_transformer_config, wrap_in_ddp
    from .planner import PlanConfig

    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    vpp = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        vpp = args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
        vpp = vpp if vpp > 1 else None
    ep = args.expert_model_parallel_size
    # every group megatron creates (DP, TP, PP, ...) gets the timeout too, not only the default one
    init_parallel(tp, pp, vpp, cp, seed=args.seed, ep=ep, timeout_minutes=args.distributed_timeout_minutes)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    # the allgather dispatcher refuses variable_seq_lengths, and on gloo its EP all-gather needs
    # one token count per microbatch on every rank: pad microbatches to one length there
    allgather = experts and args.moe_token_dispatcher_type == "allgather"
    uniform_tokens = vpp is not None or (allgather and (pp > 1 or ep > 1))
    moe_kwargs = {} if not experts else dict(
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
        expert_model_parallel_size=ep, moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        # megatron-core 0.16's expert MLP cannot add a bias under autograd (check_megatron_config
        # says why): MoE models here have no linear biases, as most MoE LLMs
        add_bias_linear=False,
    )
    config = tiny_transformer_config(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=args.bf16,
        use_cpu_initialization=not cuda,
        variable_seq_lengths=pp > 1 and not uniform_tokens,
        batch_p2p_comm=args.batch_p2p_comm,
        calculate_per_token_loss=args.calculate_per_token_loss,
        **moe_kwargs,
    )
    torch.manual_seed(args.seed)
    chunks = build_model_chunks(config, args.vocab_size, args.max_position_embeddings,
                                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    if cuda:
        chunks = [c.cuda() for c in chunks]
    ddp_config = default_ddp_config(grad_reduce_in_fp32=True)
    model = wrap_in_ddp(chunks, config, ddp_config)
    config.finalize_model_grads_func = finalize_model_grads
    check_megatron_config(config, ddp_config, backend=backend)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=args.weight_decay,
                        clip_grad=args.clip_grad, bf16=args.bf16, params_dtype=dtype), model)

    state = RunState()
    if args.load:
        loaded = load_checkpoint(args.load, model, optimizer, rank)
        if loaded:
            state = RunState(iteration=loaded["iteration"], skipped=loaded.get("skipped", 0))
        elif rank == 0:
            print(f"[train] --load {args.load}: no complete checkpoint yet (no 'latest'); starting "
                  "from the initial weights", file=sys.stderr, flush=True)
    metrics_path = args.metrics_file or os.path.join(args.save or os.path.join("runs", "train_actor"), "metrics.jsonl")
    log = MetricsLog(metrics_path, args.tensorboard_dir, args.train_iters, enabled=rank == 0)
    if rank == 0:
        print(f"[train] world={world} TP={tp} PP={pp}{f' (vpp={vpp})' if vpp else ''} CP={cp} "
              f"DP={parallel_state.get_data_parallel_world_size()} backend={backend} "
              f"mode={loss_cfg.canonical_mode} steps={len(steps)} start_iteration={state.iteration}"
              + (f" experts={args.num_experts} top{args.moe_router_topk} EP={ep} "
                 f"dispatcher={args.moe_token_dispatcher_type}" if experts else ""),
              file=sys.stderr, flush=True)
    plan_cfg = PlanConfig(
        dp_size=parallel_state.get_data_parallel_world_size(),
        num_microbatches=None if args.max_tokens_per_microbatch else (args.num_microbatches or 2),
        max_tokens_per_microbatch=args.max_tokens_per_microbatch,
        tp_size=tp, sequence_parallel=args.sequence_parallel, cp_size=cp, vocab_size=args.vocab_size,
        uniform_microbatch_tokens=uniform_tokens,
    )
    return Session(args=args, loss_cfg=loss_cfg, plan_cfg=plan_cfg, steps=steps, model=model,
                   optimizer=optimizer, state=state, log=log, rank=rank,
                   device=torch.device("cuda") if cuda else None, experts=experts)


def train_step(s: Session) -> dict:
    """One optimizer step on rollout step ``iteration mod S``: plan -> schedule -> finalize ->
    checks -> optimizer -> metrics. Returns the step's metrics record."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from .losses import REPORT_KEYS
    from .megatron_loss import make_forward_step, run_schedule
    from .moe import begin_moe_step, router_loss_pairs, router_loss_values
    from .planner import plan_step

    args, state, model, device = s.args, s.state, s.model, s.device
    step_keys = sorted(s.steps)
    key = step_keys[state.iteration % len(step_keys)]
    t0 = time.perf_counter()
    plan = plan_step(s.steps[key], s.loss_cfg, s.plan_cfg, cp_rank=parallel_state.get_context_parallel_rank())
    mbs = plan.for_rank(parallel_state.get_data_parallel_rank())
    for chunk in model:
        chunk.zero_grad_buffer()
    s.optimizer.zero_grad()
    if s.experts:  # the router losses' per-step factor W / M_total (host integers, no collective)
        begin_moe_step(plan.totals.pg_weight, len(mbs), s.plan_cfg.dp_size)
    forward_step = make_forward_step(s.loss_cfg, plan.totals, device=device,
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
        if not args.pg_skip_nonfinite_steps:
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
    if args.pipeline_model_parallel_size > 1:
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
    import torch.distributed as dist

    args, state = s.args, s.state
    if args.save and not (args.save_interval and state.iteration % args.save_interval == 0):
        save_checkpoint(args.save, state.iteration, s.model, s.optimizer, s.rank, {"skipped": state.skipped})
    checksum = _param_checksum(s.model)
    if s.rank == 0:
        record["param_checksum"] = checksum
        if s.log.file:
            s.log.file.write(json.dumps({"final": True, "iteration": state.iteration,
                                         "param_checksum": checksum, "skipped_total": state.skipped}) + "\n")
        print(f"[train] done: {state.iteration} iterations, objective={record.get('objective', float('nan')):.6g}, "
              f"param_checksum={checksum:.10g}, skipped={state.skipped}", file=sys.stderr, flush=True)
    s.log.close()
    dist.destroy_process_group()
    return record


def train(args) -> dict:
    """Run the whole job: setup, steps, close. Returns rank 0's last metrics record (empty dict
    elsewhere)."""
    s = setup(args)
    record = {}
    while s.state.iteration < args.train_iters:
        record = train_step(s)
        if s.state.iteration % args.log_interval == 0 or s.state.iteration == args.train_iters:
            s.log.log(record)
        if args.save and args.save_interval and s.state.iteration % args.save_interval == 0:
            save_checkpoint(args.save, s.state.iteration, s.model, s.optimizer, s.rank,
                            {"skipped": s.state.skipped})
    return close(s, record)


def main(argv=None) -> int:
    keep_freed_memory()
    quiet_cpu_fallbacks("[train]")
    args = build_parser().parse_args(argv)
    try:
        train(args)
    except StartupError as err:
        print(f"[train] {err}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteStepError as err:
        print(f"[train] stopped: {err}", file=sys.stderr, flush=True)
        return 3
    return 0
