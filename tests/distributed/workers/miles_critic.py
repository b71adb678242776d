"""miles' critic with the plug-in: its own ``train_critic`` in megatron-core's schedule, and its float64 reference.

Run by :mod:`tests.distributed.workers.miles_worker` (same launches, layouts, micro-batch splits and
rollout as the actor's cases). Per case, the way miles
trains its critic (``--advantage-estimator ppo``, which sets ``use_critic``): the rollout manager's
conversion and split (the plug-in's hook writes ``rollout_mask_sums``), then on every rank miles'
``get_rollout_data`` and ``MegatronTrainRayActor.train_critic`` itself (on an actor object made without
Ray's start-up): ``get_data_iterator``, ``forward_only(get_values)`` (the old values ``V_old``),
``compute_advantages_and_returns`` (``ppo``: miles' GAE), ``args.loss_type = "value_loss"`` and
``train()`` (``loss_function`` -> ``value_loss_function`` -> ``get_sum_of_sample_mean``,
megatron-core's ``forward_backward_func``, DDP, ``finalize_model_grads``).

The model: the project's ``PerTokenLM`` body under miles' value head ``LinearForLastLayer(hidden, 1)``
(slime_family_cpu.critic_module); the optimizer stand-in steps by SGD between the two steps, so that the
second trains partly in miles' value clip.

The reference (rank 0, float64): slime_family_cpu.critic_reference_steps with miles' GAE written out
(:func:`_returns`): it runs over the trainable tokens only (loss mask 1 after miles' conversion, which
masks a removed sample whole), the reward at the last trainable token, ``V_old`` of the next trainable
token (0 after the last), nothing for a sample without one.
"""
from __future__ import annotations

from tests.distributed.workers import slime_family_cpu as shared
from tests.distributed.workers.miles_worker import (
    PLUGIN_HOOK,
    config_of,
    convert_and_split,
    logged_during,
    miles_args,
    rollout_data_of,
    set_up_layout,
    wrapped,
)
from tests.distributed.workers.slime_family_cpu import GAMMA, LAMBD, LR, MODES, SPLITS, VALUE_CLIP


def _head():
    from miles.backends.megatron_utils.model_provider import LinearForLastLayer

    return LinearForLastLayer


def _returns(sample, old, numerator):
    """miles' GAE returns ``A_t + V_old_t`` (module docstring); 0 at the tokens it does not train."""
    import torch

    out = torch.zeros_like(old)
    trainable = [t for t in range(len(old)) if numerator[t] > 0]
    advantage = 0.0
    for k in reversed(range(len(trainable))):
        t = trainable[k]
        last = k == len(trainable) - 1
        following = 0.0 if last else old[trainable[k + 1]]
        delta = (sample.reward if last else 0.0) + GAMMA * following - old[t]
        advantage = delta + GAMMA * LAMBD * advantage
        out[t] = advantage + old[t]
    return out


class _Heartbeat:
    def bump(self):
        pass


class Critic:
    """The critic's cases of one layout (``run_all``), on the actor's rollout."""

    def __init__(self, model, make_samples):
        self.state = shared.initial_state(_head())
        self.samples = make_samples(model)
        self.clean = make_samples(model, remove=False, inactive=False)

    def runs(self) -> list:
        """``(name, extra, data, mode, divisor, plugin)`` of every critic case."""
        hook = dict(custom_convert_samples_to_train_data_path=PLUGIN_HOOK)
        runs = [(f"critic-{mode}-{split}", dict(hook, pg_agg_mode=mode, pg_agg_divisor=div, **kw), self.samples,
                 mode, div, True) for mode, div in MODES.items() for split, kw in SPLITS.items()]
        for split, kw in SPLITS.items():  # controls: miles' stock value loss, the plug-in off
            runs.append((f"stock-critic-clean-{split}", dict(kw), self.clean, "seq_mean", None, False))
            runs.append((f"stock-critic-{split}", dict(kw), self.samples, "seq_mean", None, False))
        return runs

    def run_case(self, args, samples, cp: int):
        """miles' critic path for one rollout: ``(value losses per step, Capture, num_microbatches)``."""
        from miles.backends.megatron_utils.actor import MegatronTrainRayActor

        refs = convert_and_split(args, samples)
        set_up_layout(args)
        rollout_data = rollout_data_of(args, refs)
        ddp, capture = wrapped(shared.critic_module(config_of(args, cp), _head()), self.state, LR)
        ddp.role = "critic"  # miles' initialize_model_and_optimizer: model[0].role = role
        actor = object.__new__(MegatronTrainRayActor)  # without Ray's start-up: train_critic reads these
        actor.args, actor.role, actor._heartbeat = args, "critic", _Heartbeat()
        actor.model, actor.optimizer, actor.opt_param_scheduler = [ddp], capture, capture
        logged = logged_during(lambda: MegatronTrainRayActor.train_critic(actor, 0, rollout_data))
        return [m["value_loss"] for m in logged], capture

    def run_all(self, cp: int, rank: int) -> dict:
        """``{case: result row}`` of every critic case at this layout."""
        out = {}
        for name, extra, data, mode, div, plugin in self.runs():
            args = miles_args(dict(advantage_estimator="ppo", gamma=GAMMA, lambd=LAMBD, value_clip=VALUE_CLIP,
                                   **extra))
            losses, capture = self.run_case(args, data, cp)
            refs = (shared.critic_reference_steps(data, self.state, capture.weights, mode, div, plugin, _returns)
                    if rank == 0 else None)
            steps = []
            for s, grad in enumerate(capture.grads):
                row = {"objective": losses[s] if rank == 0 else None, "increment": capture.increments[s]}
                if rank == 0:
                    ref_j, ref_g, clipped, tokens, active = refs[s]
                    row.update(reference=ref_j, grad_error=float((grad - ref_g).norm() / ref_g.norm()),
                               clipped=clipped, tokens=tokens, active=active)
                steps.append(row)
            out[name] = {"steps": steps}
        return out
