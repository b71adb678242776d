"""slime's own conversion, split, loss and training loop with the plug-in, on CPU (gloo), every case of one launch.

    MEGATRON_PG_AGG_SLIME=/path/to/slime MEGATRON_LM_PATH=/path/to/Megatron-LM \\
        torchrun --standalone --nproc-per-node {1,2} -m tests.distributed.workers.slime_worker OUT.json

One world size per launch: 1 rank runs DP 1 x CP 1, 2 ranks run DP 2 x CP 1 then DP 1 x CP 2
(``initialize_model_parallel`` again between them). Per layout and case, the way slime runs a
rollout: the rollout manager's ``_convert_samples_to_train_data`` (slime's, dispatching through
``load_function`` to the plug-in's hook named by the flag's dotted path), its
``_split_train_data_by_dp`` (``build_dp_schedule``: steps, micro-batches static or dynamic, DP
ranks), then on every rank the train actor's own ``_get_rollout_data`` (``process_rollout_data``,
the CP slices of the rollout log-probs), ``compute_advantages_and_returns`` (GRPO),
``get_data_iterator`` and slime's ``train()`` (``train_one_step``: ``get_batch``, ``loss_function``,
megatron-core's ``forward_backward_func``, DDP over DP x CP and ``finalize_model_grads``), all
slime's and megatron-core 0.16.1's code, with slime's args from its own parser (Megatron-LM's
``parse_args`` with slime's ``get_slime_extra_args_provider()``). The same launches run slime's
critic cases (:mod:`tests.distributed.workers.slime_critic`: its ``train_critic`` on the hook's
``rollout_mask_sums``).

Stand-ins (CPU, no slime or megatron-core code replaced):
* packages slime imports but this path never uses (a ``sys.meta_path`` finder makes each module of
  them, submodules included, one whose every name is a class or function that raises when
  called): ``httpx``, ``wandb``, ``requests``, ``urllib3``, ``sglang``, ``sglang_router``,
  ``ray.util``, ``ray.actor``, ``torch_memory_saver``, ``transformers`` (so that slime's
  ``backends/megatron_utils/actor.py`` imports: its ``MegatronTrainRayActor._get_rollout_data`` and
  ``train_critic`` run on an object made without Ray's start-up); ``ray`` itself
  keeps ``remote`` (the decorated class is kept as ``__ray_actor_class__``, as Ray does), ``put``
  and ``get`` (the object itself: one process holds both sides); ``tqdm`` is a silent bar;
* the model: the project's ``PerTokenLM`` (logits of a token depend on that token only), so that a
  CP shard computes what the whole sequence does without Transformer Engine's ring attention;
* the optimizer: its ``step`` records the reduced gradient (DDP's ``main_grad``) and the weights,
  then steps by plain SGD at a given rate (0 for the actor cases: no step); the LR scheduler
  records ``step(increment=...)``;
* slime's accelerator: a CPU one, installed with slime's own ``set_accelerator``;
* megatron-core on CPU: the project's ``cpu_gloo`` and ``megatron_lm_cpu`` patches.

The data: 4 prompt groups x 3 samples (slime ``Sample``: ``group_index``, ``index``, tokens,
ragged responses, a masked token here and there, rewards, rollout log-probs = the model's own
plus noise so that PPO's clip is partly active), ``--global-batch-size 6``: 2 optimizer steps of
2 whole groups. Sample 4 has no valid token; sample 7 is removed (``remove_sample``): the
plug-in keeps it in the denominator (filtered numerator), slime's own conversion masks it whole.
GRPO, ``--use-rollout-logprobs``, entropy coefficient 0.01 (every term goes through
``get_sum_of_sample_mean``).

The reference (rank 0): the same weights in float64, the step grouping stated independently
(``--global-batch-size`` samples in order), GRPO advantages (group mean, unbiased std + 1e-6),
PPO clip and entropy written out, and the README's mode formulas; autograd gives its gradient.

OUT (rank 0, JSON): ``{"cases": {"<layout>/<case>": {"steps": [{"objective", "reference",
"grad_error", "increment"}], "num_microbatches": [...]}}, "times": {...}}``; a refused case has
``"refused": message``.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time

from tests.distributed.workers.slime_family_cpu import (  # noqa: F401 (slime_critic imports them from here)
    ENTROPY,
    GBS,
    GROUP_SIZE,
    MODES,
    SPLITS,
    VOCAB,
    Capture,
    actor_steps,
    config_of,
    install_stand_ins,
    make_samples,
    masks,
    mode_objective,
    wrapped,
)

T0 = time.monotonic()
CHECKOUT = os.path.abspath(os.environ["MEGATRON_PG_AGG_SLIME"])
MEGATRON_LM = os.path.abspath(os.environ["MEGATRON_LM_PATH"])
PLUGIN_HOOK = "megatron_pg_agg.integrations.slime.plugin.convert_samples_to_train_data"



# ---------------------------------------------------------------- stand-ins
def cpu_accelerator():
    """slime's accelerator API on the CPU (installed with slime's own ``set_accelerator``)."""
    import torch
    from slime.utils.accelerator.base import Accelerator

    class CpuAccelerator(Accelerator):
        name = "cpu"
        device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self):
            return True

        def device(self, index=None):
            return torch.device("cpu")

        def device_name(self, index=None):
            return "cpu"

        def set_device(self, index):
            pass

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def synchronize(self, device=None):
            pass

        def current_stream(self, device=None):
            return None

        def empty_cache(self):
            pass

        def mem_get_info(self, device=None):
            return 0, 0

        def memory_allocated(self, device=None):
            return 0

        def memory_reserved(self, device=None):
            return 0

    return CpuAccelerator()


# ---------------------------------------------------------------- slime's args, data and run
def slime_args(extra: dict):
    """slime's own parser (Megatron-LM's parse_args + slime's arguments) and slime's derived value
    for eps_clip_high, then the run's settings (as slime's flags and --custom-config-path set them)."""
    from megatron.training.arguments import parse_args
    from slime.utils.arguments import get_slime_extra_args_provider

    argv = sys.argv
    sys.argv = [argv[0], "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "1",
                "--seq-length", "64", "--max-position-embeddings", "64", "--rollout-batch-size", "4",
                "--n-samples-per-prompt", str(GROUP_SIZE), "--global-batch-size", str(GBS), "--micro-batch-size", "1"]
    try:
        args = parse_args(extra_args_provider=get_slime_extra_args_provider(), ignore_unknown_args=True)
    finally:
        sys.argv = argv
    args.eps_clip_high = args.eps_clip  # slime_validate_args' default
    args.use_rollout_logprobs = True
    args.entropy_coef = ENTROPY
    args.overlap_grad_reduce = False
    for key, value in extra.items():
        setattr(args, key, value)
    return args


def convert_and_split(args, samples, cp: int) -> list:
    """The rollout manager's side: slime's ``_convert_samples_to_train_data`` (dispatching to the hook
    named by ``--custom-convert-samples-to-train-data-path``) and ``_split_train_data_by_dp``."""
    import copy

    from megatron.core import parallel_state as mpu
    from slime.utils.misc import load_function

    from megatron_pg_agg.integrations.slime.plugin import _manager_class

    manager = object.__new__(_manager_class())  # slime's RolloutManager without Ray's actor start-up
    manager.args = args
    manager.custom_reward_post_process_func = None
    manager.custom_convert_samples_to_train_data_func = (
        load_function(args.custom_convert_samples_to_train_data_path)
        if args.custom_convert_samples_to_train_data_path else None)
    manager.train_parallel_config = {"dp_size": mpu.get_data_parallel_world_size(), "cp_size": cp, "vpp_size": 1,
                                     "microbatch_group_size_per_vp_stage": 1}
    data = manager._convert_samples_to_train_data(copy.deepcopy(samples))
    return manager._split_train_data_by_dp(data)


def train_actor_of(args, role: str, refs):
    """slime's ``MegatronTrainRayActor`` for ``role`` on this rank without its Ray start-up (``args``
    set as Megatron's global args, as the role's process has them) and its own
    ``_get_rollout_data`` of ``refs`` (``process_rollout_data``, tensors to the device,
    ``rollout_mask_sums`` as float32, the CP slices of the rollout log-probs)."""
    from megatron.training.global_vars import set_args
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    set_args(args)
    actor = object.__new__(MegatronTrainRayActor)
    actor.args, actor.role = args, role
    return actor, MegatronTrainRayActor._get_rollout_data(actor, refs)


def logged_during(run) -> list:
    """What slime's ``train()`` logs (``logging_utils.log``, one dict per step) while ``run()`` runs."""
    from slime.observability import logging_utils

    logged = []
    original_log = logging_utils.log
    logging_utils.log = lambda _args, metrics, step_key: logged.append(dict(metrics))
    try:
        run()
    finally:
        logging_utils.log = original_log
    return logged


