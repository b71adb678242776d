"""miles' own conversion, split, loss and training loop with the plug-in, on CPU (gloo), every case of one launch.

    MEGATRON_PG_AGG_MILES=/path/to/miles MEGATRON_LM_PATH=/path/to/Megatron-LM \\
        torchrun --standalone --nproc-per-node {1,2} -m tests.distributed.workers.miles_worker OUT.json

One world size per launch: 1 rank runs DP 1 x CP 1, 2 ranks run DP 2 x CP 1 then DP 1 x CP 2. Per
layout and case, the way miles runs a rollout: the rollout manager's side, miles'
``convert_samples_to_train_data`` (dispatching to the plug-in's hook loaded by miles' ``load_function``
from the flag's dotted path) and ``split_train_data_by_dp`` (the rollout-side ``build_dp_schedule``:
steps of ``--global-batch-size`` rollouts, micro-batches static or dynamic, DP ranks, each step's
``num_rollouts``; or, under ``--delay-split-train-data-by-dp``, the train side's legacy split); then on
every rank the train side as miles' ``MegatronTrainRayActor.train_actor`` runs it: ``get_rollout_data``
(``process_rollout_data``, the CP slices of the rollout log-probs, ``rollout_mask_sums`` as float32),
``get_data_iterator``, ``compute_advantages_and_returns`` (GRPO), ``get_num_rollouts`` and miles'
``train()`` (``train_one_step``: ``get_batch``, ``loss_function`` / ``get_sum_of_sample_mean``,
megatron-core's ``forward_backward_func``, DDP over DP x CP, ``finalize_model_grads``), all miles' and
megatron-core 0.16.1's code, with miles' args from its own parser (Megatron-LM's ``parse_args`` with
miles' ``get_miles_extra_args_provider()``). The same launches run miles' critic
(:mod:`tests.distributed.workers.miles_critic`).

Stand-ins (CPU; no miles or megatron-core code replaced), besides those of
:mod:`tests.distributed.workers.slime_family_cpu` (inert ``httpx``, ``wandb``, ``requests``, ``urllib3``,
``sglang``, ``sglang_router``, ``ray.util``, ``ray.actor``, ``torch_memory_saver``, ``transformers``;
``ray.remote``/``put``/``get``; a silent ``tqdm``; the project's ``PerTokenLM``; the recording
optimizer):
* inert ``huggingface_hub``, ``polars``, ``tokenizers`` and ``triton`` (imported by modules of miles this
  path never calls; ``triton.jit`` returns the function it decorates); SGLang's ``ServerArgs`` and its
  router's ``RouterArgs`` add no flags to miles' parser; SGLang's ``DumperConfig`` parses no overrides
  (miles' dumper stays off, its default);
* ``torch.cuda.current_device`` (the CPU), ``torch.cuda.mem_get_info`` (all free) and ``Tensor.cuda``
  (the tensor itself): miles' data path and ``finalize_model_grads_with_empty_cache`` call them directly;
* miles' ``log_train_step`` records the step's reduced metrics (``loss_dict``) instead of logging them;
* miles' object store: its own ``RayObjectStore`` over the ``ray`` stand-in (one process holds both sides);
* megatron-core on CPU: the project's ``cpu_gloo`` and ``megatron_lm_cpu`` patches.

The log-probs: miles' ``--true-on-policy-mode`` (a full ``log_softmax`` in float32) in every case but
one: miles' default goes through megatron-core's ``fused_vocab_parallel_cross_entropy``, whose backward
casts the logits' gradient to bfloat16 (megatron-core 0.16.1 to 0.19.2), a relative gradient error of
about 1e-3 in float32 training with or without the plug-in; the ``token_mean-fused-ce`` case measures it.

The data and the reference are the slime worker's (slime_family_cpu; :data:`PROMPT_LENGTHS` and
:data:`RESPONSE_LENGTHS` here): 4 prompt groups x 3 samples, ``--global-batch-size 6`` (2 optimizer
steps of 6 rollouts), a fully masked sample, a removed one, masked tokens, GRPO,
``--use-rollout-logprobs``, entropy coefficient 0.01, PPO clip partly active.

OUT (rank 0, JSON): ``{"cases": {"<layout>/<case>": {"steps": [{"objective", "reference", "grad_error",
"increment", ...}], "num_microbatches": [...], "num_rollouts": [...]}}, "times": {...}}``; a refused case
has ``"refused": message``.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import sys
import time

from tests.distributed.workers.slime_family_cpu import (
    ENTROPY,
    GBS,
    GROUP_SIZE,
    MODES,
    SPLITS,
    VOCAB,
    actor_steps,
    config_of,
    install_stand_ins,
    make_samples,
    wrapped,
)

T0 = time.monotonic()
CHECKOUT = os.path.abspath(os.environ["MEGATRON_PG_AGG_MILES"])
MEGATRON_LM = os.path.abspath(os.environ["MEGATRON_LM_PATH"])
PLUGIN_HOOK = "megatron_pg_agg.integrations.miles.plugin.convert_samples_to_train_data"
RESPONSE_LENGTHS = ((6, 2, 9), (4, 11, 3), (7, 2, 5), (8, 3, 10))
PROMPT_LENGTHS = (7, 3, 5, 4)
"""slime's rollout with no response that leaves a rank (CP 1 or 2) one response token: miles'
--true-on-policy-mode log-probs squeeze that rank's ``[1]`` to a scalar, which its ``torch.cat``
refuses (miles 31f1ca9; :func:`checked`)."""
MILES_INERT = ("mooncake", "huggingface_hub", "polars", "tokenizers", "triton")
"""Packages miles' modules import at their top that this path never calls."""


