"""One typed configuration of a ``launch/train_actor.py`` run, built once from its flags.

    cfg = RunConfig.from_args(build_parser().parse_args(argv))
    cfg.validate(world_size, backend="gloo", te=False)  # StartupError listing every problem

The flags (:func:`build_parser`, Megatron-style names) are parsed once into a tree of frozen
dataclasses: :class:`ModelConfig` (with :class:`MoEConfig`), :class:`ParallelConfig`, the loss
(:class:`~megatron_pg_agg.core.losses.PGLossConfig`, built by
:func:`~megatron_pg_agg.training.args.config_from_args`), :class:`DataConfig`, :class:`TrainingConfig`,
:class:`CheckpointConfig` and :class:`LoggingConfig`. Every combination that can be refused
before a process group or model exists is refused by :meth:`RunConfig.validate`, in one list.

The Megatron-LM entry (:mod:`megatron_pg_agg.training.megatron_lm`) builds its loss config with the same
``config_from_args`` and its data config with :meth:`DataConfig.from_megatron_lm_args`; the rest
of its configuration is Megatron-LM's own.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.output_folder import HF_KIND, output_folder_problem
from megatron_pg_agg.data.planner import PlanConfig
from megatron_pg_agg.data.reach import ReachTask
from megatron_pg_agg.megatron.layout import ParallelSizes
from megatron_pg_agg.patches import mtp_loss
from megatron_pg_agg.versions import in_range, installed_megatron_core_version, release_problem

from .args import add_pg_agg_args, add_plan_ahead_arg, config_from_args
from .model_source import ModelSourceError, open_model_source
from .resume import resume_problems

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "LoggingConfig",
    "MoEConfig",
    "ModelConfig",
    "OnlineConfig",
    "ParallelConfig",
    "RunConfig",
    "StartupError",
    "TrainingConfig",
    "build_parser",
    "parse_flags",
]

DEFAULT_NUM_MICROBATCHES = 2
"""Microbatches per DP rank when neither --num-microbatches nor --max-tokens-per-microbatch is given."""

DEFAULT_RUN_DIR = os.path.join("runs", "train_actor")
"""Where the metrics go without --metrics-file and --save."""


class StartupError(ValueError):
    """A run refused before its first step (exit status 2), by either entry. The message is
    ``refusing to start:`` and the problem (a string), or every problem listed (a list)."""

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        listed = "".join(f"\n- {p}" for p in self.problems)
        super().__init__("refusing to start:" + (f" {problems}" if isinstance(problems, str) else listed))


# ----------------------------------------------------------------------------- flags


DESCRIPTION = """\
Train a PPO/GRPO actor with megatron-core (torchrun entry point).

By default (no --rollouts) it runs online GRPO on the built-in verifiable task, "reach"
(docs/length-bias.md): a short supervised warm-up on the task's demonstrations, then every
iteration samples --prompts-per-step x --group-size responses from the live policy, scores them
with the task's verifier (reward 1 or 0), turns the rewards into group advantages and trains on
them (--updates-per-batch optimizer steps, the --pg-* loss). Each iteration prints the accuracy
and the mean response length beside the objective.

--rollouts FILE trains offline on rollouts you scored elsewhere: a JSON Lines file, one response
a line with its per-token advantages and old log-probs (docs/rollout-format.md). There is no
tokenizer: token ids are integers below --vocab-size. --rollouts synthetic replays a built-in
set of four fixed synthetic steps (what the tests use; nothing is learned from it)."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` with every flag's default: argparse's ``(default: X)``, ``off`` for a switch,
    nothing added where the help already names the default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: {'none' if action.default is None else '%(default)s'})"


SYNTHETIC = "synthetic"
"""``--rollouts synthetic``: the built-in synthetic replay (a file of that name: ``./synthetic``)."""

ONLINE_FLAGS = ("prompts_per_step", "group_size", "updates_per_batch", "warmup_steps", "warmup_lr",
                "advantage_std")
