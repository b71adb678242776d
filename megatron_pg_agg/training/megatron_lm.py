"""The policy-gradient actor inside Megatron-LM's own training loop (``pretrain()``).

``launch/pretrain_actor.py`` is the torchrun entry point; this module holds its pieces. Megatron-LM
owns the loop, the model flags, checkpoints (``--save``/``--load``), LR schedule, logging and
TensorBoard; the project adds only what the objective needs:

* flags (``extra_args_provider``): the ``--pg-*`` loss flags, ``--pg-rollouts FILE`` (the rollout
  JSONL format; default: the built-in synthetic set), ``--pg-metrics-file FILE``;
* a model provider: Megatron-LM's own ``model_provider(gpt_builder, ...)``, so every model flag
  works; without Transformer Engine (CPU) the local spec's core attention is given packed-THD
  boundaries (:func:`megatron_pg_agg.megatron.thd_attention.use_thd_core_attention`);
* a data provider (``--dataloader-type external``): per optimizer step, rollout step
  ``iteration mod (number of steps)`` is planned on the host (:func:`~megatron_pg_agg.data.planner.plan_step`)
  into exactly ``get_num_microbatches()`` THD microbatches per DP rank of at most ``--seq-length``
  tokens (padded to exactly ``--seq-length`` with PP > 1: Megatron-LM's p2p buffers have that
  shape); the step weights are computed once per step before the split. Every rollout step is
  planned once at start-up (the checks); with ``--pg-plan-ahead`` (default) those plans are
  dropped and iteration ``i + 1`` is planned on a background thread while ``i`` runs (two plans
  held), with ``--no-pg-plan-ahead`` the start-up plans are kept and read (:mod:`megatron_pg_agg.data.feed`);
* the forward step and loss function of :mod:`megatron_pg_agg.megatron.loss_func` (the 3-tuple
  per-token contract that ``--calculate-per-token-loss`` turns on);
* start-up checks that exit with status 2 listing every problem, before the first step;
* one console line per logged iteration (Megatron-LM's own console drops values that are not
  > 0, so a negative objective vanishes there), TensorBoard scalars through Megatron-LM's writer,
  and ``--pg-metrics-file`` JSON lines.

Iteration ``i`` (0-based) trains on rollout step ``i mod S``: the data position is Megatron-LM's
iteration counter, restored by its ``--load``.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
import os
import sys
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from megatron_pg_agg.core.losses import REPORT_KEYS, PGLossConfig
from megatron_pg_agg.data.feed import RolloutFeed
from megatron_pg_agg.data.planner import policy_loss_notes
from megatron_pg_agg.megatron import upstream_bugs
from megatron_pg_agg.patches import apply_megatron_patches, megatron_lm_log, mtp_loss, rope_thd
from megatron_pg_agg.patches._megatron_lm_release import UnsupportedMegatronLM, check_checkout
from megatron_pg_agg.patches.cpu import optimizer_cpu
from megatron_pg_agg.versions import in_range, installed_megatron_core_version

from .args import add_pg_agg_args, add_plan_ahead_arg, config_from_args, flag_value
from .logs import setup_logging

# megatron.* (and the modules of megatron_pg_agg.megatron, which import it) are imported inside the
# functions: the checkout's megatron.training exists only once use_checkout() has run, and
# megatron.core's start-up warnings must meet the filters quiet_startup_noise() sets in main()
from .rollout_steps import load_steps
from .run_config import DataConfig, StartupError
from .worker_process import die_with_launcher, quiet_startup_noise, release_process_group

logger = logging.getLogger(__name__)

ENV_CHECKOUT = "MEGATRON_LM_PATH"
PG_PREFIX = "[pg]"


# ----------------------------------------------------------------------------- the checkout


def find_checkout(argv: list) -> str:
    """The Megatron-LM root from ``--megatron-lm PATH`` (or ``=PATH``), else ``$MEGATRON_LM_PATH``.

    Raises StartupError when neither names a directory holding ``megatron/training``."""
    path = flag_value(argv, "--megatron-lm")
    source = "--megatron-lm"
    if path is None:
        path, source = os.environ.get(ENV_CHECKOUT), ENV_CHECKOUT
    if not path:
        raise StartupError(f"no Megatron-LM checkout: pass --megatron-lm PATH or set {ENV_CHECKOUT} "
                           "(a checkout of NVIDIA Megatron-LM, tags core_v0.15.x to core_v0.19.x)")
    root = os.path.abspath(path)
    if not os.path.isdir(os.path.join(root, "megatron", "training")):
        raise StartupError(f"{source} {path}: no megatron/training there; expected the root of a "
                           "Megatron-LM checkout (tags core_v0.15.x to core_v0.19.x)")
    return root


def use_checkout(root: str) -> None:
    """Put the checkout first on ``sys.path``: ``megatron.training`` and the top-level
    ``model_provider``/``gpt_builders`` come from it (``megatron`` is a namespace package, so the
    installed megatron-core still supplies ``megatron.core`` where the checkout has none)."""
    if root not in sys.path:
        sys.path.insert(0, root)


# ----------------------------------------------------------------------------- flags


def add_actor_args(parser):
    """``extra_args_provider`` of the entry point: the ``--pg-*`` loss flags and the data flags.

    ``--eval-iters`` defaults to 0 here: an RL actor step has no validation set (a value > 0 is
    refused at start-up); ``--eval-interval`` gets a default because Megatron-LM's sample count
    divides by it even when nothing is evaluated."""

    add_pg_agg_args(parser)
    group = parser.add_argument_group("policy-gradient data (megatron_pg_agg)")
    group.add_argument("--pg-rollouts", default=None, metavar="FILE",
                       help="rollout JSON Lines (docs/rollout-format.md); default: the built-in synthetic set")
    group.add_argument("--pg-metrics-file", default=None, metavar="FILE",
                       help="append one JSON record per iteration (rank 0)")
    group.add_argument("--megatron-lm", default=None, metavar="PATH",
                       help=f"Megatron-LM checkout root (else ${ENV_CHECKOUT})")
    add_plan_ahead_arg(group)
    parser.set_defaults(eval_iters=0, eval_interval=1000)
    return parser


def startup_problems(args, *, cuda: bool, megatron_core: str, mtp: bool = True) -> list:
    """Every problem in the parsed Megatron-LM flags that would make the objective wrong or the
    run fail later, on the installed ``megatron_core`` release; empty when the run may start.
    ``mtp=False``: the caller judges ``--mtp-num-layers`` itself (the RL entry refuses it).
    Pure: reads ``args`` only."""
    problems = []
    if not args.calculate_per_token_loss:
        problems.append(
            "--calculate-per-token-loss is missing: without it Megatron-LM divides each microbatch's "
            "loss by its own count and averages the microbatch means, which is not the chosen "
            "aggregation (it trains silently with different gradients). Add --calculate-per-token-loss.")
    if args.dataloader_type not in (None, "external"):
        problems.append(
            f"--dataloader-type {args.dataloader_type}: the actor's microbatches come from the rollout "
            "planner as an external iterator; drop the flag (it is set to external) or pass "
            "--dataloader-type external.")
    if args.micro_batch_size != 1:
        problems.append(
            f"--micro-batch-size {args.micro_batch_size}: rollouts are packed as THD, one row of at most "
            "--seq-length tokens per microbatch; use --micro-batch-size 1 and raise --seq-length.")
    if args.eval_iters:
        problems.append(f"--eval-iters {args.eval_iters}: the actor has no validation set; use --eval-iters 0.")
    if args.train_iters is None:
        problems.append("--train-iters is required (one iteration = one optimizer step = one rollout step).")
    if getattr(args, "ddp_average_in_collective", False):
        problems.append("--ddp-average-in-collective averages gradients over DP before the division by "
                        "the global weight; drop it.")
    if mtp and args.mtp_num_layers:
        problems.extend(_mtp_problems(args, megatron_core))
    if args.fp16:
        problems.append("--fp16 is not supported with the policy-gradient loss: its dynamic loss scale skips "
                        "overflowing iterations, and that path has not been checked exact here (megatron-core's "
                        "grad scaler is CUDA-only, so no CPU test runs it); use --bf16, which needs no loss scale.")
    if args.pg_skip_nonfinite_steps:
        problems.append("--pg-skip-nonfinite-steps belongs to launch/train_actor.py; in Megatron-LM a "
                        "non-finite loss or gradient is handled by its own --check-for-nan-in-loss-and-grad "
                        "(on by default: the run stops) and, with fp16, by skipped iterations.")
    if getattr(args, "pg_rollouts", None) is not None and not os.path.isfile(args.pg_rollouts):
        problems.append(f"--pg-rollouts {args.pg_rollouts}: no such file.")
    if not cuda:
        cpu_needs = [
            (args.distributed_backend != "gloo", "--distributed-backend gloo"),
            (args.transformer_impl != "local", "--transformer-impl local (Transformer Engine needs CUDA)"),
            (args.gradient_accumulation_fusion, "--no-gradient-accumulation-fusion"),
            (not args.no_persist_layer_norm, "--no-persist-layer-norm"),
            (args.context_parallel_size > 1, "--context-parallel-size 1 (CP attention needs Transformer Engine)"),
            (args.sequence_parallel, "no --sequence-parallel (the local spec's torch norms refuse it)"),
        ]
        wrong = [fix for bad, fix in cpu_needs if bad]
        if wrong:
            problems.append("on CPU (no CUDA) Megatron-LM needs: " + "; ".join(wrong) + ".")
    return problems


def _mtp_problems(args, megatron_core: str) -> list:
    """Multi-token prediction: megatron-core 0.16 or newer, a factor > 0, no ``--spec``."""
    problems = []
    if not in_range(megatron_core, mtp_loss.SUPPORTED):
        problems.append(f"--mtp-num-layers: {mtp_loss.UNSUPPORTED_REASON} (installed: {megatron_core}).")
    factor = args.mtp_loss_scaling_factor
    if factor is None or not factor > 0:
        problems.append(f"--mtp-loss-scaling-factor {factor}: multi-token prediction needs a factor > 0.")
    if getattr(args, "spec", None) is not None:
        problems.append("--spec with --mtp-num-layers: Megatron-LM's gpt_builders reads use_te only where "
                        "--spec is not given and fails with an UnboundLocalError; drop --spec.")
    return problems


# ----------------------------------------------------------------------------- data


# ----------------------------------------------------------------------------- the actor


class Actor:
    """The providers handed to ``pretrain()`` and the per-iteration log, for one run.

    Built on every rank before ``pretrain()``; the data feed is built when Megatron-LM asks for
    data (after the model, the optimizer and ``--load``), so it starts at the loaded iteration."""

    def __init__(self, args, steps: dict, *, cuda: bool, loss_cfg: PGLossConfig, data: DataConfig):
        self.loss_cfg = loss_cfg
        """The run's ``PGLossConfig`` (built once in :func:`run`)."""
        self.data = data
        """The run's data config: the rollouts' source and the microbatch capacity (``--seq-length``)."""
        self.steps, self.cuda = steps, cuda
        self.feed: Optional[RolloutFeed] = None
        self.metrics_path = args.pg_metrics_file
        self.moe = bool(args.num_experts)
        """Routers' aux/z losses keep Megatron's strength: patch ``moe_aux_loss``, factor per step."""
        self.mtp = bool(args.mtp_num_layers)
        """Multi-token prediction: patch ``mtp_loss``, factor ``W / D`` per step, ``mtp_loss`` reported."""
        self._forward = None  # the PlannedForward, made at the first microbatch (after the feed)
        self._first_logged: Optional[int] = None

    # Megatron-LM's model provider, with the THD core attention where TE is not used
    def model_provider(self, pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        """Megatron-LM's own ``model_provider(gpt_builder, ...)``. ``config`` and
        ``pg_collection`` are passed by name where it takes them (core_v0.16+); core_v0.15's
        ``get_model`` never gives them."""

        from gpt_builders import gpt_builder
        from model_provider import model_provider

        from megatron_pg_agg.megatron.thd_attention import use_thd_core_attention

        accepted = inspect.signature(model_provider).parameters
        # a value given for a parameter it lacks is passed anyway: a TypeError, never dropped
        extra = {k: v for k, v in (("config", config), ("pg_collection", pg_collection))
                 if k in accepted or v is not None}
        model = model_provider(gpt_builder, pre_process, post_process, vp_stage, **extra)
        use_thd_core_attention(model)  # the MTP layer's attention too
        if model.config.mtp_num_layers:
            from megatron_pg_agg.megatron.mtp import return_main_logits

            return_main_logits(model)
        return model

    def datasets_provider(self, train_val_test_num_samples, vp_stage=None):
        """``(train iterator, None, None)``; one iterator per call (one per virtual stage)."""
        if self.feed is None:
            self.feed = self._build_feed()
        from megatron.training import get_args

        return self.feed.microbatches(get_args().iteration), None, None

    datasets_provider.is_distributed = True  # every rank (TP ranks too) builds its own iterator

    def _build_feed(self) -> RolloutFeed:
        from megatron.core import parallel_state as mpu
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args

        args = get_args()
        plan_cfg = self.data.plan_config(
            dp_size=mpu.get_data_parallel_world_size(), tp_size=args.tensor_model_parallel_size,
            sequence_parallel=args.sequence_parallel, cp_size=args.context_parallel_size,
            num_microbatches=get_num_microbatches(), vocab_size=args.padded_vocab_size,
            microbatch_tokens=args.seq_length if args.pipeline_model_parallel_size > 1 else None)
        feed = RolloutFeed(self.steps, self.loss_cfg, plan_cfg, dp_rank=mpu.get_data_parallel_rank(),
                           cp_rank=mpu.get_context_parallel_rank(), pin=self.cuda,
                           plan_ahead=self.data.plan_ahead, end_iteration=args.train_iters)
        problems = feed.problems()
        if problems:
            raise StartupError(
                "the rollouts do not fit Megatron-LM's flags (padded vocabulary "
                f"{args.padded_vocab_size}, {plan_cfg.num_microbatches} microbatches of at most "
                f"{args.seq_length} tokens per DP rank):\n- " + "\n- ".join(problems))
        for note in policy_loss_notes(self.steps, self.loss_cfg):
            logger.info(f"note: {note}")
        if mpu.get_data_parallel_rank() == 0 and args.rank == 0:
            logger.info(f"{len(feed.keys)} rollout steps, mode={self.loss_cfg.mode}, "
                 f"{plan_cfg.num_microbatches} microbatches x DP {plan_cfg.dp_size} per step, "
                 f"starting at iteration {args.iteration} (rollout step {feed.step_key(args.iteration)})")
        return feed

    def forward_step(self, data_iterator, model):
        """Megatron-LM forward step: the next planned microbatch through the model, and the
        per-token loss function with that step's host totals (:class:`PlannedForward`)."""
        if self._forward is None:
            self._check_config(model)
            from megatron_pg_agg.megatron.planned_step import PlannedForward

            plan_cfg = self.feed.plan_cfg if self.feed is not None else None  # the RL entry: no feed, no MoE
            self._forward = PlannedForward(self.loss_cfg, cuda=self.cuda, moe=self.moe, mtp=self.mtp,
                                           num_microbatches=plan_cfg and plan_cfg.num_microbatches,
                                           dp_size=plan_cfg and plan_cfg.dp_size)
        return self._forward(next(data_iterator), model)

    def _check_config(self, model) -> None:
        """The real model config and DDP config Megatron-LM built, checked before the first
        microbatch (``finalize_model_grads_func`` is set by ``train()``, after the providers)."""
        from megatron.core.utils import get_model_config

        from megatron_pg_agg.megatron.config_checks import MegatronConfigError, check_megatron_config

        try:
            check_megatron_config(get_model_config(model), getattr(model, "ddp_config", None))
        except MegatronConfigError as err:
            raise StartupError(str(err)) from err

    def close(self) -> None:
        """The end of the run: the feed's background planning ends (a plan in flight is waited for)."""
        if self.feed is not None:
            self.feed.close()

    def step_ran(self, iteration: int) -> tuple:
        """``(plan, {record fields naming its data})`` of 0-based ``iteration``."""
        return self.feed.plan(iteration), {"rollout_step": self.feed.step_key(iteration)}

    def on_training_log(self, event) -> None:
        """Every rank, every iteration: share the step's reduced report from the last pipeline
        stage (one small broadcast), then rank 0 prints, appends JSON, and the rank holding
        Megatron-LM's TensorBoard writer writes scalars."""
        from megatron.training import get_args, get_tensorboard_writer

        from megatron_pg_agg.megatron.planned_step import iteration_record

        args = get_args()
        plan, where = self.step_ran(event.iteration - 1)
        record, reduced = iteration_record(event.loss_dict, plan, iteration=event.iteration, mtp=self.mtp,
                                           cuda=self.cuda)
        record.update(**where, grad_norm=event.grad_norm, learning_rate=event.learning_rate,
                      skipped=bool(event.skipped_iter))
        writer = get_tensorboard_writer()
        if writer and event.iteration % args.tensorboard_log_interval == 0:
            for key in ("weight", "valid_tokens", *REPORT_KEYS):
                if record.get(key) is not None:
                    writer.add_scalar(f"pg/{key}", record[key], event.iteration)
            if self.mtp and not math.isnan(reduced["mtp_loss"]):
                writer.add_scalar("pg/mtp_loss", reduced["mtp_loss"], event.iteration)
        if dist.get_rank() != 0:
            return
        first = self._first_logged is None
        self._first_logged = self._first_logged or event.iteration
        if first or event.iteration % args.log_interval == 0 or event.iteration == args.train_iters:
            # Megatron-LM's own line comes on the same iterations (the first, then every interval)
            shown = " | ".join(f"{k} {record[k]:.6g}" for k in
                               ("objective", "weight", "clip_fraction", "kl", "entropy", "grad_norm")
                               if record.get(k) is not None)
            if self.mtp and not math.isnan(reduced["mtp_loss"]):
                shown += f" | mtp_loss {reduced['mtp_loss']:.6g}"
            logger.info(f"iteration {event.iteration}/{args.train_iters} | {shown}")
        if self.metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_path)), exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------- main