def run_case(args, samples, model_state, cp: int):
    """slime's path for one rollout: ``(objectives per step, gradients, increments, num_microbatches)``."""
    from slime.backends.megatron_utils import model as slime_model
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    from megatron_pg_agg.parity.models import PerTokenLM

    refs = convert_and_split(args, samples, cp)
    _, rollout_data = train_actor_of(args, "actor", refs)
    compute_advantages_and_returns(args, rollout_data)
    ddp, capture = wrapped(PerTokenLM(config_of(args, cp), VOCAB), model_state)
    logged = logged_during(lambda: slime_model.train(
        0, [ddp], capture, capture, get_data_iterator(rollout_data), rollout_data["num_microbatches"],
        rollout_data["global_batch_sizes"]))
    return ([m["train/loss"] for m in logged], capture.grads, capture.increments,
            list(rollout_data["num_microbatches"]))


def actor_runs(samples, clean) -> list:
    """``(name, extra, data, mode, divisor, plugin)`` of every actor case of a layout."""
    runs = [(f"{mode}-{split}", dict(custom_convert_samples_to_train_data_path=PLUGIN_HOOK, pg_agg_mode=mode,
                                     pg_agg_divisor=div, **kw), samples, mode, div, True)
            for mode, div in MODES.items() for split, kw in SPLITS.items()]
    for split, kw in SPLITS.items():  # controls: slime's stock token mean, without and with a fully masked sample
        runs.append((f"stock-token_mean-clean-{split}", dict(calculate_per_token_loss=True, **kw), clean,
                     "token_mean", None, False))
        runs.append((f"stock-token_mean-{split}", dict(calculate_per_token_loss=True, **kw), samples,
                     "token_mean", None, False))
    # both sides of the clamp: constant's D_i = S*L/gbs is 5*12/6 = 10 above; with L = 1 it is 5/6 in step 0
    runs.append(("refused-constant-L1", dict(custom_convert_samples_to_train_data_path=PLUGIN_HOOK,
                                             pg_agg_mode="constant", pg_agg_divisor=1.0, **SPLITS["static1"]),
                 samples, "constant", 1.0, True))
    return runs