"""Destinations of the online run's own flags (refused with --rollouts, where they do nothing)."""


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``launch/train_actor.py`` (Megatron-style names, plus the ``--pg-*`` loss flags)."""
    parser = argparse.ArgumentParser(prog="train_actor", description=DESCRIPTION, formatter_class=_HelpFormatter)
    _add_data_args(parser)
    hf = parser.add_argument_group("Hugging Face models (Python 3.12, Megatron-Bridge; docs/hf-models.md)")
    hf.add_argument("--hf-model", default=None, metavar="PATH",
                    help="a local HF causal-LM folder (config.json + safetensors): the model's shape and weights "
                         "come from it; a model flag that disagrees with its config is refused (needs --rollouts)")
    hf.add_argument("--save-hf", default=None, metavar="DIR",
                    help="write the trained model as an HF folder (config, safetensors, the source's tokenizer "
                         "files) at the end, atomically; needs --hf-model. DIR must be new, empty or an earlier "
                         "--save-hf output (nothing else is ever replaced)")
    hf.add_argument("--save-hf-interval", type=int, default=None, metavar="N",
                    help="also write --save-hf every N iterations")
    model = parser.add_argument_group("model (Megatron-style)")
    model.add_argument("--num-layers", type=int, default=2, help="transformer layers")
    model.add_argument("--hidden-size", type=int, default=64, help="hidden size")
    model.add_argument("--ffn-hidden-size", type=int, default=None, help="MLP hidden size (default: 4 x hidden)")
    model.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    model.add_argument("--vocab-size", type=int, default=128,
                       help="vocabulary: must exceed every token id of the rollouts (online: the task's 100 ids)")
    model.add_argument("--max-position-embeddings", type=int, default=256, help="longest prompt + response")
    model.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="separate input embedding and output layer weights")
    par = parser.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP (offline only)")
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP (offline only)")
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                     help="the interleaved pipeline schedule (default: none)")
    par.add_argument("--context-parallel-size", type=int, default=1, help="CP (a GPU with TE; offline only)")
    par.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism under TP (a GPU with TE)")
    par.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                     help="process-group timeout: a dead or hung rank fails the job after this")
    par.add_argument("--batch-p2p-comm", action="store_true",
                     help="batched pipeline p2p (refused with the interleaved schedule on gloo)")
    par.add_argument("--no-calculate-per-token-loss", dest="calculate_per_token_loss", action="store_false",
                     help="(refused) Megatron's default mean-of-microbatch-means (default: per-token loss on)")
    _add_precision_and_ddp_args(parser)
    moe = parser.add_argument_group("mixture of experts (Megatron-style; every layer's MLP is a MoE layer)")
    moe.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: dense model)")
    moe.add_argument("--moe-router-topk", type=int, default=2, help="experts per token (>= 2)")
    moe.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="load-balancing (aux) loss coefficient")
    moe.add_argument("--moe-z-loss-coeff", type=float, default=None, help="router z-loss coefficient (default: none)")
    moe.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP")
    moe.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather",
                     help="megatron-core's token dispatcher")
    mtp = parser.add_argument_group("multi-token prediction (Megatron-style; docs/mtp.md)")
    mtp.add_argument("--mtp-num-layers", type=int, default=None,
                     help="MTP depths on the last pipeline stage (default: none)")
    mtp.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                     help="f: the MTP loss is f x the mean over depths of each depth's token mean")
    batching = parser.add_argument_group("batching").add_mutually_exclusive_group()
    batching.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                          help="capacity of a microbatch in padded tokens (default: none; the count instead)")
    batching.add_argument("--num-microbatches", type=int, default=None,
                          help=f"microbatches per DP rank (default: {DEFAULT_NUM_MICROBATCHES} without a token cap)")
    _add_training_args(parser)
    add_pg_agg_args(parser)
    return parser


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    """Where the data comes from: ``--rollouts``, and the online run's flags (without it)."""
    data = parser.add_argument_group("data: online GRPO on the reach task (default), or --rollouts")
    data.add_argument("--rollouts", default=None, metavar="FILE|synthetic",
                      help="train offline: a JSON Lines file of scored rollouts (per-token advantages and old "
                           "log-probs, token ids below --vocab-size; docs/rollout-format.md), or 'synthetic' for "
                           "the built-in replay of four fixed steps (default: none, online GRPO on the reach task)")
    data.add_argument("--prompts-per-step", type=int, default=64,
                      help="online: prompts (groups) sampled per iteration, split evenly over the DP ranks")
    data.add_argument("--group-size", type=int, default=8, help="online: responses sampled per prompt")
    data.add_argument("--updates-per-batch", type=int, default=4,
                      help="online: optimizer steps (PPO epochs) on each sampled batch, each over the whole batch")
    data.add_argument("--warmup-steps", type=int, default=60,
                      help="online: supervised warm-up steps on the task's demonstrations before RL (0: none)")
    data.add_argument("--warmup-lr", type=float, default=3e-3, help="online: Adam learning rate of the warm-up")
    data.add_argument("--advantage-std", action=argparse.BooleanOptionalAction, default=True,
                      help="online: divide group advantages by the group's reward std (GRPO); "
                           "--no-advantage-std: r - mean (Dr. GRPO)")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    train = parser.add_argument_group("training")
    train.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (online: of the RL phase)")
    train.add_argument("--weight-decay", type=float, default=0.0, help="Adam weight decay")
    train.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip")
    train.add_argument("--train-iters", type=int, default=20,
                       help="iterations (offline: optimizer steps; online: sampled batches)")
    train.add_argument("--seed", type=int, default=1234,
                       help="seed of the weights, the online prompts, samples and warm-up, the synthetic set")
    train.add_argument("--save", default=None, help="checkpoint directory (default: none)")
    train.add_argument("--save-interval", type=int, default=None,
                       help="iterations between checkpoints (default: the final one only)")
    train.add_argument("--load", default=None, help="resume from this checkpoint directory (default: none; "
                                                    "docs/trainer.md, Resume: what may change)")
    train.add_argument("--override-opt_param-scheduler", action="store_true",
                       help="with --load: train with --lr/--weight-decay/--clip-grad where they differ from the "
                            "checkpoint's (Megatron-LM's flag; without it or the next one a difference is refused)")
    train.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                       help="with --load: keep the checkpoint's --lr/--weight-decay/--clip-grad (Megatron-LM's flag)")
    train.add_argument("--metrics-file", default=None,
                       help="per-iteration metrics JSONL (default: <save>/metrics.jsonl, else "
                            "runs/train_actor/metrics.jsonl)")
    train.add_argument("--tensorboard-dir", default=None, help="TensorBoard logs, if tensorboard is installed")
    train.add_argument("--verbose", action="store_true",
                       help="show every start-up line of megatron-core, Megatron-Bridge and transformers (the known "
                            "noise is silenced by default; also MEGATRON_PG_AGG_VERBOSE=1)")
    train.add_argument("--log-interval", type=int, default=1, help="iterations between logged records")
    add_plan_ahead_arg(train)


def _add_precision_and_ddp_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags of the configuration large models train with (the same names and
    meanings; docs/trainer.md, "Precision and data-parallel communication")."""
    group = parser.add_argument_group(
        "precision and data-parallel communication (Megatron-LM's flags; docs/trainer.md)")
    group.add_argument("--bf16", action="store_true",
                       help="bf16 parameters and compute; gradients accumulate into fp32 main gradients and "
                            "Adam steps fp32 main parameters (megatron-core's mixed-precision optimizer), as "
                            "Megatron-LM's --bf16. Default: fp32 throughout")
    group.add_argument("--fp16", action="store_true",
                       help="(refused) fp16 needs a dynamic loss scale that skips overflowing steps; use --bf16")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="shard the fp32 main parameters and Adam's moments over the data-parallel ranks "
                            "(ZeRO-1): gradients are reduce-scattered, each rank steps its shard, and the "
                            "updated parameters are all-gathered. Default: every rank holds the whole optimizer")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="reduce gradient buckets while the backward pass still runs (after the last "
                            "microbatch's gradients of a bucket are ready). Default: one reduction after backward")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="all-gather the updated parameters during the next forward pass, bucket by bucket "
                            "(needs --use-distributed-optimizer and --overlap-grad-reduce). Default: gathered "
                            "right after the optimizer step")
    group.add_argument("--ddp-bucket-size", type=int, default=None, metavar="N",
                       help="parameters per gradient bucket with --overlap-grad-reduce (default megatron-core's: "
                            "max(40M, 1M x DP))")


_UNSET = object()


def parse_flags(argv=None) -> argparse.Namespace:
    """:func:`build_parser`'s namespace of ``argv``, with ``explicit``: the set of destinations the
    command line gave (a flag left at its default is not in it). ``--hf-model`` refuses only the
    model flags that were given and disagree with the HF config."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    # argparse fills a default only where the namespace lacks the attribute: pre-filled sentinels
    # stay exactly where no flag was given (parsed without the loss flags' validation, which the
    # sentinels would fail; the real parse above validated them)
    probe = argparse.Namespace(**{a.dest: _UNSET for a in parser._actions if a.dest != "help"})
    getattr(parser.parse_known_args, "__wrapped__", parser.parse_known_args)(argv, probe)
    namespace.explicit = frozenset(k for k, v in vars(probe).items() if v is not _UNSET)
    return namespace