# ---------------------------------------------------------------- stand-ins
def install_miles_stand_ins() -> None:
    """The stand-ins of the module docstring that are miles' own (after the shared ones)."""
    import torch

    install_stand_ins(MILES_INERT)
    import triton

    triton.jit = lambda fn=None, **_k: fn if fn is not None else (lambda f: f)
    import sglang.srt.server_args
    import sglang_router.launch_router

    no_flags = {"add_cli_args": staticmethod(lambda _parser, **_k: None)}  # miles' parser adds SGLang's flags
    sglang.srt.server_args.ServerArgs = type("ServerArgs", (), no_flags)
    sglang_router.launch_router.RouterArgs = type("RouterArgs", (), no_flags)
    import sglang.srt.debug_utils.dumper

    # miles' dumper (off by default) reads its phase overrides through SGLang's config: none here
    sglang.srt.debug_utils.dumper.DumperConfig = type("DumperConfig", (), {
        "_kv_pairs_to_dict": staticmethod(lambda _raw: {})})
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.mem_get_info = lambda _device=None: (1, 1)
    torch.Tensor.cuda = lambda self, *_a, **_k: self


def checked(samples: list) -> list:
    """``samples``, after checking with miles' own CP offsets that no rank at CP 1 or 2 holds exactly one
    response prediction of a sample (:data:`PROMPT_LENGTHS`)."""
    from miles.backends.training_utils.cp_utils import get_logits_and_tokens_offset_with_cp

    for sample in samples:
        total, response = len(sample.tokens), sample.response_length
        counts = [response] + [sum(b - a for a, b in get_logits_and_tokens_offset_with_cp(
            total, response, cp_rank=r, cp_size=2)[2]) for r in (0, 1)]
        if 1 in counts:
            raise ValueError(f"sample {sample.index}: {counts} response predictions per rank (CP 1, CP 2 ranks 0 "
                             "and 1); miles' true-on-policy log-probs fail on 1: change PROMPT_LENGTHS")
    return samples


def miles_args(extra: dict):
    """miles' own parser (Megatron-LM's parse_args + miles' arguments), miles_validate_args' derived
    values this path reads, then the run's settings (as miles' flags and --custom-config-path set them)."""
    from megatron.training.arguments import parse_args
    from miles.utils.arguments import get_miles_extra_args_provider

    argv = sys.argv
    sys.argv = [argv[0], "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "1",
                "--seq-length", "64", "--max-position-embeddings", "64", "--rollout-batch-size", "4",
                "--n-samples-per-prompt", str(GROUP_SIZE), "--global-batch-size", str(GBS), "--micro-batch-size", "1"]
    try:
        args = parse_args(extra_args_provider=get_miles_extra_args_provider(), ignore_unknown_args=True)
    finally:
        sys.argv = argv
    args.eps_clip_high = args.eps_clip  # miles_validate_args' default
    args.use_critic = args.advantage_estimator == "ppo"
    args.use_rollout_logprobs = True
    args.entropy_coef = ENTROPY
    args.overlap_grad_reduce = False
    args.true_on_policy_mode = True  # fp32 log-probs (module docstring); the fused-CE control turns it off
    for key, value in extra.items():
        setattr(args, key, value)
    args.use_critic = args.advantage_estimator == "ppo"
    return args


