"""Online GRPO through the trainer: sample from the live policy, score, build group advantages,
train with the trainer's own step (planner, step runner, loss provider, megatron-core's schedule
and optimizer).

One RL step (:meth:`OnlineRun.rl_step`):

1. every rank draws the same ``prompts_per_step`` targets (seeded by ``(seed, step)``: the same
   prompts for every variant of a seed);
2. each DP rank samples ``group_size`` responses for its share of the prompts from the current
   weights (:func:`~megatron_pg_agg.online.sampler.sample_responses`, seeded by
   ``(seed, step, dp_rank)``), recording the behaviour log-probs;
3. the samples are gathered over DP, so every rank holds the whole step (the planner cuts it);
4. the verifier scores them; advantages are group-relative (:func:`group_advantages`);
5. ``updates_per_batch`` optimizer steps on that batch, each the trainer's
   :func:`~megatron_pg_agg.training.trainer.train_step`: PPO-clip against the behaviour log-probs,
   aggregated by the run's ``--pg-loss-aggregation`` mode. Nothing here computes a loss.

The warm start (:meth:`OnlineRun.warm_up`) is supervised learning on the task's demonstrations
through the same step: advantage 1 on every token, ``token_mean``, and old log-probs recomputed
from the current weights before each update (``train_step(..., recompute_old_logprobs=True)``),
so the PPO ratio is 1 and the gradient is that of the mean token log-likelihood.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from typing import Optional

import torch
from megatron.core import parallel_state

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.plan_ahead import PlanAhead
from megatron_pg_agg.data.reach import EOS, ReachTask
from megatron_pg_agg.data.rollouts import Rollout, RolloutBatch
from megatron_pg_agg.integrations.step_weights import gather_over_dp
from megatron_pg_agg.megatron.logprob_pass import planned_logprobs
from megatron_pg_agg.megatron.model import gather_parameters
from megatron_pg_agg.training.run_config import OnlineConfig
from megatron_pg_agg.training.trainer import RunState, Session, _iteration_planner, new_optimizer, train_step

from .sampler import sample_responses

__all__ = ["OnlineRun", "group_advantages", "step_batch"]

logger = logging.getLogger(__name__)

STD_EPS = 1e-6
"""GRPO's ``eps`` in ``(r - mean) / (std + eps)``."""


def group_advantages(rewards: torch.Tensor, group_size: int, *, divide_by_std: bool) -> torch.Tensor:
    """GRPO's outcome advantage per response: ``r_i - mean_g(r)``, divided by ``std_g(r) + eps``
    (the unbiased std, as GRPO and verl) when ``divide_by_std``. ``rewards``: ``[G * group_size]``,
    groups contiguous."""
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if divide_by_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + STD_EPS)
    return centred.reshape(-1).float()