HF_SHAPE_FLAGS = (
    # (destination, flag, HFShape field, how the flag's value reads as the field's)
    ("num_layers", "--num-layers", "num_layers", None),
    ("hidden_size", "--hidden-size", "hidden_size", None),
    ("ffn_hidden_size", "--ffn-hidden-size", "ffn_hidden_size", None),
    ("num_attention_heads", "--num-attention-heads", "num_attention_heads", None),
    ("vocab_size", "--vocab-size", "vocab_size", None),
    ("max_position_embeddings", "--max-position-embeddings", "max_position_embeddings", None),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights", "tie_embeddings",
     lambda untie: not untie),
    ("num_experts", "--num-experts", "num_experts", None),
    ("moe_router_topk", "--moe-router-topk", "router_topk", None),
)
"""The model flags whose values an HF config fixes (tying is the flag's negation)."""


def _hf_model_config(ns: argparse.Namespace) -> "ModelConfig":
    """The model of ``--hf-model``: its shape from the HF config (through Megatron-Bridge's
    provider); a shape flag given on the command line that disagrees is refused, naming both."""
    # the "hf" source (integrations.bridge.hf_model, through its entry point) checks the folder, then the
    # install, then opens it through Megatron-Bridge (an optional extra)
    try:
        shape = open_model_source("hf", ns.hf_model).shape
    except ModelSourceError as err:
        raise StartupError(str(err)) from err
    explicit = getattr(ns, "explicit", frozenset())
    conflicts = []
    for dest, flag, field, as_field in HF_SHAPE_FLAGS:
        given, wanted = getattr(ns, dest), getattr(shape, field)
        if dest not in explicit or (as_field(given) if as_field else given) == wanted:
            continue
        if field == "tie_embeddings":  # a switch: no value to show, the config's tying instead
            conflicts.append(f"{flag} disagrees with --hf-model {ns.hf_model}, whose config has "
                             f"tie_word_embeddings={str(wanted).lower()}")
        else:
            conflicts.append(f"{flag} {given} disagrees with --hf-model {ns.hf_model}, whose config gives "
                             f"{field} = {wanted}")
    if conflicts:
        raise StartupError(conflicts)
    return ModelConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, vocab_size=shape.vocab_size,
        max_position_embeddings=shape.max_position_embeddings,
        untie_embeddings_and_output_weights=not shape.tie_embeddings, bf16=ns.bf16, fp16=ns.fp16,
        moe=MoEConfig(num_experts=shape.num_experts, router_topk=shape.router_topk or ns.moe_router_topk,
                      aux_loss_coeff=ns.moe_aux_loss_coeff, z_loss_coeff=ns.moe_z_loss_coeff,
                      token_dispatcher_type=ns.moe_token_dispatcher_type),
        mtp_num_layers=ns.mtp_num_layers, mtp_loss_scaling_factor=ns.mtp_loss_scaling_factor,
        hf_model=ns.hf_model, num_query_groups=shape.num_query_groups,
    )


# ----------------------------------------------------------------------------- the tree


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: every layer's MLP is a megatron-core MoE layer (``num_experts`` set)."""

    num_experts: Optional[int] = None
    """Experts per MoE layer (``--num-experts``); None: a dense model."""
    router_topk: int = 2
    """Experts per token (``--moe-router-topk``, >= 2)."""
    aux_loss_coeff: float = 0.0
    """Load-balancing (aux) loss coefficient (``--moe-aux-loss-coeff``)."""
    z_loss_coeff: Optional[float] = None
    """Router z-loss coefficient (``--moe-z-loss-coeff``); None: no z-loss."""
    token_dispatcher_type: str = "allgather"
    """megatron-core's token dispatcher (``--moe-token-dispatcher-type``): allgather or alltoall."""

    @property
    def enabled(self) -> bool:
        """A MoE model (``--num-experts`` given)."""
        return self.num_experts is not None


