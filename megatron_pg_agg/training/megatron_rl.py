"""The policy-gradient actor inside Megatron-LM's own RL loop (train_rl.py, ``megatron/rl``).

``launch/train_rl_actor.py`` is the torchrun entry point; this module holds its pieces. It runs
what Megatron-LM's ``train_rl.py`` runs (its ``pretrain()`` with ``--perform-rl-step``), from a
user's core_v0.19.x checkout, and keeps Megatron-LM's own:

* environments, agents and inference engine (``--langrl-env-config``; or rollouts replayed from a
  file, ``--pg-replay-rollouts``, :mod:`.rl_replay`);
* group advantages, the reference weights, ``--grpo-iterations`` passes, re-collection,
  checkpoints (``--save``/``--load``), LR schedule, and its RL logging and TensorBoard metrics.

The project supplies:

* the step composition (:mod:`.rl_collection`): each optimizer step is ``--global-batch-size /
  --grpo-group-size`` whole prompt groups, planned with the step weights computed before the
  split (a shape that would cut a group across steps is refused at start-up, naming the flags);
* the old and reference log-prob passes on the planner's packed THD microbatches, forward-only
  (``--no-pg-packed-logprobs``: Megatron-LM's unpacked ``compute_logprobs_batch``);
* the forward step and loss function of :mod:`megatron_pg_agg.megatron.loss_func` in place of
  ``train_rl.forward_step`` / ``rl_utils.calculate_grpo_loss``: every ``--pg-loss-aggregation``
  mode and ``--pg-policy-loss``;
* Megatron-LM's own loss flags translated (:func:`translate_loss_flags`: clamp eps, KL beta, the
  IS correction and its truncation), the translation printed once, or refused with the flag to use;
* the ``[pg]`` line, ``--pg-metrics-file`` and ``pg/*`` TensorBoard scalars, as the pretrain entry.

``--pg-loss-source megatron`` runs Megatron-LM's own data path and loss instead (for the peer
cross-check and the benchmark): its records hold its reduced ``lm loss`` and grad norm.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Optional

import torch

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.feed import PlannedMicrobatch
from megatron_pg_agg.patches import apply_megatron_patches, megatron_lm_log, megatron_rl, rope_thd
from megatron_pg_agg.patches._megatron_lm_release import UnsupportedMegatronLM, check_checkout
from megatron_pg_agg.patches.cpu import optimizer_cpu
from megatron_pg_agg.versions import in_range, installed_megatron_core_version

from .args import add_pg_agg_args, add_plan_ahead_arg, config_from_args
from .logs import setup_logging
from .megatron_lm import (
    PG_PREFIX,
    Actor,
    _pretrain,
    find_checkout,
    run_entry,
    startup_problems,
    use_checkout,
)
from .rl_collection import CollectionPlanner, CollectionShape, TokenizerView, shape_problems
from .rl_replay import BUILTIN, ReplayError, ReplaySource, builtin_replay, load_replay
from .run_config import StartupError

logger = logging.getLogger(__name__)

LOSS_SOURCES = ("pg", "megatron")
RL_ARGS_DEFAULTS = {"dataloader_type": "external"}
"""Megatron-LM ``args_defaults`` (they fill only flags left None)."""


# ----------------------------------------------------------------------------- flags


def add_rl_actor_args(parser):
    """``extra_args_provider``: Megatron-LM's inference flags (as train_rl.py adds them), the
    ``--pg-*`` loss flags and the entry's own."""
    from megatron.inference.utils import add_inference_args

    add_inference_args(parser)
    add_pg_agg_args(parser)
    group = parser.add_argument_group("policy-gradient RL actor (megatron_pg_agg)")
    group.add_argument("--pg-replay-rollouts", default=None, metavar="FILE",
                       help="replay recorded rollouts (JSON Lines, see megatron_pg_agg/training/rl_replay.py) "
                            "in place of Megatron-LM's environments; 'builtin' for a small built-in set")
    group.add_argument("--pg-loss-source", default="pg", choices=LOSS_SOURCES,
                       help="pg (default): the project's planner and loss; megatron: Megatron-LM's own "
                            "data path and calculate_grpo_loss (peer cross-check, benchmark)")
    group.add_argument("--pg-metrics-file", default=None, metavar="FILE",
                       help="append one JSON record per iteration (rank 0)")
    group.add_argument("--pg-sequence-packing", action=argparse.BooleanOptionalAction, default=True,
                       help="pack several whole sequences per THD microbatch (default); "
                            "--no-pg-sequence-packing: one sequence per microbatch. Megatron-LM's "
                            "sample counts and learning-rate schedule are those of its unpacked path either way")
    group.add_argument("--pg-max-tokens-per-microbatch", type=int, default=None, metavar="N",
                       help="capacity of a packed microbatch in padded tokens (default --seq-length; at least "
                            "--seq-length, the longest trajectory; with pipeline parallelism it is --seq-length)")
    group.add_argument("--pg-packed-logprobs", action=argparse.BooleanOptionalAction, default=True,
                       help="the old and reference log-prob passes of a collection forward-only on the planner's "
                            "packed THD microbatches (default); --no-pg-packed-logprobs: Megatron-LM's "
                            "compute_logprobs_batch, one row of --seq-length per sequence")
    add_plan_ahead_arg(group)
    group.add_argument("--megatron-lm", default=None, metavar="PATH", help="Megatron-LM checkout root")
    # this entry is Megatron-LM's RL loop: --perform-rl-step is on (before validate_args reads it)
    parser.set_defaults(eval_iters=0, eval_interval=1000, perform_rl_step=True)
    return parser