def convert_and_split(args, samples) -> list:
    """The rollout manager's side (``RolloutManager.generate``): miles' conversion, dispatching to the hook
    named by ``--custom-convert-samples-to-train-data-path``, and its DP split into the object store."""
    from megatron.core import parallel_state as mpu
    from miles.ray.rollout.train_data_conversion import convert_samples_to_train_data, split_train_data_by_dp
    from miles.utils import object_store
    from miles.utils.misc import load_function

    data = convert_samples_to_train_data(args, copy.deepcopy(samples), metadata={},
                                         custom_convert_samples_to_train_data_func=load_function(
                                             args.custom_convert_samples_to_train_data_path),
                                         custom_reward_post_process_func=None)
    if args.delay_split_train_data_by_dp:
        return object_store.get_instance().put(value=data)
    config = {"dp_size": mpu.get_data_parallel_world_size(), "cp_size": mpu.get_context_parallel_world_size(),
              "vpp_size": 1, "microbatch_group_size_per_vp_stage": None}
    return split_train_data_by_dp(args, data, config)


def logged_during(run) -> list:
    """The reduced metrics miles' ``train()`` hands ``log_train_step`` (one dict per step) while ``run()`` runs."""
    from miles.backends.megatron_utils import model as miles_model

    logged = []
    original = miles_model.log_train_step
    miles_model.log_train_step = lambda **kw: logged.append(dict(kw["loss_dict"])) or {}
    try:
        run()
    finally:
        miles_model.log_train_step = original
    return logged


def set_up_layout(args) -> None:
    """Megatron's global args and miles' parallel state for the current layout (miles' own
    ``create_megatron_parallel_state``, no independent DP)."""
    from megatron.training.global_vars import set_args
    from miles.backends.megatron_utils.parallel import create_megatron_parallel_state
    from miles.backends.training_utils.parallel import set_parallel_state
    from miles.utils.ft_utils.process_group_utils import GroupInfo

    set_args(args)
    set_parallel_state(create_megatron_parallel_state(indep_dp=GroupInfo(rank=0, size=1, group=None)))


def rollout_data_of(args, refs):
    """The train actor's ``get_rollout_data`` of ``refs`` (its own DP rank's shard)."""
    from miles.backends.training_utils.data import get_rollout_data

    rollout_data, _ = get_rollout_data(args, refs)
    return rollout_data


def run_case(args, samples, model_state, cp: int):
    """miles' path for one rollout: ``(objectives per step, Capture, num_microbatches, num_rollouts)``."""
    from miles.backends.megatron_utils import model as miles_model
    from miles.backends.training_utils.data import get_data_iterator, get_num_rollouts
    from miles.backends.training_utils.loss import compute_advantages_and_returns

    from megatron_pg_agg.parity.models import PerTokenLM

    refs = convert_and_split(args, samples)
    set_up_layout(args)
    rollout_data = rollout_data_of(args, refs)
    ddp, capture = wrapped(PerTokenLM(config_of(args, cp), VOCAB), model_state)
    data_iterator, num_microbatches = get_data_iterator(args, [ddp], rollout_data)
    compute_advantages_and_returns(args, rollout_data)
    num_rollouts = get_num_rollouts(args, rollout_data, len(num_microbatches))
    logged = logged_during(lambda: miles_model.train(
        0, [ddp], capture, capture, data_iterator, num_microbatches, num_rollouts, witness_info=None, attempt=0))
    return [m["loss"] for m in logged], capture, list(num_microbatches), list(num_rollouts)