@dataclass(frozen=True)
class ModelConfig:
    """The GPT model (Megatron-style sizes)."""

    num_layers: int = 2
    """Transformer layers (``--num-layers``), over every pipeline stage."""
    hidden_size: int = 64
    """Hidden size (``--hidden-size``)."""
    ffn_hidden_size: int = 256
    """MLP hidden size (``--ffn-hidden-size``; the flag's default is 4 x hidden_size)."""
    num_attention_heads: int = 4
    """Attention heads (``--num-attention-heads``)."""
    vocab_size: int = 128
    """Vocabulary size (``--vocab-size``); must cover every token id of the rollouts."""
    max_position_embeddings: int = 256
    """Longest sequence the position embeddings cover (``--max-position-embeddings``)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer weights (``--untie-embeddings-and-output-weights``)."""
    bf16: bool = False
    """bf16 parameters and compute, fp32 main gradients and optimizer (``--bf16``; on CPU through the
    ``optimizer_cpu`` stand-in)."""
    fp16: bool = False
    """``--fp16``: refused (:meth:`RunConfig.startup_problems` says why)."""
    moe: MoEConfig = MoEConfig()
    """Mixture-of-experts settings (dense when ``moe.num_experts`` is None)."""
    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depths K (``--mtp-num-layers``), on the last pipeline stage; None:
    no MTP. Its loss is a token mean over the step's valid response tokens in every mode
    (docs/mtp.md)."""
    mtp_loss_scaling_factor: float = 0.1
    """f (``--mtp-loss-scaling-factor``): the MTP loss added to the objective's gradient is f x the
    mean over depths of each depth's token-mean cross-entropy (Megatron's default 0.1)."""
    hf_model: Optional[str] = None
    """A local HF causal-LM folder (``--hf-model``): the shape above is its config's, and the
    weights are loaded from it through Megatron-Bridge; None: a GPT built from the flags."""
    num_query_groups: Optional[int] = None
    """Key/value heads (grouped-query attention, HF models); None: as many as attention heads."""


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout and process-group settings (DP is what the world size leaves)."""

    tp: int = 1
    """Tensor-parallel size (``--tensor-model-parallel-size``)."""
    pp: int = 1
    """Pipeline-parallel size (``--pipeline-model-parallel-size``)."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per virtual pipeline stage (``--num-layers-per-virtual-pipeline-stage``): the
    interleaved schedule; None: no interleaving."""
    cp: int = 1
    """Context-parallel size (``--context-parallel-size``)."""
    ep: int = 1
    """Expert-parallel size (``--expert-model-parallel-size``; MoE only)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism under TP (``--sequence-parallel``)."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of every process group (``--distributed-timeout-minutes``): a dead or hung rank
    fails the job after this."""
    batch_p2p_comm: bool = False
    """Batched pipeline p2p (``--batch-p2p-comm``; refused with the interleaved schedule on gloo)."""
    calculate_per_token_loss: bool = True
    """megatron-core's per-token loss contract (``--no-calculate-per-token-loss`` turns it off,
    which is refused: it averages microbatch means instead of the chosen objective)."""
    use_distributed_optimizer: bool = False
    """megatron-core's distributed optimizer (``--use-distributed-optimizer``): main parameters and
    Adam's moments sharded over DP, gradients reduce-scattered, parameters all-gathered."""
    overlap_grad_reduce: bool = False
    """Gradient buckets reduced during the backward pass (``--overlap-grad-reduce``)."""
    overlap_param_gather: bool = False
    """Updated parameters all-gathered during the next forward pass (``--overlap-param-gather``; needs
    the two above). Weights read between steps are gathered first (the trainer's checkpoints,
    checksum and HF folders)."""
    ddp_bucket_size: Optional[int] = None
    """Parameters per gradient bucket (``--ddp-bucket-size``, with ``overlap_grad_reduce``); None:
    megatron-core's default."""

    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: the ranks of one data-parallel replica."""
        return self.tp * self.pp * self.cp

    def dp_size(self, world_size: int) -> int:
        """Data-parallel size (without CP) for ``world_size`` ranks."""
        return world_size // self.model_parallel_size


@dataclass(frozen=True)
class DataConfig:
    """Where the rollouts come from and how a step is cut into microbatches."""

    rollouts: Optional[str] = None
    """Rollout JSON Lines file (``--rollouts FILE``; Megatron-LM: ``--pg-rollouts``); None: the
    built-in synthetic set (``--rollouts synthetic``), or, in a trainer run with
    :attr:`RunConfig.online` set, no file (the rollouts are sampled)."""
    max_tokens_per_microbatch: Optional[int] = None
    """Capacity of one microbatch in padded tokens (``--max-tokens-per-microbatch``; Megatron-LM:
    ``--seq-length``); None: no cap, the count is ``num_microbatches``."""
    num_microbatches: Optional[int] = None
    """Microbatches per DP rank (``--num-microbatches``, default 2 without a token cap); None: derived
    from ``max_tokens_per_microbatch`` (Megatron-LM: its own microbatch calculator)."""
    plan_ahead: bool = True
    """Plan step ``k + 1`` on a background host thread while step ``k`` runs (``--pg-plan-ahead``,
    the default; ``--no-pg-plan-ahead``: each step planned when it starts). The plans are identical
    either way (:mod:`megatron_pg_agg.data.plan_ahead`). Off in the online run, whatever the flag:
    step ``k + 1``'s rollouts are sampled from the weights step ``k`` leaves."""

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> "DataConfig":
        """From ``launch/train_actor.py``'s flags."""
        capped = namespace.max_tokens_per_microbatch is not None
        online = namespace.rollouts is None
        return cls(
            rollouts=None if namespace.rollouts in (None, SYNTHETIC) else namespace.rollouts,
            max_tokens_per_microbatch=namespace.max_tokens_per_microbatch,
            num_microbatches=None if capped else (namespace.num_microbatches or DEFAULT_NUM_MICROBATCHES),
            # online, a step's rollouts exist only once the previous step has trained
            plan_ahead=namespace.pg_plan_ahead and not online,
        )

    @classmethod
    def from_megatron_lm_args(cls, namespace: argparse.Namespace) -> "DataConfig":
        """From Megatron-LM's parsed flags (with ``megatron_lm.add_actor_args``): ``--pg-rollouts``,
        and ``--seq-length`` as the capacity of a microbatch. The count is Megatron-LM's microbatch
        calculator's, known once it is set up (``plan_config(num_microbatches=...)``).
        ``--pg-plan-ahead`` where the entry has it (on by default)."""
        return cls(rollouts=namespace.pg_rollouts, max_tokens_per_microbatch=namespace.seq_length,
                   plan_ahead=getattr(namespace, "pg_plan_ahead", True))

    def plan_config(self, *, dp_size: int, tp_size: int, sequence_parallel: bool, cp_size: int,
                    num_microbatches: Optional[int] = None, microbatch_tokens: Optional[int] = None,
                    uniform_microbatch_tokens: bool = False, vocab_size: Optional[int] = None) -> PlanConfig:
        """How the planner cuts a step of these rollouts on a parallel layout: the one place both
        entries build their :class:`~megatron_pg_agg.data.planner.PlanConfig`. ``num_microbatches``
        overrides this config's count (Megatron-LM's calculator); ``microbatch_tokens`` pads every
        microbatch to that length (Megatron-LM's fixed pipeline buffers); ``vocab_size`` has each
        plan check the token ids (the Megatron-LM entry, whose padded vocabulary is known only
        then, and which plans each rollout step once; the trainer checks them at start-up)."""
        return PlanConfig(
            dp_size=dp_size, tp_size=tp_size, sequence_parallel=sequence_parallel, cp_size=cp_size,
            num_microbatches=self.num_microbatches if num_microbatches is None else num_microbatches,
            max_tokens_per_microbatch=self.max_tokens_per_microbatch, microbatch_tokens=microbatch_tokens,
            uniform_microbatch_tokens=uniform_microbatch_tokens, vocab_size=vocab_size)


