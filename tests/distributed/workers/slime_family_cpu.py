"""What the slime and miles CPU workers share: stand-ins, rollout, optimizer stand-in, float64 reference.

Used by :mod:`tests.distributed.workers.slime_worker` and :mod:`tests.distributed.workers.miles_worker`
(their docstrings describe the cases). The hosts differ in their package (``slime`` / ``miles``), the
data path from samples to the loss, and what each imports; the loss (``get_sum_of_sample_mean``, PPO
clip, entropy), GRPO's advantages and the model are the same, so the reference is written once here.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

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


INERT = ["httpx", "wandb", "requests", "urllib3", "sglang", "sglang_router", "ray.util", "ray.actor",
         "torch_memory_saver", "transformers"]
"""Packages slime imports but this path never calls: each, with every submodule, an inert module."""


class _InertFinder:
    """``sys.meta_path`` finder: any module of :data:`INERT` (submodules included) is an inert one."""

    @staticmethod
    def find_spec(name, _path=None, _target=None):
        if any(name == root or name.startswith(root + ".") for root in INERT):
            return importlib.machinery.ModuleSpec(name, _InertFinder, is_package=True)
        return None

    @staticmethod
    def create_module(spec):
        return _inert_module(spec.name)

    @staticmethod
    def exec_module(_module):
        pass


def install_stand_ins(extra: tuple = ()) -> None:
    """The stand-ins (module docstrings of the workers): the inert packages of :data:`INERT` and
    ``extra``, ``ray`` with ``remote``/``put``/``get``, a silent ``tqdm``."""
    INERT.extend(extra)
    sys.meta_path.insert(0, _InertFinder)
    ray = _inert_module("ray")
    ray.remote = lambda target=None, **_k: _ActorClass(target) if isinstance(target, type) else target
    ray.put = lambda value, **_k: value
    ray.get = lambda value, **_k: value
    sys.modules["ray"] = ray
    importlib.import_module("ray.util")  # the finder's inert one, set as the stand-in's attribute
    tqdm = _inert_module("tqdm")
    tqdm.tqdm = _Bar
    sys.modules["tqdm"] = tqdm


def make_samples(model, sample_type, remove: bool = True, inactive: bool = True, prompt_lengths=PROMPT_LENGTHS,
                 response_lengths=RESPONSE_LENGTHS):
    """The host's ``Sample`` (``sample_type``: slime's or miles') of the whole rollout (every rank the same)."""
    import torch

    Sample = sample_type  # noqa: N806

    g = torch.Generator().manual_seed(7)
    samples = []
    for group, (prompt_len, lengths, rewards) in enumerate(zip(prompt_lengths, response_lengths, REWARDS)):
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
    """The optimizer and LR scheduler stand-ins: ``step`` records the reduced gradient and the weights
    the step's forward ran on, then moves the weights by plain SGD with rate ``lr`` (0, the actor
    cases: they stay)."""

    def __init__(self, ddp_model, lr: float = 0.0):
        self.model, self.lr = ddp_model, lr
        self.grads, self.weights, self.increments, self.param_groups = [], [], [], []

    def scale_loss(self, loss):
        return loss

    def zero_grad(self):
        pass

    def step(self, increment=None):
        if increment is not None:  # the scheduler
            self.increments.append(increment)
            return
        import torch

        params = dict(sorted(self.model.module.named_parameters()))
        self.grads.append(torch.cat([p.main_grad.reshape(-1).double() for p in params.values()]))
        self.weights.append({n: p.detach().double().clone() for n, p in params.items()})
        if self.lr:
            with torch.no_grad():
                for p in params.values():
                    p.sub_(self.lr * p.main_grad)
        return True, 0.0, 0

    def get_lr(self, _group):
        return 0.0


def wrapped(module, state, lr: float = 0.0):
    """``module`` with ``state`` in megatron-core DDP and its :class:`Capture` optimizer."""
    from megatron_pg_agg.megatron.model import default_ddp_config, wrap_in_ddp

    module.load_state_dict(state)
    (ddp,) = wrap_in_ddp([module], module.config, default_ddp_config())
    return ddp, Capture(ddp, lr)


def config_of(args, cp: int):
    """The model config as Megatron-LM builds it from slime's args."""
    from megatron_pg_agg.parity.models import tiny_transformer_config

    return tiny_transformer_config(context_parallel_size=cp, calculate_per_token_loss=args.calculate_per_token_loss)


# ---------------------------------------------------------------- the float64 reference
def masks(sample, plugin: bool):
    """float64 ``(denominator, numerator)`` masks of a sample: a removed sample leaves the numerator
    only (``plugin``: the filtered-numerator rule), or both (slime's own conversion masks it whole)."""
    import torch

    den = torch.tensor(sample.loss_mask, dtype=torch.float64)
    num = den * (0.0 if sample.remove_sample else 1.0)
    return (num if sample.remove_sample and not plugin else den), num


def mode_objective(samples, step, sums, sizes, mode, divisor):
    """The README's J of one step from per-sample numerator sums ``N_i`` and denominators ``D_i``."""
    active = [i for i in step if sizes[i] > 0]
    if mode == "token_mean":
        return sum(sums[i] for i in step) / sum(sizes[i] for i in step)
    if mode == "seq_mean":
        return sum(sums[i] / sizes[i] for i in active) / len(active)
    if mode == "constant":
        return sum(sums[i] for i in step) / (len(active) * divisor)
    groups = {}
    for i in step:
        groups.setdefault(samples[i].group_index, []).append(i)
    live = [m for m in groups.values() if sum(sizes[i] for i in m) > 0]
    return sum(sum(sums[i] for i in m) / sum(sizes[i] for i in m) for m in live) / len(live)


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
            den[i], num[i] = masks(s, plugin)
        sums = {i: (tok_loss[i] * num[i]).sum() for i in step}
        sizes = {i: float(den[i].sum()) for i in step}
        j = mode_objective(samples, step, sums, sizes, mode, divisor)
        j.backward()
        out.append((float(j), torch.cat([params[n].grad.reshape(-1) for n in names]),
                    int(sum(sizes.values())), sum(1 for i in step if sizes[i] == 0)))
    return out