def _single_process_defaults() -> None:
    """Outside torchrun, a one-process run: rank 0 of 1 on a free local port."""
    if "RANK" in os.environ:
        return
    from megatron_pg_agg.megatron.parallel import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def run(argv: list) -> int:
    """Check, then hand the run to Megatron-LM's ``pretrain()``. Returns the exit status."""

    cuda = torch.cuda.is_available()
    if not cuda:  # Megatron-LM asserts it with TP > 1 on pre-Blackwell devices; no effect on CPU
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    root = find_checkout(argv)
    use_checkout(root)

    try:
        # rope_thd: 0.19's unfused packed RoPE in one shot (patches/rope_thd.py)
        apply_megatron_patches(cpu_gloo=not cuda, megatron_lm_cpu=not cuda, megatron_lm_log=True,
                               rope_thd=rope_thd.needed())
        release = check_checkout()
    except (UnsupportedMegatronLM, RuntimeError) as err:
        raise StartupError(str(err)) from err
    sys.argv = [sys.argv[0], *argv]  # Megatron-LM parses sys.argv
    args = _parse_args(release)
    problems = startup_problems(args, cuda=cuda, megatron_core=installed_megatron_core_version())
    if problems:
        raise StartupError(problems)
    # Megatron's --bf16 and --use-distributed-optimizer on CPU: the optimizers' CUDA type strings
    apply_megatron_patches(cpu_gloo=False, optimizer_cpu=optimizer_cpu.needed(
        cuda=cuda, bf16=args.bf16, distributed_optimizer=args.use_distributed_optimizer))
    if args.num_experts:  # routers' aux/z losses keep Megatron's strength under every mode
        apply_megatron_patches(cpu_gloo=False, moe_aux_loss=True)
    if args.mtp_num_layers:  # the MTP loss is a token mean over the step's valid tokens in every mode
        apply_megatron_patches(cpu_gloo=False, mtp_loss=True)

    # the loss and data configs as launch/train_actor.py builds them (the parser checked the loss)
    loss_cfg, data = config_from_args(args), DataConfig.from_megatron_lm_args(args)
    # before any process group; token ids meet the padded vocabulary when each step is planned
    steps = load_steps(data, loss_cfg, vocab_size=args.vocab_size, seed=args.seed, check_vocabulary=False)
    if not any(a == "--dataloader-type" or a.startswith("--dataloader-type=") for a in argv):
        logger.info("--dataloader-type external (set: the planner feeds the microbatches)")
    actor = Actor(args, steps, cuda=cuda, loss_cfg=loss_cfg, data=data)

    megatron_lm_log.add_observer(actor.on_training_log)
    try:
        _pretrain(release, args, actor)
    finally:
        megatron_lm_log.remove_observer(actor.on_training_log)
        actor.close()
    return 0