@dataclass(frozen=True)
class OnlineConfig:
    """The online run (``launch/train_actor.py`` without ``--rollouts``): GRPO on the built-in reach
    task (:mod:`megatron_pg_agg.online`), each iteration's rollouts sampled from the live policy,
    scored by the task's verifier, with group advantages; the loss is the run's ``--pg-*`` loss.
    The one type of the online settings: :class:`megatron_pg_agg.online.grpo.OnlineRun` and the
    length-bias comparison (``launch/grpo_reach.py``) read them from here. Its checks are start-up
    refusals (:meth:`RunConfig.online_problems`)."""

    prompts_per_step: int = 64
    """Prompts (groups) sampled per iteration (``--prompts-per-step``), split evenly over DP."""
    group_size: int = 8
    """Responses sampled per prompt (``--group-size``, >= 2: the advantages are group-relative)."""
    updates_per_batch: int = 4
    """Optimizer steps on each sampled batch (``--updates-per-batch``), each over the whole batch:
    the first is on-policy (PPO ratio 1), the later ones are clipped against the behaviour log-probs."""
    warmup_steps: int = 60
    """Supervised steps on the task's demonstrations before RL (``--warmup-steps``; 0: none).
    Skipped when ``--load`` resumes a run."""
    warmup_lr: float = 3e-3
    """Adam learning rate of the warm-up (``--warmup-lr``); the RL phase uses ``--lr``."""
    warmup_batch: int = 256
    """Demonstrations per warm-up step (no flag)."""
    advantage_std: bool = True
    """Group advantages divided by the group's reward std, GRPO's (``--advantage-std``);
    False: ``r - mean``, Dr. GRPO's (``--no-advantage-std``)."""

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> Optional["OnlineConfig"]:
        """The online settings of ``launch/train_actor.py``'s flags; None with ``--rollouts`` (offline),
        where an online flag given on the command line is refused (it would do nothing)."""
        if namespace.rollouts is None:
            return cls(**{name: getattr(namespace, name) for name in ONLINE_FLAGS})
        given = sorted(f"--{name.replace('_', '-')}" for name in ONLINE_FLAGS
                       if name in getattr(namespace, "explicit", ()))
        if given:
            raise StartupError(f"{', '.join(given)} only act(s) on the online run, without --rollouts: drop "
                               f"them, or drop --rollouts {namespace.rollouts}")
        return None


@dataclass(frozen=True)
class TrainingConfig:
    """The optimizer and the loop."""

    lr: float = 1e-3
    """Adam learning rate (``--lr``; constant)."""
    weight_decay: float = 0.0
    """Adam weight decay (``--weight-decay``)."""
    clip_grad: float = 1.0
    """Gradient-norm clip (``--clip-grad``)."""
    train_iters: int = 20
    """Iterations (optimizer steps) to reach (``--train-iters``); a resumed run continues to it."""
    seed: int = 1234
    """Seed of the weights, megatron's RNG tracker and the built-in synthetic rollouts (``--seed``)."""
    skip_nonfinite_steps: bool = False
    """Skip (and count) a step whose loss or gradient is not finite instead of stopping with
    status 3 (``--pg-skip-nonfinite-steps``)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints: per-rank files under ``iter_XXXXXXX/`` and a ``latest`` marker."""

    save: Optional[str] = None
    """Checkpoint directory (``--save``); None: no checkpoint."""
    save_interval: Optional[int] = None
    """Iterations between checkpoints (``--save-interval``); None: only the final one."""
    load: Optional[str] = None
    """Resume from this checkpoint directory (``--load``); None: start from the initial weights.
    What may change between the runs: :mod:`megatron_pg_agg.training.resume`."""
    override_opt_param_scheduler: bool = False
    """``--override-opt_param-scheduler``: a resume trains with the flags' optimizer settings where
    they differ from the checkpoint's (Megatron-LM's rule)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """``--use-checkpoint-opt_param-scheduler``: a resume keeps the checkpoint's optimizer settings."""
    save_hf: Optional[str] = None
    """HF folder written at the end of the run (``--save-hf``; an ``--hf-model`` run), atomically."""
    save_hf_interval: Optional[int] = None
    """Iterations between HF folders (``--save-hf-interval``); None: only the final one."""

    def interval_save_hf_due(self, iteration: int) -> bool:
        """Whether the HF folder is written after ``iteration`` (the final one is skipped when this
        already wrote it)."""
        return _interval_due(self.save_hf, self.save_hf_interval, iteration)

    def interval_save_due(self, iteration: int) -> bool:
        """Whether an interval checkpoint is written after ``iteration`` (the final checkpoint is
        skipped when this already wrote one)."""
        return _interval_due(self.save, self.save_interval, iteration)


def _interval_due(directory: Optional[str], interval: Optional[int], iteration: int) -> bool:
    return bool(directory and interval and iteration % interval == 0)


@dataclass(frozen=True)
class LoggingConfig:
    """Rank 0's per-step record."""

    metrics_file: str = os.path.join(DEFAULT_RUN_DIR, "metrics.jsonl")
    """Per-step metrics JSONL (``--metrics-file``; default ``<save>/metrics.jsonl``, else
    ``runs/train_actor/metrics.jsonl``)."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard log directory (``--tensorboard-dir``), used if tensorboard is installed."""
    log_interval: int = 1
    """Iterations between logged records (``--log-interval``); the last one is always logged."""


