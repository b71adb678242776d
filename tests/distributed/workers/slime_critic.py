"""slime's critic with the plug-in: its own ``train_critic`` in megatron-core's schedule, and its float64 reference.

Run by :mod:`tests.distributed.workers.slime_worker` (same launches, layouts, samples and micro-batch
splits as the actor's cases). Per case, the way slime trains its critic (``--advantage-estimator
ppo``): the rollout manager's conversion and split on the base args (the plug-in's hook writes
``rollout_mask_sums``), then on every rank the critic role's args as slime's
``create_training_models`` derives them (a deep copy of the base args, or slime's
``parse_megatron_role_args`` over a ``--megatron-config-path`` YAML), slime's own
``MegatronTrainRayActor._get_rollout_data`` and ``train_critic``: ``forward_only(get_values)`` (the old
values ``V_old``), ``compute_advantages_and_returns`` (``ppo``: GAE, the reward at the last token),
``args.loss_type = "value_loss"`` and ``train()`` (``loss_function`` -> ``value_loss_function`` ->
``get_sum_of_sample_mean``, megatron-core's ``forward_backward_func``, DDP, ``finalize_model_grads``).

The model: the project's ``PerTokenLM`` body with slime's value head, ``LinearForLastLayer(hidden, 1)``
installed as ``output_layer`` as slime's ``model_provider`` does for role ``critic`` (its ``(logits,
None)`` unpacked as GPTModel does). The optimizer stand-in moves the weights by SGD (rate :data:`LR`)
after recording the reduced gradient, so that the second step's values leave ``V_old`` and slime's
value clip (``--value-clip`` :data:`VALUE_CLIP`) is partly active there.

The reference (rank 0, float64, written from the formulas): per sample ``V`` at the position before
each response token from the weights read from the model (the initial state for ``V_old``, each step's
recorded weights for ``V``); GAE written out (``gamma`` :data:`GAMMA`, ``lambda`` :data:`LAMBD`, the
reward at the last response token, every response token); per token ``v_t = max((V - R)^2,
(clip(V, V_old - eps, V_old + eps) - R)^2)`` (slime's factor 1, no 0.5); the step's J in the mode
(README formulas, ``mode_objective``); autograd for the gradient.
"""
from __future__ import annotations

import copy
import os
import tempfile

from tests.distributed.workers import slime_family_cpu as shared
from tests.distributed.workers.slime_family_cpu import CRITIC_PROMPT_LENGTHS as PROMPT_LENGTHS
from tests.distributed.workers.slime_family_cpu import GAMMA, LAMBD, LR, VALUE_CLIP
from tests.distributed.workers.slime_worker import (
    GBS,
    PLUGIN_HOOK,
    config_of,
    convert_and_split,
    logged_during,
    slime_args,
    train_actor_of,
    wrapped,
)

_YAML_DIR: list = []


def _head():
    from slime.backends.megatron_utils.model_provider import LinearForLastLayer

    return LinearForLastLayer


def critic_module(config):
    """``PerTokenLM`` with slime's value head (``model_provider``, role ``critic``)."""
    return shared.critic_module(config, _head())


def initial_state() -> dict:
    """The critic's weights (the same on every rank)."""
    return shared.initial_state(_head())


