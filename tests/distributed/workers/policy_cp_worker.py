"""Sequence-level policy losses under context parallelism, on 2 gloo ranks (one CP group).

    torchrun --standalone --nproc_per_node 2 -m tests.distributed.workers.policy_cp_worker OUT.json

A per-token language model (logits_t depend on token_t only) makes a CP shard compute exactly
what the whole sequence computes, so the loss side is isolated: for each policy loss and mode,
the step planned with CP=2 (each rank its chunks r and 2cp-1-r of every sequence, Megatron's
layout) through ``pg_loss_func`` with the CP group must give the unsharded step's objective and
gradients. Also counted: ``torch.distributed`` calls per microbatch inside the loss (one CP
all-reduce for gspo/gmpo, none for ppo/cispo), and a control that skips the CP reduction (each
rank's partial statistic), which must differ for gspo and gmpo. Rank 0 writes the rows.
"""
from __future__ import annotations

import json
import random
import sys

import torch
import torch.distributed as dist

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.data.rollouts import Rollout
from megatron_pg_agg.megatron.loss_func import pg_loss_func
from megatron_pg_agg.parity.models import PerTokenLM

VOCAB = 32
MODES = {"seq_mean": {}, "token_mean": {}, "prompt_mean": {}, "constant": {"divisor": 16.0}}
POLICIES = ("ppo", "gspo", "gmpo", "cispo")


def rollouts(seed: int = 3) -> list:
    rng = random.Random(seed)
    out = []
    for g, size in enumerate((3, 1, 2, 2)):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 5))]
        for _ in range(size):
            length = rng.randint(3, 13)  # odd and even: padding to 2 x CP
            mask = [int(rng.random() > 0.1) for _ in range(length)]
            adv = rng.uniform(-1, 1)
            old = [-rng.uniform(2.5, 4.0) for _ in range(length)]
            out.append(Rollout(prompt_ids=prompt, response_ids=[rng.randrange(VOCAB) for _ in range(length)],
                               loss_mask=mask, advantages=[adv] * length, old_logprobs=old,
                               numerator_mask=[m if rng.random() > 0.15 else 0 for m in mask], group_id=g))
    return out


class Counter:
    """Counts torch.distributed collectives issued while active (the loss calls them by module)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")

    def __init__(self):
        self.calls, self.saved = [], {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(dist, name)
            self.saved[name] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls.append(_name)
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def run_step(model, plan, cfg, cp_group):
    """Summed (loss, count) over this rank's microbatches; gradients left in the model."""
    model.zero_grad()
    loss_total, count_total = torch.zeros(()), torch.zeros((), dtype=torch.int64)
    with Counter() as counter:
        for mb in plan.for_rank(0):
            logits = model(mb.tokens)
            loss, count, _ = pg_loss_func(mb, cfg, plan.totals, None, logits, cp_group=cp_group)
            loss_total = loss_total + loss
            count_total = count_total + count
    loss_total.backward()
    return loss_total.detach(), count_total, counter.calls


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cp_group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    model = PerTokenLM(None, VOCAB)
    data = rollouts()
    rows = []
    for policy in POLICIES:
        for mode, extra in MODES.items():
            cfg = PGLossConfig(mode=mode, policy_loss=policy, clip_eps_low=0.2, clip_eps_high=0.28,
                               report_entropy=False, **extra)
            whole = plan_step(data, cfg, PlanConfig(num_microbatches=2))
            ref_loss, ref_count, _ = run_step(model, whole, cfg, None)
            ref_grads = [p.grad.clone() for p in model.parameters()]
            sharded = plan_step(data, cfg, PlanConfig(num_microbatches=2, cp_size=world), cp_rank=rank)
            loss, count, calls = run_step(model, sharded, cfg, cp_group)
            grads = [p.grad.clone() for p in model.parameters()]
            totals = torch.stack([loss.double(), count.double()])
            dist.all_reduce(totals)
            for g in grads:
                dist.all_reduce(g)
            objective = float(totals[0] / totals[1])
            grad_err = max(float((g - r).abs().max() / r.abs().max().clamp(min=1e-12))
                           for g, r in zip(grads, ref_grads))
            row = dict(policy=policy, mode=mode, reference=float(ref_loss / ref_count), objective=objective,
                       grad_relerr=grad_err, microbatches=len(sharded.for_rank(0)), calls=calls,
                       weight=int(totals[1]), reference_weight=int(ref_count))
            if cfg.needs_sequence_statistic:  # control: each rank's own partial statistic
                c_loss, c_count, _ = run_step(model, sharded, cfg, None)
                c_totals = torch.stack([c_loss.double(), c_count.double()])
                dist.all_reduce(c_totals)
                row["control_objective"] = float(c_totals[0] / c_totals[1])
            rows.append(row)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