@dataclass(frozen=True)
class RunConfig:
    """Everything a ``launch/train_actor.py`` run is configured with, built once by
    :meth:`from_args` and checked by :meth:`validate`."""

    model: ModelConfig = ModelConfig()
    """The GPT model."""
    parallel: ParallelConfig = ParallelConfig()
    """The parallel layout and process-group settings."""
    loss: PGLossConfig = PGLossConfig()
    """What the actor optimises (the ``--pg-*`` flags)."""
    data: DataConfig = DataConfig()
    """Rollouts and microbatching."""
    training: TrainingConfig = TrainingConfig()
    """Optimizer and loop."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Saving and resuming."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics output."""
    online: Optional[OnlineConfig] = None
    """The online run's settings (``launch/train_actor.py`` without ``--rollouts``); None: offline,
    on ``data.rollouts`` (a file, or the synthetic set)."""

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> "RunConfig":
        """The typed config of parsed :func:`build_parser` flags. A bad loss combination (which the
        parser itself already refuses) raises :class:`StartupError`; everything else is checked by
        :meth:`validate`."""
        ns = namespace
        try:
            loss = config_from_args(ns)
        except ValueError as err:
            raise StartupError([str(err)]) from err
        model = _hf_model_config(ns) if ns.hf_model else None
        return cls(
            model=model or ModelConfig(
                num_layers=ns.num_layers, hidden_size=ns.hidden_size,
                ffn_hidden_size=ns.ffn_hidden_size or 4 * ns.hidden_size,
                num_attention_heads=ns.num_attention_heads, vocab_size=ns.vocab_size,
                max_position_embeddings=ns.max_position_embeddings,
                untie_embeddings_and_output_weights=ns.untie_embeddings_and_output_weights, bf16=ns.bf16, fp16=ns.fp16,
                moe=MoEConfig(num_experts=ns.num_experts, router_topk=ns.moe_router_topk,
                              aux_loss_coeff=ns.moe_aux_loss_coeff, z_loss_coeff=ns.moe_z_loss_coeff,
                              token_dispatcher_type=ns.moe_token_dispatcher_type),
                mtp_num_layers=ns.mtp_num_layers, mtp_loss_scaling_factor=ns.mtp_loss_scaling_factor,
            ),
            parallel=ParallelConfig(
                tp=ns.tensor_model_parallel_size, pp=ns.pipeline_model_parallel_size,
                num_layers_per_virtual_pipeline_stage=ns.num_layers_per_virtual_pipeline_stage,
                cp=ns.context_parallel_size, ep=ns.expert_model_parallel_size,
                sequence_parallel=ns.sequence_parallel, distributed_timeout_minutes=ns.distributed_timeout_minutes,
                batch_p2p_comm=ns.batch_p2p_comm, calculate_per_token_loss=ns.calculate_per_token_loss,
                use_distributed_optimizer=ns.use_distributed_optimizer, overlap_grad_reduce=ns.overlap_grad_reduce,
                overlap_param_gather=ns.overlap_param_gather, ddp_bucket_size=ns.ddp_bucket_size,
            ),
            loss=loss,
            data=DataConfig.from_args(ns),
            training=TrainingConfig(lr=ns.lr, weight_decay=ns.weight_decay, clip_grad=ns.clip_grad,
                                    train_iters=ns.train_iters, seed=ns.seed,
                                    skip_nonfinite_steps=ns.pg_skip_nonfinite_steps),
            checkpoint=CheckpointConfig(save=ns.save, save_interval=ns.save_interval, load=ns.load,
                                        save_hf=ns.save_hf, save_hf_interval=ns.save_hf_interval,
                                        override_opt_param_scheduler=ns.override_opt_param_scheduler,
                                        use_checkpoint_opt_param_scheduler=ns.use_checkpoint_opt_param_scheduler),
            logging=LoggingConfig(
                metrics_file=ns.metrics_file or os.path.join(ns.save or DEFAULT_RUN_DIR, "metrics.jsonl"),
                tensorboard_dir=ns.tensorboard_dir, log_interval=ns.log_interval,
            ),
            online=OnlineConfig.from_args(ns),
        )

    @property
    def virtual_pipeline_size(self) -> Optional[int]:
        """Virtual pipeline stages per rank (interleaved schedule); None without interleaving
        (no ``--num-layers-per-virtual-pipeline-stage``, or one virtual stage per rank)."""
        per_virtual = self.parallel.num_layers_per_virtual_pipeline_stage
        if per_virtual is None:
            return None
        vpp = self.model.num_layers // self.parallel.pp // per_virtual
        return vpp if vpp > 1 else None

    @property
    def layout(self) -> ParallelSizes:
        """The parallel layout (DP: what the world size leaves)."""
        par = self.parallel
        return ParallelSizes(tp=par.tp, pp=par.pp, vpp=self.virtual_pipeline_size, cp=par.cp)

    @property
    def uniform_microbatch_tokens(self) -> bool:
        """Whether every microbatch of a step is padded to one token count: the interleaved
        schedule needs it, and so does the allgather MoE dispatcher with PP or EP (it refuses
        ``variable_seq_lengths``, and on gloo its EP all-gather needs one count on every rank)."""
        allgather = self.model.moe.enabled and self.model.moe.token_dispatcher_type == "allgather"
        return self.virtual_pipeline_size is not None or (allgather and (self.parallel.pp > 1 or self.parallel.ep > 1))

    def plan_config(self, world_size: int) -> PlanConfig:
        """The planner's config of this run on ``world_size`` ranks (the same on every rank)."""
        par = self.parallel
        return self.data.plan_config(dp_size=par.dp_size(world_size), tp_size=par.tp,
                                     sequence_parallel=par.sequence_parallel, cp_size=par.cp,
                                     uniform_microbatch_tokens=self.uniform_microbatch_tokens)

    def validate(self, world_size: int, *, backend: str, te: bool) -> None:
        """Refuse every invalid combination before any process group or model is built: one
        :class:`StartupError` listing every problem (:meth:`startup_problems`)."""
        problems = self.startup_problems(world_size, backend=backend, te=te)
        if problems:
            raise StartupError(problems)

    def startup_problems(self, world_size: int, *, backend: str, te: bool) -> list:
        """Every reason to refuse the run on ``world_size`` ranks of ``backend`` (``te``: Transformer
        Engine usable); empty when it may start. Reads the file system for ``--load``/``--rollouts``."""
        model, par = self.model, self.parallel
        problems = []
        release = release_problem(installed_megatron_core_version())
        if release is not None:
            problems.append(release)
        tp, pp, cp = par.tp, par.pp, par.cp
        for name, size in (("tensor", tp), ("pipeline", pp), ("context", cp)):
            if size < 1:
                problems.append(f"--{name}-model-parallel-size must be >= 1" if name != "context"
                                else "--context-parallel-size must be >= 1")
        if tp >= 1 and pp >= 1 and cp >= 1 and world_size % par.model_parallel_size:
            problems.append(f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} "
                            f"= {par.model_parallel_size}")
        if pp >= 1 and model.num_layers % pp:
            problems.append(f"--num-layers {model.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
        per_virtual = par.num_layers_per_virtual_pipeline_stage
        if per_virtual is not None:
            per_stage = model.num_layers // max(pp, 1)
            if pp < 2:
                problems.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
            elif per_stage % per_virtual:
                problems.append(f"{per_stage} layers per pipeline stage are not divisible by "
                                f"--num-layers-per-virtual-pipeline-stage {per_virtual}")
            elif backend == "gloo" and par.batch_p2p_comm:
                problems.append("the interleaved pipeline with --batch-p2p-comm on gloo matches p2p messages out "
                                "of order (wrong gradients): drop --batch-p2p-comm")
        if not par.calculate_per_token_loss:
            problems.append("calculate_per_token_loss off gives a mean of microbatch means, not the chosen objective")
        # (a size < 1 is refused above; the divisibility checks need it >= 1)
        if model.hf_model:
            problems.extend(self._hf_problems())
        elif tp >= 1 and (model.hidden_size % model.num_attention_heads or model.num_attention_heads % tp):
            problems.append(f"--num-attention-heads {model.num_attention_heads} must divide --hidden-size "
                            f"{model.hidden_size} and be divisible by TP={tp}")
        if tp >= 1 and model.vocab_size % tp and not model.hf_model:
            problems.append(f"--vocab-size {model.vocab_size} must be divisible by TP={tp}")
        if not te and par.sequence_parallel and tp > 1:
            problems.append("--sequence-parallel needs Transformer Engine's layer norm (the local spec's torch "
                            "LayerNorm does not support it); run on a GPU with TE or drop the flag")
        if not te and cp > 1:
            problems.append("--context-parallel-size > 1 needs Transformer Engine's THD attention (GPU); on CPU "
                            "the CP loss side is covered by the parity suite")
        problems.extend(self._precision_and_ddp_problems())
        problems.extend(self._moe_problems(world_size, te=te))
        problems.extend(self._mtp_problems())
        ckpt = self.checkpoint
        if ckpt.save_interval is not None and (ckpt.save_interval < 1 or not ckpt.save):
            problems.append("--save-interval needs --save and a value >= 1")
        if ckpt.save_hf and not model.hf_model:
            problems.append("--save-hf needs --hf-model (the HF config and names come from it)")
        if ckpt.save_hf_interval is not None and (ckpt.save_hf_interval < 1 or not ckpt.save_hf):
            problems.append("--save-hf-interval needs --save-hf and a value >= 1")
        if ckpt.save_hf:
            # before any training: a user's file at DIR, or an input under it, is never replaced
            problems.extend(output_folder_problem(
                ckpt.save_hf, "--save-hf", kind=HF_KIND,
                others={"--hf-model": model.hf_model, "--load": ckpt.load, "--save": ckpt.save,
                        "--rollouts": self.data.rollouts, "--metrics-file": self.logging.metrics_file,
                        "--tensorboard-dir": self.logging.tensorboard_dir}))
        if self.training.train_iters < 1:
            problems.append("--train-iters must be >= 1")
        if ckpt.load and not os.path.isdir(ckpt.load):
            problems.append(f"--load {ckpt.load}: no such directory")
        problems.extend(resume_problems(self, world_size))
        if self.data.rollouts and not os.path.isfile(self.data.rollouts):
            problems.append(f"--rollouts {self.data.rollouts}: no such file")
        problems.extend(self.online_problems(world_size))
        return problems

    def online_problems(self, world_size: int) -> list:
        """What the online run (no ``--rollouts``) cannot do, each naming the offline way: the
        sampler runs the model's whole forward on every rank, a different number of times on each
        (so no collective may run inside a forward), and the task brings its own tokens and no
        reference or rollout-engine log-probs. Empty offline."""
        online = self.online
        if online is None:
            return []
        model, par, loss, task = self.model, self.parallel, self.loss, ReachTask()
        cannot = [f"{flag}={size}: the online sampler needs 1 (it runs the model's whole forward on every rank)"
                  for flag, size in (("--tensor-model-parallel-size", par.tp),
                                     ("--pipeline-model-parallel-size", par.pp),
                                     ("--context-parallel-size", par.cp)) if size != 1]
        reasons = (
            (model.hf_model, "--hf-model: the reach task has its own token ids; online trains the built-in GPT"),
            (model.moe.enabled and par.ep > 1, f"--expert-model-parallel-size {par.ep}: the expert dispatch is a "
                                               "collective inside every forward, and each rank's sampler runs its "
                                               "own number of forwards"),
            (model.mtp_num_layers is not None, "--mtp-num-layers: the warm-up's forward-only log-prob passes do not "
                                               "set the MTP loss's per-step factor"),
            (loss.needs_reference, "--pg-kl-coef > 0: the online rollouts have no reference log-probs"),
            (loss.rollout_correction, "--pg-rollout-correction: the online rollouts have no rollout_logprobs (their "
                                      "old log-probs are the sampler's own)"),
            (model.vocab_size < task.vocab_size, f"--vocab-size {model.vocab_size}: the reach task's token ids need "
                                                 f"at least {task.vocab_size}"),
            (model.max_position_embeddings < task.prompt_tokens + task.max_response_tokens,
             f"--max-position-embeddings {model.max_position_embeddings}: the reach task's sequences need "
             f"{task.prompt_tokens + task.max_response_tokens}"),
        )
        cannot += [reason for on, reason in reasons if on]
        offline = "; to train with it, pass scored rollouts: --rollouts FILE (or --rollouts synthetic)"
        problems = [reason + offline for reason in cannot]
        dp = par.dp_size(world_size) if par.model_parallel_size >= 1 else 1
        if online.group_size < 2 or online.prompts_per_step < 1 or online.updates_per_batch < 1:
            problems.append("--group-size must be >= 2 (group-relative advantages), --prompts-per-step and "
                            "--updates-per-batch >= 1")
        elif dp >= 1 and online.prompts_per_step % dp:
            problems.append(f"--prompts-per-step {online.prompts_per_step} does not split evenly over {dp} DP ranks")
        elif dp >= 1 and online.group_size * online.prompts_per_step // dp < (self.data.num_microbatches or 1):
            problems.append(f"{online.prompts_per_step // dp} prompts x {online.group_size} samples per DP rank "
                            f"cannot fill --num-microbatches {self.data.num_microbatches}")
        if online.warmup_steps < 0 or not online.warmup_lr > 0:
            problems.append("--warmup-steps must be >= 0 and --warmup-lr > 0")
        return problems

    def _precision_and_ddp_problems(self) -> list:
        """``--fp16``, and the distributed optimizer's and the overlaps' combinations (Megatron-LM's
        own rules: the parameter gather overlaps only a sharded optimizer's, after overlapped
        gradient reductions)."""
        model, par = self.model, self.parallel
        problems = []
        if model.fp16:
            problems.append("--fp16 is not supported: fp16 needs a dynamic loss scale that skips a step on overflow, "
                            "which this trainer does not run (and megatron-core's grad scaler is CUDA-only); use "
                            "--bf16, which needs no loss scale")
        if model.fp16 and model.bf16:
            problems.append("--bf16 and --fp16 exclude each other")
        if par.overlap_param_gather and not (par.use_distributed_optimizer and par.overlap_grad_reduce):
            problems.append("--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
                            "(as in Megatron-LM)")
        if par.ddp_bucket_size is not None and (par.ddp_bucket_size < 1 or not par.overlap_grad_reduce):
            problems.append("--ddp-bucket-size needs --overlap-grad-reduce and a value >= 1 (without the overlap "
                            "the gradients are reduced as one bucket)")
        return problems

    def _hf_problems(self) -> list:
        """An ``--hf-model`` run: what the HF shape cannot take on this layout."""
        model, tp = self.model, self.parallel.tp
        problems = []
        if tp < 1:
            return problems
        source = f"--hf-model {model.hf_model}"
        for what, count in (("attention heads", model.num_attention_heads),
                            ("key/value heads", model.num_query_groups or model.num_attention_heads)):
            if count % tp:
                problems.append(f"{source}: {count} {what} are not divisible by --tensor-model-parallel-size {tp}")
        if model.vocab_size % tp:
            problems.append(f"{source}: the vocabulary of {model.vocab_size} is not divisible by "
                            f"--tensor-model-parallel-size {tp} (padding it would change every softmax)")
        if model.mtp_num_layers is not None:
            problems.append(f"--mtp-num-layers with {source}: the HF families served here have no MTP weights")
        return problems

    def _mtp_problems(self) -> list:
        model = self.model
        if model.mtp_num_layers is None:
            changed = model.mtp_loss_scaling_factor != ModelConfig.mtp_loss_scaling_factor
            return ["--mtp-loss-scaling-factor needs --mtp-num-layers"] if changed else []
        problems = []
        if model.mtp_num_layers < 1:
            problems.append(f"--mtp-num-layers {model.mtp_num_layers} must be >= 1 (leave it out for no MTP)")
        if not model.mtp_loss_scaling_factor > 0:
            problems.append(f"--mtp-loss-scaling-factor {model.mtp_loss_scaling_factor} must be > 0")
        if not in_range(installed_megatron_core_version(), mtp_loss.SUPPORTED):
            problems.append(f"--mtp-num-layers: {mtp_loss.UNSUPPORTED_REASON} (installed: "
                            f"{installed_megatron_core_version()})")
        return problems

    def _moe_problems(self, world_size: int, *, te: bool) -> list:
        moe, par = self.model.moe, self.parallel
        tp, pp, ep, experts = par.tp, par.pp, par.ep, moe.num_experts
        if experts is None:
            given = [flag for flag, on in (("--expert-model-parallel-size", ep != 1),
                                           ("--moe-aux-loss-coeff", moe.aux_loss_coeff != 0.0),
                                           ("--moe-z-loss-coeff", moe.z_loss_coeff is not None)) if on]
            return [f"{', '.join(given)} need(s) --num-experts"] if given else []
        problems = []
        if experts < 2:
            problems.append(f"--num-experts {experts} must be >= 2")
        if not 2 <= moe.router_topk <= max(experts, 2):
            problems.append(f"--moe-router-topk {moe.router_topk} must be between 2 and --num-experts "
                            f"{experts} (top-1 needs Megatron's pre-softmax routing, not offered here)")
        if moe.aux_loss_coeff < 0 or (moe.z_loss_coeff is not None and moe.z_loss_coeff < 0):
            problems.append("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
        if ep < 1 or experts % max(ep, 1):
            problems.append(f"--expert-model-parallel-size {ep} must be >= 1 and divide --num-experts {experts}")
        elif tp >= 1 and pp >= 1 and (world_size // max(pp, 1)) % (ep * tp):
            problems.append(f"world size / PP = {world_size // max(pp, 1)} is not divisible by EP x TP = {ep} x {tp}")
        if tp > 1 and not par.sequence_parallel:
            problems.append("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core "
                            "refuses MoE training under TP without it)" + ("" if te else "; on CPU that needs TE too"))
        return problems

