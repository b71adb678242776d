"""slime's own conversion, split, loss and training loop with the plug-in, on CPU (gloo), every case of one launch.

    MEGATRON_PG_AGG_SLIME=/path/to/slime MEGATRON_LM_PATH=/path/to/Megatron-LM \\
        torchrun --standalone --nproc-per-node {1,2} -m tests.distributed.workers.slime_worker OUT.json

One world size per launch: 1 rank runs DP 1 x CP 1, 2 ranks run DP 2 x CP 1 then DP 1 x CP 2
(``initialize_model_parallel`` again between them). Per layout and case, the way slime runs a
rollout: the rollout manager's ``_convert_samples_to_train_data`` (slime's, dispatching through
``load_function`` to the plug-in's hook named by the flag's dotted path), its
``_split_train_data_by_dp`` (``build_dp_schedule``: steps, micro-batches static or dynamic, DP
ranks), then on every rank ``process_rollout_data``, ``compute_advantages_and_returns`` (GRPO),
``get_data_iterator`` and slime's ``train()`` (``train_one_step``: ``get_batch``, ``loss_function``,
megatron-core's ``forward_backward_func``, DDP over DP x CP and ``finalize_model_grads``), all
slime's and megatron-core 0.16.1's code, with slime's args from its own parser (Megatron-LM's
``parse_args`` with slime's ``get_slime_extra_args_provider()``).

Stand-ins (CPU, no slime or megatron-core code replaced):
* modules slime imports but this path never uses (sys.modules; every name in them is a class or
  function that raises when called): ``httpx``, ``wandb``, ``requests``, ``urllib3``, ``sglang``,
  ``sglang_router``, ``ray.util.scheduling_strategies``, ``torch_memory_saver``; ``ray`` itself
  keeps ``remote`` (the decorated class is kept as ``__ray_actor_class__``, as Ray does), ``put``
  and ``get`` (the object itself: one process holds both sides); ``tqdm`` is a silent bar;
* the model: the project's ``PerTokenLM`` (logits of a token depend on that token only), so that a
  CP shard computes what the whole sequence does without Transformer Engine's ring attention;
* the optimizer: its ``step`` records the reduced gradient (DDP's ``main_grad``) instead of
  stepping; the LR scheduler records ``step(increment=...)``;
* the actor's ``_get_rollout_data`` (``actor.py``: its module imports torch_memory_saver,
  transformers and sglang) is restated: slime's ``process_rollout_data``, then its
  ``slice_log_prob_with_cp`` on the rollout log-probs;
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

import importlib.machinery
import json
import os
import sys
import time
import types

T0 = time.monotonic()
CHECKOUT = os.path.abspath(os.environ["MEGATRON_PG_AGG_SLIME"])
MEGATRON_LM = os.path.abspath(os.environ["MEGATRON_LM_PATH"])
PLUGIN_HOOK = "megatron_pg_agg.integrations.slime_plugin.convert_samples_to_train_data"

VOCAB = 40
GROUP_SIZE = 3
PROMPT_LENGTHS = (5, 3, 7, 4)
RESPONSE_LENGTHS = ((6, 2, 9), (4, 11, 3), (7, 1, 5), (8, 3, 10))
REWARDS = ((1.0, 0.0, 0.0), (0.0, 1.0, 1.0), (1.0, 1.0, 0.0), (0.5, 0.0, 1.0))
GBS = 6
ENTROPY = 0.01
EPS = 0.2
INACTIVE, REMOVED = 4, 7
MODES = {"token_mean": None, "seq_mean": None, "prompt_mean": None, "constant": 12.0}
SPLITS = {"static1": dict(micro_batch_size=1), "static3": dict(micro_batch_size=3),
          "dynamic": dict(use_dynamic_batch_size=True, max_tokens_per_gpu=30)}


# ---------------------------------------------------------------- stand-ins
def _inert_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, "CPU stand-in (tests/distributed/workers/slime_worker.py): unused here")
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)

    def attribute(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def refuse(*_a, **_k):
            raise RuntimeError(f"stand-in {name}.{attr} was used")

        return type(attr, (), {"__init__": refuse}) if attr[:1].isupper() else refuse

    module.__getattr__ = attribute
    return module


class _ActorClass:
    """What ``ray.remote`` returns for a class: the class itself is ``__ray_actor_class__``."""

    def __init__(self, cls):
        self.__ray_actor_class__ = cls


class _Bar:
    def __init__(self, *_a, **_k):
        pass

    def update(self, *_a):
        pass

    def close(self):
        pass


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


def install_stand_ins() -> None:
    for name in ("httpx", "wandb", "requests", "urllib3", "urllib3.exceptions", "sglang", "sglang.srt",
                 "sglang.srt.constants", "sglang.srt.server_args", "sglang.srt.utils", "sglang_router",
                 "sglang_router.launch_router", "ray.util", "ray.util.scheduling_strategies", "torch_memory_saver"):
        sys.modules.setdefault(name, _inert_module(name))
    ray = _inert_module("ray")
    ray.remote = lambda target=None, **_k: _ActorClass(target) if isinstance(target, type) else target
    ray.put = lambda value, **_k: value
    ray.get = lambda value, **_k: value
    ray.util = sys.modules["ray.util"]
    sys.modules["ray"] = ray
    tqdm = _inert_module("tqdm")
    tqdm.tqdm = _Bar
    sys.modules["tqdm"] = tqdm


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


def make_samples(model, remove: bool = True, inactive: bool = True):
    """slime Samples of the whole rollout (every rank the same)."""
    import torch
    from slime.utils.types import Sample

    g = torch.Generator().manual_seed(7)
    samples = []
    for group, (prompt_len, lengths, rewards) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS, REWARDS)):
        prompt = torch.randint(1, VOCAB, (prompt_len,), generator=g)
        for length, reward in zip(lengths, rewards):
            response = torch.randint(1, VOCAB, (length,), generator=g)
            tokens = torch.cat([prompt, response])
            with torch.no_grad():
                logp = torch.log_softmax(model(tokens[None])[0].float(), -1)
            own = logp[torch.arange(prompt_len - 1, len(tokens) - 1), response]
            mask = [1] * length
            if length > 4:
                mask[2] = 0
            index = len(samples)
            if index == INACTIVE and inactive:
                mask = [0] * length
            samples.append(Sample(group_index=group, index=index, tokens=tokens.tolist(), response_length=length,
                                  reward=reward, loss_mask=mask, status=Sample.Status.COMPLETED,
                                  remove_sample=remove and index == REMOVED,
                                  rollout_log_probs=(own + 0.3 * torch.randn(length, generator=g)).tolist()))
    return samples


class Capture:
    """The optimizer and LR scheduler stand-ins: ``step`` records the reduced gradient."""

    def __init__(self, ddp_model):
        self.model, self.grads, self.increments, self.param_groups = ddp_model, [], [], []

    def scale_loss(self, loss):
        return loss

    def zero_grad(self):
        pass

    def step(self, increment=None):
        if increment is not None:  # the scheduler
            self.increments.append(increment)
            return
        import torch

        names = sorted(n for n, _ in self.model.module.named_parameters())
        params = dict(self.model.module.named_parameters())
        self.grads.append(torch.cat([params[n].main_grad.reshape(-1).double() for n in names]))
        return True, 0.0, 0

    def get_lr(self, _group):
        return 0.0


def run_case(args, samples, model_state, cp: int):
    """slime's path for one rollout: ``(objectives per step, gradients, increments, num_microbatches)``."""
    import copy

    import torch
    from megatron.core import parallel_state as mpu
    from megatron.training.global_vars import set_args
    from slime.backends.megatron_utils import model as slime_model
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns
    from slime.observability import logging_utils
    from slime.utils.data import process_rollout_data
    from slime.utils.misc import load_function

    from megatron_pg_agg.integrations.slime_plugin import _manager_class
    from megatron_pg_agg.megatron.model import default_ddp_config, wrap_in_ddp
    from megatron_pg_agg.parity.models import PerTokenLM, tiny_transformer_config

    set_args(args)
    manager = object.__new__(_manager_class())  # slime's RolloutManager without Ray's actor start-up
    manager.args = args
    manager.custom_reward_post_process_func = None
    manager.custom_convert_samples_to_train_data_func = (
        load_function(args.custom_convert_samples_to_train_data_path)
        if args.custom_convert_samples_to_train_data_path else None)
    dp = mpu.get_data_parallel_world_size()
    manager.train_parallel_config = {"dp_size": dp, "cp_size": cp, "vpp_size": 1,
                                     "microbatch_group_size_per_vp_stage": 1}
    data = manager._convert_samples_to_train_data(copy.deepcopy(samples))
    refs = manager._split_train_data_by_dp(data)

    rollout_data = process_rollout_data(args, refs, mpu.get_data_parallel_rank(), dp)  # the actor's start
    rollout_data["rollout_log_probs"] = [
        torch.as_tensor(slice_log_prob_with_cp(lp, tl, rl), dtype=torch.float32)
        for lp, tl, rl in zip(rollout_data["rollout_log_probs"], rollout_data["total_lengths"],
                              rollout_data["response_lengths"])]
    compute_advantages_and_returns(args, rollout_data)

    config = tiny_transformer_config(context_parallel_size=cp,  # as Megatron-LM builds it from slime's args
                                    calculate_per_token_loss=args.calculate_per_token_loss)
    module = PerTokenLM(config, VOCAB)
    module.load_state_dict(model_state)
    (ddp,) = wrap_in_ddp([module], config, default_ddp_config())
    capture = Capture(ddp)
    logged = []
    original_log = logging_utils.log
    logging_utils.log = lambda _args, metrics, step_key: logged.append(dict(metrics))
    try:
        slime_model.train(0, [ddp], capture, capture, get_data_iterator(rollout_data),
                          rollout_data["num_microbatches"], rollout_data["global_batch_sizes"])
    finally:
        logging_utils.log = original_log
    return ([m["train/loss"] for m in logged], capture.grads, capture.increments,
            list(rollout_data["num_microbatches"]))