ARGS_DEFAULTS = {"dataloader_type": "external"}
"""Megatron-LM ``args_defaults``: the planner feeds the microbatches."""


def _parse_args(release):
    """Megatron-LM's flags plus the actor's, parsed once for the start-up checks. Up to
    core_v0.17 ``pretrain()`` parses and validates again itself (``extra_args_provider``); from
    core_v0.18 ``parse_and_validate_args`` is the one parse and sets Megatron-LM's globals."""
    if release.uses_config_container:
        from megatron.training.arguments import parse_and_validate_args

        return parse_and_validate_args(extra_args_provider=add_actor_args, args_defaults=ARGS_DEFAULTS)
    from megatron.training.arguments import parse_args

    return parse_args(add_actor_args)


def _pretrain(release, args, actor) -> None:
    """Megatron-LM's ``pretrain()`` with the actor's providers, every argument bound by name.

    From core_v0.18 through a config container made from ``args`` without a model config
    (``pretrain_cfg_container_from_args(args)``): with ``cfg.model`` set, core_v0.19 builds the
    model itself and skips ``get_model`` and the model provider, and with them the THD core
    attention hook and the CPU patch's ``get_model`` path; without it both run as up to 0.17."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    providers = dict(train_valid_test_dataset_provider=actor.datasets_provider,
                     model_provider=actor.model_provider, model_type=ModelType.encoder_or_decoder,
                     forward_step_func=actor.forward_step)
    if not release.uses_config_container:
        pretrain(**providers, extra_args_provider=add_actor_args, args_defaults=ARGS_DEFAULTS)
        return

    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    with warnings.catch_warnings():
        # the deliberate choice above: no ModelConfig, so the model provider (and the hooks) run
        warnings.filterwarnings("ignore", message=r"\s*It is recommended to use a ModelConfig", category=UserWarning)
        cfg = pretrain_cfg_container_from_args(args)
    pretrain(cfg_container=cfg, **providers)


def main(argv: Optional[list] = None) -> int:
    return run_entry(run, argv)


def argv_problems(argv: list) -> list:
    """Refusals of the raw command line, before Megatron-LM parses it: combinations its own
    argument validation asserts on every rank as a traceback instead of a message."""
    problems = []
    mtp = flag_value(argv, "--mtp-num-layers")
    position = flag_value(argv, "--position-embedding-type")
    if mtp is not None and (position or "learned_absolute") not in ("rope", "none"):
        shown = position or "learned_absolute (Megatron-LM's default)"
        problems.append(f"--mtp-num-layers {mtp} with --position-embedding-type {shown}: Megatron-LM's multi-token "
                        "prediction needs rope or none (its argument validation asserts it on every rank); add "
                        "--position-embedding-type rope")
    # megatron-core's known silent bugs, from the raw flags: before Megatron-LM's own validation,
    # which (0.18+) would stop a one-process launch of TP 2 on the world size first
    tp = flag_value(argv, "--tensor-model-parallel-size") or "1"
    problems.extend(upstream_bugs.known_bug_problems(
        softmax_type=flag_value(argv, "--softmax-type"),
        tensor_model_parallel_size=int(tp) if tp.isdigit() else 1,  # not a number: Megatron-LM's parser says so
        experimental_attention_variant=flag_value(argv, "--experimental-attention-variant"),
        use_megatron_fsdp="--use-megatron-fsdp" in argv, use_torch_fsdp2="--use-torch-fsdp2" in argv,
        names=upstream_bugs.MEGATRON_LM_NAMES))
    return problems


def run_entry(run_argv, argv: Optional[list] = None) -> int:
    """An entry's process frame around ``run_argv(argv) -> status`` (this one and the RL entry):
    the ``[pg]`` log, quiet start-up, workers that die with their launcher, one-process defaults
    outside torchrun, and exit status 2 for a refused start."""
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging(PG_PREFIX)
    quiet_startup_noise()
    die_with_launcher()  # a killed torchrun takes its workers with it (they run in own sessions)
    _single_process_defaults()
    try:
        problems = argv_problems(argv)
        if problems:
            raise StartupError(problems)
        return run_argv(argv)
    except StartupError as err:
        logger.error(str(err))
        release_process_group()  # some refusals come after pretrain() made the group
        return 2