# ---------------------------------------------------------------- the cases
def actor_runs(samples, clean) -> list:
    """``(name, extra, data, mode, divisor, plugin)`` of every actor case of a layout."""
    hook = dict(custom_convert_samples_to_train_data_path=PLUGIN_HOOK)
    runs = [(f"{mode}-{split}", dict(hook, pg_agg_mode=mode, pg_agg_divisor=div, **kw), samples, mode, div, True)
            for mode, div in MODES.items() for split, kw in SPLITS.items()]
    for split, kw in SPLITS.items():  # controls: miles' stock losses, no plug-in
        runs.append((f"stock-token_mean-clean-{split}", dict(calculate_per_token_loss=True, **kw), clean,
                     "token_mean", None, False))
        runs.append((f"stock-token_mean-{split}", dict(calculate_per_token_loss=True, **kw), samples,
                     "token_mean", None, False))
        runs.append((f"stock-seq_mean-{split}", dict(kw), samples, "seq_mean", None, False))
    # the train side's legacy split (--delay-split-train-data-by-dp): steps of --global-batch-size samples
    runs.append(("prompt_mean-legacy-split", dict(hook, pg_agg_mode="prompt_mean", delay_split_train_data_by_dp=True,
                                                  **SPLITS["dynamic"]), samples, "prompt_mean", None, True))
    # miles' default log-probs: megatron-core's fused vocab-parallel cross entropy, whose backward
    # rounds the logits' gradient to bfloat16 (with or without the plug-in)
    runs.append(("token_mean-fused-ce", dict(hook, pg_agg_mode="token_mean", true_on_policy_mode=False,
                                             **SPLITS["static1"]), samples, "token_mean", None, True))
    runs.append(("refused-constant-L1", dict(hook, pg_agg_mode="constant", pg_agg_divisor=1.0, **SPLITS["static1"]),
                 samples, "constant", 1.0, True))
    runs.append(("refused-dynamic-global-batch-size", dict(hook, pg_agg_mode="seq_mean",
                                                           use_dynamic_global_batch_size=True, **SPLITS["dynamic"]),
                 samples, "seq_mean", None, True))
    return runs


def run_actor(run, state, cp: int, rank: int, refs: dict) -> dict:
    """One actor case's result row (``refused``: the hook's message); ``refs`` caches the references."""
    from megatron_pg_agg.integrations.miles.plugin import MilesConfigError

    args = miles_args(run[1])
    try:
        objectives, capture, num_mb, num_rollouts = run_case(args, run[2], state, cp)
    except MilesConfigError as error:
        return {"refused": str(error)}
    steps = actor_steps(run, state, rank, refs, objectives, capture.grads, capture.increments)
    return {"steps": steps, "num_microbatches": num_mb, "num_rollouts": num_rollouts}


def main(out_path: str) -> None:
    sys.path[:0] = [CHECKOUT, MEGATRON_LM]
    import torch

    torch.set_num_threads(1)
    from megatron_pg_agg.patches import apply_megatron_patches

    apply_megatron_patches(cpu_gloo=True, megatron_lm_cpu=True)
    install_miles_stand_ins()
    import torch.distributed as dist
    from miles.utils import object_store
    from miles.utils.types import Sample

    from megatron_pg_agg.megatron.parallel import ParallelSizes, init_distributed, init_parallel, shutdown_distributed
    from megatron_pg_agg.parity.models import PerTokenLM
    sys.modules.setdefault("tests.distributed.workers.miles_worker", sys.modules[__name__])  # one copy
    from tests.distributed.workers import miles_critic

    init_distributed()
    object_store._INSTANCE = object_store.RayObjectStore()  # init_instance(args) with the default backend
    world, rank = dist.get_world_size(), dist.get_rank()
    times = {"import": time.monotonic() - T0}
    torch.manual_seed(1234)
    state = {k: v.clone() for k, v in PerTokenLM(None, VOCAB).state_dict().items()}
    ref_model = PerTokenLM(None, VOCAB)
    ref_model.load_state_dict(state)
    make = functools.partial(make_samples, sample_type=Sample, prompt_lengths=PROMPT_LENGTHS,
                             response_lengths=RESPONSE_LENGTHS)
    samples, clean = checked(make(ref_model)), checked(make(ref_model, remove=False, inactive=False))
    critic = miles_critic.Critic(ref_model, make)
    cases = {}
    for dp, cp in [(1, 1)] if world == 1 else [(2, 1), (1, 2)]:
        init_parallel(ParallelSizes(tp=1, pp=1, cp=cp))
        refs, t = {}, time.monotonic()
        for run in actor_runs(samples, clean):
            cases[f"dp{dp}cp{cp}/{run[0]}"] = run_actor(run, state, cp, rank, refs)
        times[f"dp{dp}cp{cp}/actor"], t = time.monotonic() - t, time.monotonic()
        cases.update({f"dp{dp}cp{cp}/{name}": row for name, row in critic.run_all(cp, rank).items()})
        times[f"dp{dp}cp{cp}/critic"] = time.monotonic() - t
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "cases": cases, "times": {**times, "total": time.monotonic() - T0}}, f)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