def actor_steps(run, state, rank: int, refs: dict, objectives, grads, increments) -> list:
    """The step rows of one actor case: the host's objectives (rank 0), reduced gradients and LR
    increments, with rank 0's float64 reference (``refs`` caches it per data, mode and rule)."""
    _name, _extra, data, mode, div, plugin = run
    key = (id(data), mode, div, plugin)
    if key not in refs and rank == 0:
        refs[key] = reference_steps(data, state, mode, div, plugin)
    steps = []
    for s, grad in enumerate(grads):
        row = {"objective": objectives[s] if rank == 0 else None, "increment": increments[s]}
        if rank == 0:
            ref_j, ref_g, tokens, empty = refs[key][s]
            row.update(reference=ref_j, grad_error=float((grad - ref_g).norm() / ref_g.norm()),
                       valid_tokens=tokens, fully_masked=empty)
        steps.append(row)
    return steps


# ---------------------------------------------------------------- the critic (--advantage-estimator ppo)
CRITIC_SEED = 4321
VALUE_CLIP = 0.2  # slime's and miles' default --value-clip
GAMMA, LAMBD = 0.9, 0.8
LR = 1.0
"""The critic's SGD rate between its two steps (so that the second trains partly in the value clip)."""
CRITIC_PROMPT_LENGTHS = (6, 8, 7, 8)
"""The critic's prompts: every sample's last response prediction on CP rank 0 at CP 2 (slime_critic.samples)."""


def critic_module(config, head):
    """``PerTokenLM`` with the host's value head ``head`` (slime's or miles' ``LinearForLastLayer``,
    installed as their ``model_provider`` does for role ``critic``)."""
    import torch

    from megatron_pg_agg.parity.models import PerTokenLM

    class PerTokenCritic(PerTokenLM):
        def forward(self, input_ids, position_ids=None, attention_mask=None, packed_seq_params=None, **_):
            hidden = torch.tanh(self.mix(self.embedding(input_ids)))
            logits, _ = self.output_layer(hidden)  # GPTModel's call of its output layer
            return logits

    module = PerTokenCritic(config, VOCAB)
    module.output_layer = head(input_size=module.mix.in_features, output_size=1, config=config)
    return module


def initial_state(head) -> dict:
    """The critic's weights (the same on every rank)."""
    import torch

    from megatron_pg_agg.parity.models import tiny_transformer_config

    torch.manual_seed(CRITIC_SEED)
    return {k: v.clone() for k, v in critic_module(tiny_transformer_config(), head).state_dict().items()}


def _values(weights: dict, sample):
    """float64 ``V`` at the position before each response token (slime's ``get_responses`` alignment)."""
    import torch

    tokens = torch.tensor(sample.tokens)
    start = len(tokens) - sample.response_length - 1
    hidden = torch.tanh(weights["embedding.weight"][tokens] @ weights["mix.weight"].T + weights["mix.bias"])
    return (hidden @ weights["output_layer.weight"].T + weights["output_layer.bias"])[start:len(tokens) - 1, 0]


def critic_reference_steps(samples, state, weights, mode, divisor, plugin: bool, returns_of):
    """Per step ``(J, flat gradient, clipped, tokens, active)`` of the critic in float64: ``V`` from the
    weights (``state`` for ``V_old``, ``weights[k]`` for step k), ``returns_of(sample, V_old, numerator
    mask)`` the host's GAE returns, ``v_t = max((V - R)^2, (clip(V, V_old +- VALUE_CLIP) - R)^2)``, the
    mode's J (:func:`mode_objective`), autograd for the gradient;
    ``clipped`` the numerator tokens where the clipped branch is the larger, ``tokens`` all
    numerator tokens, ``active`` the samples with a denominator token."""
    import torch

    initial = {n: t.double() for n, t in state.items()}
    old = [_values(initial, s).detach() for s in samples]
    returns = [returns_of(s, v, masks(s, plugin)[1]) for s, v in zip(samples, old)]
    out = []
    for k, start in enumerate(range(0, len(samples) - GBS + 1, GBS)):
        step = list(range(start, start + GBS))
        w = {n: t.clone().requires_grad_(True) for n, t in sorted(weights[k].items())}
        sums, sizes, clipped, tokens = {}, {}, 0, 0
        for i in step:
            values = _values(w, samples[i])
            clip = torch.minimum(torch.maximum(values, old[i] - VALUE_CLIP), old[i] + VALUE_CLIP)
            plain, clipped_error = (values - returns[i]).square(), (clip - returns[i]).square()
            den, num = masks(samples[i], plugin)
            sums[i], sizes[i] = (torch.maximum(plain, clipped_error) * num).sum(), float(den.sum())
            clipped += int(((clipped_error > plain) & (num > 0)).sum())
            tokens += int(num.sum())
        j = mode_objective(samples, step, sums, sizes, mode, divisor)
        j.backward()
        out.append((float(j), torch.cat([t.grad.reshape(-1) for t in w.values()]), clipped, tokens,
                    sum(1 for i in step if sizes[i] > 0)))
    return out