def critic_args(extra: dict, overrides=None):
    """``(base args, critic role args)``: slime's parser with ``--advantage-estimator ppo`` (slime sets
    ``use_critic``) and the run's settings; the critic's as ``create_training_models`` derives them
    (``overrides`` None: a deep copy; else a ``--megatron-config-path`` YAML with the critic's
    overrides, through slime's ``parse_megatron_role_args``)."""
    import yaml
    from slime.utils.arguments import parse_megatron_role_args

    base = slime_args(dict(advantage_estimator="ppo", use_critic=True, gamma=GAMMA, lambd=LAMBD,
                           value_clip=VALUE_CLIP, **extra))
    if overrides is None:
        return base, copy.deepcopy(base)
    if not _YAML_DIR:
        _YAML_DIR.append(tempfile.TemporaryDirectory(prefix="slime-critic-"))  # removed at exit
    path = os.path.join(_YAML_DIR[0].name, f"megatron-{len(os.listdir(_YAML_DIR[0].name))}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"megatron": [{"name": "critic", "role": "critic", "overrides": overrides}]}, f)
    base.megatron_config_path = path
    return base, parse_megatron_role_args(base, path, role="critic")


def run_critic_case(args, role_args, samples, state, cp: int):
    """slime's critic path for one rollout: ``(value losses per step, Capture, num_microbatches)``."""
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    refs = convert_and_split(args, samples, cp)  # the rollout manager: base args
    actor, rollout_data = train_actor_of(role_args, "critic", refs)
    ddp, capture = wrapped(critic_module(config_of(role_args, cp)), state, LR)
    ddp.role = "critic"  # slime's initialize_model_and_optimizer: model[0].role = role
    actor.model, actor.optimizer, actor.opt_param_scheduler = [ddp], capture, capture
    logged = logged_during(lambda: MegatronTrainRayActor.train_critic(actor, 0, rollout_data))
    return [m["train/critic-value_loss"] for m in logged], capture, list(rollout_data["num_microbatches"])


def samples(model, make_samples) -> tuple:
    """``(samples, clean)`` as the actor's (same responses, masks, rewards, the inactive and the removed
    sample) with :data:`PROMPT_LENGTHS`: slime 624b824's PPO adds each reward to CP rank 0's last
    local response prediction, which is the sample's last one only when CP rank 0 holds it (zig-zag
    chunks of ``ceil(T/4)`` at CP 2, rank 0 the first and the last: ``T - 2 >= 3 ceil(T/4)``); elsewhere
    slime raises IndexError (no response prediction on rank 0) or puts the reward on another token
    (THUDM/slime#2375, open). The value loss's aggregation, what is tested here, is not involved."""
    out = make_samples(model, prompt_lengths=PROMPT_LENGTHS), make_samples(
        model, remove=False, inactive=False, prompt_lengths=PROMPT_LENGTHS)
    for sample in out[0]:
        total = len(sample.tokens)
        if total - 2 < 3 * -(-total // 4):
            raise ValueError(f"sample {sample.index}: total length {total} puts its last response prediction "
                             "off CP rank 0 at CP 2 (slime's PPO reward placement); change PROMPT_LENGTHS")
    return out


# ---------------------------------------------------------------- the float64 reference
def _returns(sample, old, _numerator):
    """slime's GAE returns ``A_t + V_old_t`` over every response token (:func:`_gae`)."""
    return _gae(sample.reward, old)


def _gae(reward: float, old):
    """GAE returns ``A_t + V_old_t``: reward at the last response token, ``V_old`` 0 past the end."""
    import torch

    out, advantage = torch.zeros_like(old), 0.0
    for t in reversed(range(len(old))):
        following = old[t + 1] if t + 1 < len(old) else 0.0
        delta = (reward if t == len(old) - 1 else 0.0) + GAMMA * following - old[t]
        advantage = delta + GAMMA * LAMBD * advantage
        out[t] = advantage + old[t]
    return out


# ---------------------------------------------------------------- the cases
def critic_runs(modes: dict, splits: dict, samples, clean) -> list:
    """``(name, extra, overrides, data, mode, divisor, plugin)`` of every critic case of a layout."""
    plugin = dict(custom_convert_samples_to_train_data_path=PLUGIN_HOOK)
    runs = [(f"critic-{mode}-{split}", dict(plugin, pg_agg_mode=mode, pg_agg_divisor=div, **kw), None, samples,
             mode, div, True)
            for mode, div in modes.items() for split, kw in splits.items()]
    for split, kw in splits.items():  # controls: slime's stock value loss (per-sample mean), the plug-in off
        runs.append((f"stock-critic-clean-{split}", dict(kw), None, clean, "seq_mean", None, False))
        runs.append((f"stock-critic-{split}", dict(kw), None, samples, "seq_mean", None, False))
    # a critic role overriding --global-batch-size: slime's loss divides by the rollout manager's step size
    runs.append(("critic-seq_mean-gbs-override", dict(plugin, pg_agg_mode="seq_mean", **splits["dynamic"]),
                 {"global_batch_size": 2 * GBS}, samples, "seq_mean", None, True))
    # a critic role turning --calculate-per-token-loss on: refused by the hook before anything trains
    runs.append(("refused-critic-per-token-loss", dict(plugin, pg_agg_mode="seq_mean", **splits["static1"]),
                 {"calculate_per_token_loss": True}, samples, "seq_mean", None, True))
    return runs


def run_critic(run, state, cp: int, rank: int) -> dict:
    """One critic case's result row (``refused``: the hook's message)."""
    from megatron_pg_agg.integrations.slime.weights import SlimeConfigError

    _name, extra, overrides, data, mode, div, plugin = run
    args, role_args = critic_args(extra, overrides)
    try:
        losses, capture, num_mb = run_critic_case(args, role_args, data, state, cp)
    except SlimeConfigError as error:
        return {"refused": str(error)}
    refs = (shared.critic_reference_steps(data, state, capture.weights, mode, div, plugin, _returns)
            if rank == 0 else None)
    steps = []
    for s, (loss, grad) in enumerate(zip(losses, capture.grads)):
        row = {"objective": loss, "increment": capture.increments[s]}
        if rank == 0:
            ref_j, ref_g, clipped, tokens, active = refs[s]
            row.update(reference=ref_j, grad_error=float((grad - ref_g).norm() / ref_g.norm()),
                       clipped=clipped, tokens=tokens, active=active)
        steps.append(row)
    return {"steps": steps, "num_microbatches": num_mb}