def step_batch(task: ReachTask, targets: list, responses: list, logprobs: list, advantages: torch.Tensor,
               group_size: int, vocab_size: Optional[int] = None) -> RolloutBatch:
    """The step's rollouts: response ``i`` answers ``targets[i // group_size]``, every token
    trained (``loss_mask`` 1), its advantage broadcast over the tokens, its behaviour log-probs
    as ``old_logprobs``. Token ids are checked below ``vocab_size`` (the model's; default: the
    task's), as a sampled token may be any id of the model's vocabulary."""
    rollouts = [Rollout(prompt_ids=task.prompt(targets[i // group_size]), response_ids=resp,
                        loss_mask=[1] * len(resp), advantages=[float(advantages[i])] * len(resp),
                        old_logprobs=lp, group_id=i // group_size)
                for i, (resp, lp) in enumerate(zip(responses, logprobs))]
    return RolloutBatch.from_rollouts(rollouts, vocab_size=vocab_size or task.vocab_size)


def _seeded(*parts: int) -> int:
    """A 63-bit seed from integers (stable across processes, unlike ``hash`` of a tuple)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value * 6364136223846793005 + part + 1442695040888963407) % (1 << 63)
    return value


class OnlineRun:
    """The trainer's :class:`~megatron_pg_agg.training.trainer.Session` driven online.

    ``session``: from :func:`~megatron_pg_agg.training.trainer.setup` with an empty step set; its
    model is trained in place, its optimizer and iteration counter (a resumed run's) are kept until
    :meth:`reset`, which puts back given weights and a fresh optimizer, so several variants run
    from the same checkpoint in one process."""

    def __init__(self, session: Session, task: ReachTask):
        self.s, self.task = session, task
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self._plan_online()

    # ------------------------------------------------------------------ weights and optimizer
    def snapshot(self) -> list:
        """A copy of this rank's parameters (to :meth:`reset` to)."""
        return [p.detach().clone() for p in self._parameters()]

    def _parameters(self):
        return (p for chunk in self.s.model for p in chunk.parameters())

    def reset(self, weights: Optional[list], loss: PGLossConfig, lr: float) -> None:
        """Parameters from ``weights`` (None: keep), a fresh Adam at ``lr``, the loss ``loss`` and
        iteration 0: a new run on the same process groups and model (and the same run id, which
        the session's metrics records carry)."""
        if weights is not None:
            with torch.no_grad():
                for p, w in zip(self._parameters(), weights):
                    p.copy_(w)
        cfg = self.s.cfg
        cfg = dataclasses.replace(cfg, loss=loss, training=dataclasses.replace(cfg.training, lr=lr))
        self.s = dataclasses.replace(self.s, cfg=cfg, optimizer=new_optimizer(cfg, self.s.model),
                                     state=RunState(run_id=self.s.state.run_id))
        self._plan_online()

    def _plan_online(self) -> None:
        """The session's plans from here: iteration k's rollouts come from the weights iteration
        k - 1 left, so nothing is planned ahead; each iteration is planned when it comes, from the
        batch of the moment (:meth:`_set_batch`), once for all its updates."""
        self.s.plans.close()
        steps: dict = {}
        self.s = dataclasses.replace(
            self.s, steps=steps,
            plans=PlanAhead(_iteration_planner(self.s.cfg, self.s.plan_cfg, steps, 0),
                            itertools.count(self.s.state.iteration), enabled=False))

    # ------------------------------------------------------------------ warm-up
    def warm_up(self, cfg: OnlineConfig, seed: int, weights: Optional[list] = None) -> dict:
        """Supervised warm-up on fresh demonstrations drawn under ``seed`` (module docstring), from
        ``weights`` (None: the current ones); returns the last step's record."""
        self.reset(weights, PGLossConfig(mode="token_mean"), cfg.warmup_lr)
        rng = random.Random(_seeded(seed, 1))
        record: dict = {}
        for step in range(cfg.warmup_steps):
            targets = self.task.targets(cfg.warmup_batch, rng)
            demos = [self.task.demonstration(t, rng) for t in targets]
            batch = step_batch(self.task, targets, demos, [[0.0] * len(d) for d in demos],
                               torch.ones(len(demos)), 1)
            record = self._train(batch, step, recompute_old_logprobs=True)
        return record

    # ------------------------------------------------------------------ RL
    def rl_step(self, cfg: OnlineConfig, seed: int, step: int, *, check_on_policy: bool = False) -> dict:
        """Sample, score and train on one batch (module docstring); returns the step's record.

        ``check_on_policy``: the record also holds ``on_policy_error``, the largest
        ``|log p_trainer - log p_behaviour|`` over the step's tokens before its first update (the
        trainer's log-probs from a forward-only pass over the very microbatches it trains on), and
        ``moved_error``, the same after the step's updates (a control: it must be well above the
        first once the weights have moved)."""
        t0 = time.perf_counter()
        stats, updates, checks, sample_s = self._rl_updates(cfg, seed, step, check_on_policy=check_on_policy)
        return {"step": step, **stats,
                "objective": updates[0]["objective"], "ratio_first": updates[0].get("ratio"),
                "grad_norm": updates[0]["grad_norm"], "clip_fraction_last": updates[-1].get("clip_fraction"),
                **checks, "sample_s": sample_s, "step_s": time.perf_counter() - t0}

    def iteration(self, cfg: OnlineConfig, seed: int) -> dict:
        """The main job's iteration (``launch/train_actor.py`` online): RL step
        ``s.state.iteration`` of ``seed`` (:meth:`rl_step`'s sampling, scoring and updates). The
        record is the trainer's record of the batch's last update (its ``iteration`` the number of
        batches done) with ``objective_first`` (the on-policy update's), what was sampled
        (``accuracy``, ``response_length``, :func:`response_stats`), ``sample_s`` and
        ``iteration_s`` (sampling and every update)."""
        t0 = time.perf_counter()
        step = self.s.state.iteration
        stats, updates, _, sample_s = self._rl_updates(cfg, seed, step)
        return {**updates[-1], "rollout_step": step, "objective_first": updates[0]["objective"], **stats,
                "sample_s": sample_s, "iteration_s": time.perf_counter() - t0}

    def _rl_updates(self, cfg: OnlineConfig, seed: int, step: int, *, check_on_policy: bool = False) -> tuple:
        """RL step ``step``: ``(response stats, the updates' trainer records, on-policy checks,
        sampling seconds)``. The ``updates_per_batch`` updates train one plan of the batch; the
        iteration counter advances once, with the last."""
        t0 = time.perf_counter()
        targets, responses, logprobs = self._sample(cfg, (seed, 2, step), (seed, 3, step))
        sample_s = time.perf_counter() - t0
        group_targets = [t for t in targets for _ in range(cfg.group_size)]
        rewards = self.task.scores(group_targets, responses)
        advantages = group_advantages(rewards, cfg.group_size, divide_by_std=cfg.advantage_std)
        batch = step_batch(self.task, targets, responses, logprobs, advantages, cfg.group_size,
                           vocab_size=self.s.cfg.model.vocab_size)
        self._set_batch(batch, step)
        checks = {}
        if check_on_policy:
            plan = self.s.plans.get(self.s.state.iteration)  # the plan the updates then train on
            checks["on_policy_error"] = self._logprob_error(plan)
        updates = [train_step(self.s, advance=u == cfg.updates_per_batch - 1) for u in range(cfg.updates_per_batch)]
        if check_on_policy:
            checks["moved_error"] = self._logprob_error(plan)
        return response_stats(rewards, responses, self.task), updates, checks, sample_s

    def evaluate(self, cfg: OnlineConfig, seed: int) -> dict:
        """:func:`response_stats` of one step's worth of samples from the current weights, on
        prompts and draws of their own (nothing is trained): the warm start's accuracy."""
        targets, responses, _ = self._sample(cfg, (seed, 4), (seed, 5))
        rewards = self.task.scores([t for t in targets for _ in range(cfg.group_size)], responses)
        return response_stats(rewards, responses, self.task)

    def _sample(self, cfg: OnlineConfig, prompt_seed: tuple, draw_seed: tuple) -> tuple:
        """``(targets, responses, behaviour log-probs)`` of a whole step, on every rank: the same
        ``prompts_per_step`` targets everywhere (seeded by ``prompt_seed``), each DP rank sampling
        ``group_size`` responses for its share (seeded by ``draw_seed`` and the DP rank), gathered
        over DP in rank order; response ``i`` answers ``targets[i // group_size]``."""
        targets = self.task.targets(cfg.prompts_per_step, random.Random(_seeded(*prompt_seed)))
        mine = slice(self.dp_rank * cfg.prompts_per_step // self.dp_size,
                     (self.dp_rank + 1) * cfg.prompts_per_step // self.dp_size)
        prompts = torch.tensor([self.task.prompt(t) for t in targets[mine] for _ in range(cfg.group_size)])
        generator = torch.Generator().manual_seed(_seeded(*draw_seed, self.dp_rank))
        # --overlap-param-gather: the gather is a collective that the first forward after an update
        # would start, and each rank's sampler runs its own number of forwards; gathered here, every
        # rank at once, the sampler's forwards start none
        gather_parameters(self.s.model)
        samples = sample_responses(self.s.model[0], prompts, max_new_tokens=self.task.max_response_tokens,
                                   eos=EOS, generator=generator)
        local = ([samples.response(i) for i in range(len(prompts))],
                 [samples.response_logprobs(i) for i in range(len(prompts))])
        gathered, _ = gather_over_dp(local, self.dp_group)
        return (targets, [r for part in gathered for r in part[0]], [lp for part in gathered for lp in part[1]])

    def _logprob_error(self, plan) -> float:
        """``max |log p - old_logprobs|`` over the scored tokens of every DP rank's microbatches of
        ``plan``, the log-probs from the current weights (one forward-only pass)."""
        mine = plan.for_rank(self.dp_rank)
        current = planned_logprobs(self.s.model, mine, tp_group=self.s.groups.tensor, device=self.s.device)
        worst = torch.zeros((), dtype=torch.float64)
        for mb, lp in zip(mine, current):
            gap = torch.where(mb.denominator_mask, (lp.double() - mb.old_logprobs.double()).abs(),
                              torch.zeros((), dtype=torch.float64))
            worst = torch.maximum(worst, gap.max())
        torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX, group=self.dp_group)
        return float(worst)

    def _set_batch(self, batch: RolloutBatch, key: int) -> None:
        """``batch`` becomes the session's only rollout step (the next iterations plan it)."""
        self.s.steps.clear()
        self.s.steps[key] = batch

    def _train(self, batch: RolloutBatch, key: int, *, recompute_old_logprobs: bool = False) -> dict:
        """One trainer step on ``batch`` (rollout step ``key``)."""
        self._set_batch(batch, key)
        return train_step(self.s, recompute_old_logprobs=recompute_old_logprobs)


def response_stats(rewards: torch.Tensor, responses: list, task: ReachTask) -> dict:
    """Accuracy, mean length of correct and of incorrect responses (tokens, EOS included; NaN
    when there are none), and the truncated fraction (no EOS within ``max_response_tokens``)."""
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.float64)
    correct = rewards > 0.5
    truncated = torch.tensor([not r or r[-1] != EOS for r in responses])

    def mean_where(mask):
        return float(lengths[mask].mean()) if bool(mask.any()) else float("nan")

    return {"accuracy": float(correct.double().mean()), "response_length": float(lengths.mean()),
            "length_correct": mean_where(correct), "length_incorrect": mean_where(~correct),
            "truncated": float(truncated.double().mean()), "responses": len(responses)}