def run_actor(run, state, cp: int, rank: int, refs: dict) -> dict:
    """One actor case's result row (``refused``: the hook's message); ``refs`` caches the references."""
    from megatron_pg_agg.integrations.slime.weights import SlimeConfigError

    args = slime_args(run[1])
    try:
        objectives, grads, increments, num_mb = run_case(args, run[2], state, cp)
    except SlimeConfigError as error:
        return {"refused": str(error)}
    return {"steps": actor_steps(run, state, rank, refs, objectives, grads, increments), "num_microbatches": num_mb}


def main(out_path: str) -> None:
    sys.path[:0] = [CHECKOUT, MEGATRON_LM]
    import torch

    torch.set_num_threads(1)
    from megatron_pg_agg.patches import apply_megatron_patches

    apply_megatron_patches(cpu_gloo=True, megatron_lm_cpu=True)
    install_stand_ins()
    from slime.utils import accelerator

    accelerator.set_accelerator(cpu_accelerator())
    import torch.distributed as dist

    from megatron_pg_agg.megatron.parallel import ParallelSizes, init_distributed, init_parallel, shutdown_distributed
    from megatron_pg_agg.parity.models import PerTokenLM
    sys.modules.setdefault("tests.distributed.workers.slime_worker", sys.modules[__name__])  # one copy
    from tests.distributed.workers import slime_critic

    init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    t_import = time.monotonic() - T0
    torch.manual_seed(1234)
    state = PerTokenLM(None, VOCAB).state_dict()
    state = {k: v.clone() for k, v in state.items()}
    ref_model = PerTokenLM(None, VOCAB)
    ref_model.load_state_dict(state)
    from slime.utils.types import Sample

    samples = make_samples(ref_model, Sample)
    clean = make_samples(ref_model, Sample, remove=False, inactive=False)
    critic_state = slime_critic.initial_state()
    critic_samples, critic_clean = slime_critic.samples(ref_model, functools.partial(make_samples, sample_type=Sample))
    layouts = [(1, 1)] if world == 1 else [(2, 1), (1, 2)]
    cases, times = {}, {"import": t_import}
    for dp, cp in layouts:
        init_parallel(ParallelSizes(tp=1, pp=1, cp=cp))
        refs, t = {}, time.monotonic()
        for run in actor_runs(samples, clean):
            cases[f"dp{dp}cp{cp}/{run[0]}"] = run_actor(run, state, cp, rank, refs)
        times[f"dp{dp}cp{cp}/actor"], t = time.monotonic() - t, time.monotonic()
        for run in slime_critic.critic_runs(MODES, SPLITS, critic_samples, critic_clean):
            cases[f"dp{dp}cp{cp}/{run[0]}"] = slime_critic.run_critic(run, critic_state, cp, rank)
        times[f"dp{dp}cp{cp}/critic"] = time.monotonic() - t
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "cases": cases, "times": {**times, "total": time.monotonic() - T0}}, f)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