def _given(argv: list, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


# Megatron-LM flag -> the project's flag that takes its value (same meaning)
TRANSLATED = (
    ("--grpo-clamp-eps-lower", "grpo_clamp_eps_lower", "--pg-clip-eps", "pg_clip_eps"),
    ("--grpo-clamp-eps-upper", "grpo_clamp_eps_upper", "--pg-clip-eps-high", "pg_clip_eps_high"),
    ("--grpo-kl-beta", "grpo_kl_beta", "--pg-kl-coef", "pg_kl_coef"),
)


def translate_loss_flags(args, argv: list) -> tuple:
    """Megatron-LM's RL loss flags onto the ``--pg-*`` ones, in place on ``args``; returns
    ``(translations, problems)`` (lines to print once; refusals naming the flag to use).

    A Megatron-LM flag counts whether given or at its default (a run of this entry without loss
    flags trains Megatron-LM's defaults: clamp 0.01 / 0.01, KL beta 0.001 with k3). A ``--pg-*``
    flag given explicitly wins when it agrees, and is refused when the Megatron-LM flag was given
    too with another value."""
    lines, problems = [], []
    for ml_flag, ml_dest, pg_flag, pg_dest in TRANSLATED:
        value = getattr(args, ml_dest)
        if _given(argv, pg_flag):
            if _given(argv, ml_flag) and getattr(args, pg_dest) != value:
                problems.append(f"{ml_flag} {value} and {pg_flag} {getattr(args, pg_dest)} give one "
                                f"quantity two values; give one of them")
            continue
        setattr(args, pg_dest, value)
        lines.append(f"{ml_flag} {value}{'' if _given(argv, ml_flag) else ' (its default)'} -> {pg_flag} {value}")
    if not _given(argv, "--pg-kl-coef") and args.pg_kl_estimator != "k3" and args.pg_kl_coef:
        problems.append(f"--grpo-kl-beta weights Megatron-LM's k3 estimator (exp(ref - logp) - (ref - logp) "
                        f"- 1); with --pg-kl-estimator {args.pg_kl_estimator} give --pg-kl-coef explicitly")
    if args.grpo_entropy_term_weight:
        problems.append(
            f"--grpo-entropy-term-weight {args.grpo_entropy_term_weight}: Megatron-LM's entropy term is "
            "-p log p of the sampled token alone; the project's --pg-entropy-coef weights the entropy of "
            "the whole next-token distribution, another quantity. Use --pg-entropy-coef (or "
            "--pg-loss-source megatron for Megatron-LM's own term).")
    coef = args.rl_importance_sampling_truncation_coef
    if args.rl_inference_logprobs_is_correction:
        cap = coef if coef is not None else math.inf
        if _given(argv, "--pg-rollout-correction") and args.pg_rollout_correction != "token_truncate":
            problems.append(f"--rl-inference-logprobs-is-correction is Megatron-LM's token-level truncated "
                            f"importance weight (token_truncate); --pg-rollout-correction "
                            f"{args.pg_rollout_correction} is another correction: give one of them")
        elif _given(argv, "--pg-rollout-correction-max") and args.pg_rollout_correction_max != cap:
            problems.append(f"--rl-importance-sampling-truncation-coef {coef} and --pg-rollout-correction-max "
                            f"{args.pg_rollout_correction_max} give the cap two values; give one of them")
        else:
            args.pg_rollout_correction, args.pg_rollout_correction_max = "token_truncate", cap
            lines.append("--rl-inference-logprobs-is-correction"
                         + (f" --rl-importance-sampling-truncation-coef {coef}" if coef is not None else "")
                         + f" -> --pg-rollout-correction token_truncate --pg-rollout-correction-max {cap}")
    elif coef is not None:
        problems.append(f"--rl-importance-sampling-truncation-coef {coef} has no effect in Megatron-LM "
                        "without --rl-inference-logprobs-is-correction; add it, or use --pg-rollout-correction")
    return lines, problems


def rl_startup_problems(args, argv: list, *, cuda: bool, megatron_core: str) -> list:
    """Every problem of the parsed flags for this entry (after :func:`translate_loss_flags`)."""
    problems = startup_problems(args, cuda=cuda, megatron_core=megatron_core, mtp=False)  # MTP: below
    shape = collection_shape(args)
    problems.extend(shape_problems(shape))
    if args.pg_loss_source == "pg":
        problems.extend(packing_problems(args, argv))
    if args.grpo_filter_groups_with_same_reward:
        problems.append("--grpo-filter-groups-with-same-reward: Megatron-LM core_v0.19 asserts it is not "
                        "supported (megatron/rl/agent/api.py); drop it.")
    if args.num_experts:
        problems.append("--num-experts: MoE is not yet supported by the RL entry (the routers' losses in "
                        "Megatron-LM's log-prob passes are not checked); use launch/pretrain_actor.py.")
    if args.mtp_num_layers:
        problems.append("--mtp-num-layers: Megatron-LM's RL loop calls the model without labels, so an MTP "
                        "block would train on every token; not supported by the RL entry.")
    if args.context_parallel_size > 1 and cuda:
        problems.append("--context-parallel-size > 1: not yet supported by the RL entry.")
    if args.tokenizer_type == "NullTokenizer" and args.null_tokenizer_pad_id < 0:
        problems.append(f"--null-tokenizer-pad-id {args.null_tokenizer_pad_id}: Megatron-LM's RL loop pads "
                        "trajectories with the pad id, and -1 is no token; give an id inside the vocabulary.")
    if args.pg_replay_rollouts is None and not args.langrl_env_config:
        problems.append("no rollouts: give Megatron-LM's --langrl-env-config (its environments and inference "
                        "engine, GPU) or --pg-replay-rollouts FILE|builtin.")
    if args.pg_replay_rollouts is not None and args.langrl_env_config:
        problems.append("--pg-replay-rollouts and --langrl-env-config both name the rollouts' source; give one "
                        "(replayed rollouts replace Megatron-LM's environments).")
    if args.pg_replay_rollouts not in (None, BUILTIN) and not os.path.isfile(args.pg_replay_rollouts):
        problems.append(f"--pg-replay-rollouts {args.pg_replay_rollouts}: no such file.")
    if args.pg_loss_source == "megatron":
        pg_given = sorted({a.split("=")[0] for a in argv if a.startswith("--pg-")} - {
            "--pg-loss-source", "--pg-replay-rollouts", "--pg-metrics-file"})
        if pg_given:
            problems.append(f"--pg-loss-source megatron runs Megatron-LM's own loss; {', '.join(pg_given)} "
                            "would be ignored: drop them (Megatron-LM's --grpo-* flags apply).")
    return problems


PACKING_FLAGS = ("--rl-sequence-packing-max-sequences-per-bin", "--rl-sequence-packing-algo")
"""Megatron-LM's packer's own settings: the planner packs by token capacity instead."""


def packing_problems(args, argv: list) -> list:
    """The packing flags of a ``--pg-loss-source pg`` run. ``--rl-use-sequence-packing`` asks for
    what the planner does by default (several sequences per THD microbatch), and is taken as that;
    Megatron-LM's own packer is not run (``args.rl_use_sequence_packing`` is cleared, in place):
    it sorts sequences by length across the whole collection, so groups land in arbitrary steps,
    and its learning rate advances by bins, not sequences (Megatron-LM #3078)."""
    problems = []
    if args.rl_use_sequence_packing:
        if not args.pg_sequence_packing:
            problems.append("--rl-use-sequence-packing and --no-pg-sequence-packing contradict each other; "
                            "give one of them")
        args.rl_use_sequence_packing = False
    for flag in PACKING_FLAGS:
        if _given(argv, flag):
            problems.append(f"{flag}: Megatron-LM's packer's setting; the RL entry packs whole sequences by "
                            "token capacity (--pg-max-tokens-per-microbatch, default --seq-length): drop it")
    cap = args.pg_max_tokens_per_microbatch
    if cap is not None:
        if not args.pg_sequence_packing:
            problems.append(f"--pg-max-tokens-per-microbatch {cap} with --no-pg-sequence-packing: one sequence "
                            "per microbatch has no capacity to set; drop one of them")
        elif cap < args.seq_length:
            problems.append(f"--pg-max-tokens-per-microbatch {cap} is below --seq-length {args.seq_length}: a "
                            "trajectory may be --seq-length tokens and a sequence is never split; give at "
                            f"least {args.seq_length}")
        elif args.pipeline_model_parallel_size > 1 and cap != args.seq_length:
            problems.append(f"--pg-max-tokens-per-microbatch {cap} with --pipeline-model-parallel-size "
                            f"{args.pipeline_model_parallel_size}: Megatron-LM's pipeline buffers have the "
                            f"shape --seq-length {args.seq_length}; drop the flag or raise --seq-length")
    return problems


def packing_capacity(args) -> Optional[int]:
    """Padded tokens per packed microbatch, or None for one sequence per microbatch."""
    if not args.pg_sequence_packing:
        return None
    return args.pg_max_tokens_per_microbatch or args.seq_length


def collection_shape(args) -> CollectionShape:
    return CollectionShape(prompts=args.grpo_prompts_per_step, group_size=args.grpo_group_size,
                           global_batch=args.global_batch_size, passes=args.grpo_iterations)


# ----------------------------------------------------------------------------- the actor


class RLActor(Actor):
    """The pretrain entry's actor (model provider with the THD hook, forward step, loss function,
    log line, metrics), fed by the collection planner instead of a rollout file."""

    datasets_provider = None  # Megatron-LM's RL loop builds no dataset (train_rl.py passes None)

    def __init__(self, args, *, cuda: bool, loss_cfg: PGLossConfig):
        super().__init__(args, {}, cuda=cuda, loss_cfg=loss_cfg, data=None)
        self.shape = collection_shape(args)
        self.planner = CollectionPlanner(loss_cfg, self.shape, cuda=cuda, items=self._items,
                                         capacity=packing_capacity(args), plan_ahead=args.pg_plan_ahead,
                                         packed_logprobs=args.pg_packed_logprobs)

    def microbatch_count(self) -> int:
        """The schedule's microbatch count for Megatron-LM's current iteration (its step's plan)."""
        from megatron.training import get_args

        return self.planner.microbatches_at(get_args().curr_iteration)

    def _items(self, plan, iteration: int, dp_rank: int):
        for mb in plan.for_rank(dp_rank):
            yield PlannedMicrobatch(mb, plan.totals, iteration)

    def step_ran(self, iteration: int) -> tuple:
        step = self.planner.step_at(iteration)
        return step.plan, {"collection": step.collection, "rollout_step": step.step, "grpo_pass": step.grpo_pass,
                           "microbatches": step.plan.stats["microbatches_per_rank"]}


class MegatronLossObserver:
    """``--pg-loss-source megatron``: rank 0 records Megatron-LM's reduced RL report per iteration."""

    KEYS = ("lm loss", "rl/kl_term", "rl/pi_over_pi_old", "rl/entropy_term")

    def __init__(self, metrics_path: Optional[str]):
        self.metrics_path = metrics_path

    def __call__(self, event) -> None:
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return
        record = {"iteration": event.iteration, "grad_norm": event.grad_norm, "learning_rate": event.learning_rate,
                  **{k: float(event.loss_dict[k]) for k in self.KEYS if k in event.loss_dict}}
        logger.info(f"iteration {event.iteration} | megatron lm loss {record.get('lm loss', math.nan):.6g} | "
                    f"grad_norm {event.grad_norm:.6g}")
        if self.metrics_path:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")


def megatron_forward_step(cuda: bool):
    """Megatron-LM's own ``train_rl.forward_step`` (its loss function and ``calculate_grpo_loss``),
    on CPU with ``Tensor.cuda()`` as the identity around it and around its loss function."""
    import train_rl  # the checkout's; importing it reconfigures the root logger (ours does not propagate)

    if cuda:
        return train_rl.forward_step
    from megatron_pg_agg.patches.cpu.cpu_torch import _TensorCudaIsIdentity, under_mode

    on_cpu = under_mode(_TensorCudaIsIdentity)

    def forward_step(data_iterator, model, loss_only: bool = False):
        output, loss_func = on_cpu(train_rl.forward_step)(data_iterator, model, loss_only)
        return output, on_cpu(loss_func)

    return forward_step


def megatron_collection(original):
    """Megatron-LM's own ``prepare_data_for_update``, with the tokenizer's missing bos read as None."""
    def prepare(**kwargs):
        return original(**{**kwargs, "tokenizer": TokenizerView(kwargs["tokenizer"])})

    return prepare


# ----------------------------------------------------------------------------- main


def _replay_source(args):
    if args.pg_replay_rollouts is None:
        return None
    shape = collection_shape(args)

    def collection_index() -> int:  # Megatron-LM collects at iterations 0, period, 2 * period, ...
        from megatron.training import get_args

        return get_args().curr_iteration // (shape.passes * shape.steps)

    if args.pg_replay_rollouts == BUILTIN:
        def make_groups(tokenizer):
            view = TokenizerView(tokenizer)
            return builtin_replay(num_groups=args.grpo_prompts_per_step, group_size=args.grpo_group_size,
                                  seq_length=args.seq_length, eod=view.eod, pad=view.pad,
                                  bos=None if args.rl_skip_bos_token else view.bos, seed=args.seed)

        return ReplaySource(make_groups=make_groups, collection_index=collection_index)
    groups = load_replay(args.pg_replay_rollouts, group_size=args.grpo_group_size,
                         vocab_size=args.vocab_size or 2**31, seq_length=args.seq_length)
    return ReplaySource(groups, collection_index=collection_index)


def run(argv: list) -> int:
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    root = find_checkout(argv)
    use_checkout(root)
    core = installed_megatron_core_version()
    if not in_range(core, megatron_rl.SUPPORTED):
        raise StartupError(f"megatron-core {core}: {megatron_rl.UNSUPPORTED_REASON}.")
    try:
        apply_megatron_patches(cpu_gloo=not cuda, megatron_lm_cpu=not cuda, megatron_lm_log=True,
                               megatron_rl=True, megatron_rl_cpu=not cuda, rope_thd=rope_thd.needed())
        release = check_checkout()
    except (UnsupportedMegatronLM, RuntimeError) as err:
        raise StartupError(str(err)) from err
    sys.argv = [sys.argv[0], *argv]
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=add_rl_actor_args, args_defaults=RL_ARGS_DEFAULTS)
    problems = []
    translations = []
    if args.pg_loss_source == "pg":
        translations, problems = translate_loss_flags(args, argv)
    problems += rl_startup_problems(args, argv, cuda=cuda, megatron_core=core)
    try:
        source = _replay_source(args) if not problems else None
    except ReplayError as err:
        problems.append(str(err))
    if problems:
        raise StartupError(problems)
    # Megatron's --bf16 and --use-distributed-optimizer on CPU: the optimizers' CUDA type strings
    apply_megatron_patches(cpu_gloo=False, optimizer_cpu=optimizer_cpu.needed(
        cuda=cuda, bf16=args.bf16, distributed_optimizer=args.use_distributed_optimizer))
    for line in translations:
        logger.info(f"loss flag: {line}")

    if args.pg_loss_source == "megatron":
        observer = MegatronLossObserver(args.pg_metrics_file)
        forward_step = megatron_forward_step(cuda)
        setup_logging(PG_PREFIX)
        from megatron.rl import rl_utils

        planner = megatron_collection(rl_utils.prepare_data_for_update.__wrapped__)
        actor = None
    else:
        loss_cfg = config_from_args(args)  # the translated flags, checked where the config is built
        actor = RLActor(args, cuda=cuda, loss_cfg=loss_cfg)
        observer, forward_step, planner = actor.on_training_log, actor.forward_step, actor.planner
    megatron_rl.set_rollout_source(source)
    megatron_rl.set_collection_planner(planner)
    megatron_rl.set_microbatch_count(actor and actor.microbatch_count)
    megatron_lm_log.add_observer(observer)
    try:
        _pretrain(release, args, actor or _MegatronLossActor(forward_step))
    finally:
        megatron_lm_log.remove_observer(observer)
        megatron_rl.set_rollout_source(None)
        megatron_rl.set_collection_planner(None)
        megatron_rl.set_microbatch_count(None)
        if actor is not None:
            actor.planner.close()
    return 0


class _MegatronLossActor:
    """The providers of a ``--pg-loss-source megatron`` run: Megatron-LM's own forward step."""

    datasets_provider = None

    def __init__(self, forward_step):
        self.forward_step = forward_step
        self.model_provider = Actor.model_provider.__get__(self)


def main(argv: Optional[list] = None) -> int:
    return run_entry(run, argv)