# ---------------------------------------------------------------- the float64 reference
def reference_steps(samples, model_state, mode, divisor, plugin: bool):
    """Per step ``(J, flat gradient)`` in float64 (module docstring). ``plugin``: the removed
    sample stays in the denominator (the filtered-numerator rule); else slime's own masks."""
    import torch

    from megatron_pg_agg.parity.models import PerTokenLM

    model = PerTokenLM(None, VOCAB).double()
    model.load_state_dict(model_state)
    names = sorted(n for n, _ in model.named_parameters())
    params = dict(model.named_parameters())
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64).view(-1, GROUP_SIZE)
    centred = rewards - rewards.mean(-1, keepdim=True)
    advantages = (centred / (centred.std(-1, keepdim=True) + 1e-6)).reshape(-1)
    out = []
    for start in range(0, len(samples) - GBS + 1, GBS):
        step = list(range(start, start + GBS))
        model.zero_grad()
        tok_loss, den, num = {}, {}, {}
        for i in step:
            s = samples[i]
            tokens = torch.tensor(s.tokens)
            p = len(tokens) - s.response_length
            logits = model(tokens[None])[0][p - 1:len(tokens) - 1]
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all[torch.arange(s.response_length), tokens[p:]]
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            ratio = torch.exp(logp - torch.tensor(s.rollout_log_probs, dtype=torch.float32).double())
            a = advantages[i]
            pg = torch.maximum(-ratio * a, -ratio.clamp(1 - EPS, 1 + EPS) * a)
            tok_loss[i] = pg - ENTROPY * entropy
            den[i] = torch.tensor(s.loss_mask, dtype=torch.float64)
            removed = s.remove_sample
            num[i] = den[i] * (0.0 if removed else 1.0)
            if removed and not plugin:
                den[i] = num[i]
        sums = {i: (tok_loss[i] * num[i]).sum() for i in step}
        sizes = {i: float(den[i].sum()) for i in step}
        active = [i for i in step if sizes[i] > 0]
        if mode == "token_mean":
            j = sum(sums.values()) / sum(sizes.values())
        elif mode == "seq_mean":
            j = sum(sums[i] / sizes[i] for i in active) / len(active)
        elif mode == "constant":
            j = sum(sums.values()) / (len(active) * divisor)
        else:
            groups = {}
            for i in step:
                groups.setdefault(samples[i].group_index, []).append(i)
            live = [m for m in groups.values() if sum(sizes[i] for i in m) > 0]
            j = sum(sum(sums[i] for i in m) / sum(sizes[i] for i in m) for m in live) / len(live)
        j.backward()
        out.append((float(j), torch.cat([params[n].grad.reshape(-1) for n in names]),
                    int(sum(sizes.values())), sum(1 for i in step if sizes[i] == 0)))
    return out


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

    from megatron_pg_agg.integrations.slime_weights import SlimeConfigError
    from megatron_pg_agg.megatron.parallel import ParallelSizes, init_distributed, init_parallel, shutdown_distributed
    from megatron_pg_agg.parity.models import PerTokenLM

    init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    t_import = time.monotonic() - T0
    torch.manual_seed(1234)
    state = PerTokenLM(None, VOCAB).state_dict()
    state = {k: v.clone() for k, v in state.items()}
    ref_model = PerTokenLM(None, VOCAB)
    ref_model.load_state_dict(state)
    samples = make_samples(ref_model)
    clean = make_samples(ref_model, remove=False, inactive=False)
    layouts = [(1, 1)] if world == 1 else [(2, 1), (1, 2)]
    cases = {}
    for dp, cp in layouts:
        init_parallel(ParallelSizes(tp=1, pp=1, cp=cp))
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
        refs = {}
        for name, extra, data, mode, div, plugin in runs:
            t = time.monotonic()
            args = slime_args(extra)
            try:
                objectives, grads, increments, num_mb = run_case(args, data, state, cp)
            except SlimeConfigError as error:
                cases[f"dp{dp}cp{cp}/{name}"] = {"refused": str(error)}
                continue
            key = (id(data), mode, div, plugin)
            if key not in refs and rank == 0:
                refs[key] = reference_steps(data, state, mode, div, plugin)
            steps = []
            for s, (obj, grad) in enumerate(zip(objectives, grads)):
                row = {"objective": obj, "increment": increments[s]}
                if rank == 0:
                    ref_j, ref_g, tokens, empty = refs[key][s]
                    row.update(reference=ref_j, grad_error=float((grad - ref_g).norm() / ref_g.norm()),
                               valid_tokens=tokens, fully_masked=empty)
                steps.append(row)
            cases[f"dp{dp}cp{cp}/{name}"] = {"steps": steps, "num_microbatches": num_mb,
                                             "seconds": time.monotonic() - t}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "cases": cases,
                       "times": {"import": t_import, "total": time.monotonic() - T0}}, f)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
