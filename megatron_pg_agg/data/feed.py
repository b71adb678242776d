"""The rollout steps of a run, planned per iteration on the host, as the data iterator of a loop
that owns the schedule (Megatron-LM's ``pretrain()`` and RL loop, Megatron-Bridge's ``pretrain``).

Each item is one THD microbatch with its step's host totals (the step weights were computed once
on the whole step, before the split), so the forward step needs nothing else.

When each step is planned: :meth:`RolloutFeed.problems` (the entries' start-up check) plans every
rollout step once, before the first iteration. Without plan-ahead those plans are kept and every
iteration reads them (no planning on the loop's path; memory: every rollout step's plan, pinned on
CUDA). With plan-ahead (``plan_ahead=True``; the Megatron-LM entry's default, ``--pg-plan-ahead``)
the start-up check keeps none of them: iteration ``i``'s plan is built on a background thread while
iteration ``i - 1`` runs (:class:`~megatron_pg_agg.data.plan_ahead.PlanAhead`), so at most the
current and the next plan are held, whatever the number of rollout steps."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from ..core.losses import StepTotals
from .plan_ahead import PlanAhead
from .planner import Microbatch, plan_step
from .rollouts import PlanError

__all__ = ["PlannedMicrobatch", "RolloutFeed"]


@dataclass(frozen=True)
class PlannedMicrobatch:
    """One item of the data iterator: a THD microbatch and its step's host totals."""

    microbatch: Microbatch
    totals: StepTotals
    iteration: int
    """0-based iteration (optimizer step) the microbatch belongs to."""


class RolloutFeed:
    """The rollout steps of a run, planned per iteration on the host (identically on every rank).

    ``steps`` maps a step key to its :class:`~megatron_pg_agg.data.rollouts.RolloutBatch`; iteration
    ``i`` trains on ``steps[keys[i mod S]]``. ``plan_ahead``: plan the next iteration in the
    background and keep only the current and the next plan (the module docstring);
    ``end_iteration``: the iteration the run stops before (nothing is planned from it on; None: no
    end). Call :meth:`close` at the end of the run."""

    def __init__(self, steps: dict, loss_cfg, plan_cfg, *, dp_rank: int, cp_rank: int, pin: bool = False,
                 plan_ahead: bool = False, end_iteration: Optional[int] = None):
        self.steps, self.keys = steps, sorted(steps)
        self.pin = pin  # CUDA: page-locked microbatches, so the forward step's copies are async
        self.loss_cfg, self.plan_cfg = loss_cfg, plan_cfg
        self.dp_rank, self.cp_rank = dp_rank, cp_rank
        self.plan_ahead = plan_ahead
        """Plan iteration ``i + 1`` in the background while ``i`` runs; keep two plans at most."""
        self.end_iteration = end_iteration
        """The run's last iteration + 1 (plan-ahead plans nothing from it on); None: unbounded."""
        self._plans: dict = {}  # without plan-ahead: every rollout step's plan, kept
        self._ahead: Optional[PlanAhead] = None  # with plan-ahead: from the first iteration asked for
        self._device: Optional[int] = None  # with pin: the CUDA device the background plans pin on

    def step_key(self, iteration: int):
        return self.keys[iteration % len(self.keys)]

    def plan_key(self, key):
        """Rollout step ``key`` planned now, in the calling thread (pinned with ``pin``)."""
        plan = plan_step(self.steps[key], self.loss_cfg, self.plan_cfg, cp_rank=self.cp_rank)
        if self.pin:
            plan.microbatches = [[mb.pin_memory() for mb in row] for row in plan.microbatches]
        return plan

    def _plan_iteration(self, iteration: int):
        if self._device is not None:  # a background thread pins on the rank's device, as the loop does
            torch.cuda.set_device(self._device)
        return self.plan_key(self.step_key(iteration))

    def start(self, iteration: int) -> None:
        """With plan-ahead: start planning ``iteration`` (the run's first) in the background, once."""
        if self.plan_ahead and self._ahead is None:
            self._device = torch.cuda.current_device() if self.pin else None
            end = self.end_iteration
            keys = itertools.count(iteration) if end is None else range(iteration, max(end, iteration))
            self._ahead = PlanAhead(self._plan_iteration, keys, name="pg-plan-ahead")

    def plan(self, iteration: int):
        """The plan of ``iteration``. Without plan-ahead each rollout step is planned once and
        kept. With it, iterations come in order from :class:`PlanAhead` (the current one again, or
        the next, whose background plan's error is raised here); any other is planned now, unkept."""
        if self.plan_ahead:
            self.start(iteration)
            if self._ahead.expects(iteration):
                return self._ahead.get(iteration)
            return self._plan_iteration(iteration)
        key = self.step_key(iteration)
        if key not in self._plans:
            self._plans[key] = self.plan_key(key)
        return self._plans[key]

    def problems(self) -> list:
        """Plan every step once (vocabulary, capacity, microbatch count), listing each failure.
        The plans are kept without plan-ahead (every iteration reads them), dropped with it."""
        found = []
        for key in self.keys:
            if key in self._plans:
                continue
            try:
                plan = self.plan_key(key)
            except PlanError as err:
                found.append(f"rollout step {key}: {err}")
                continue
            if not self.plan_ahead:
                self._plans[key] = plan
        return found

    def microbatches(self, start_iteration: int) -> Iterator[PlannedMicrobatch]:
        """This rank's microbatches, iteration after iteration, from ``start_iteration`` on (with
        plan-ahead its plan starts now, in the background)."""
        self.start(start_iteration)
        return self._microbatches(start_iteration)

    def _microbatches(self, iteration: int) -> Iterator[PlannedMicrobatch]:
        while True:
            plan = self.plan(iteration)
            for mb in plan.for_rank(self.dp_rank):
                yield PlannedMicrobatch(mb, plan.totals, iteration)
            iteration += 1

    def close(self) -> None:
        """End plan-ahead (waits for a plan in flight; idempotent) and drop the kept plans."""
        if self._ahead is not None:
            self._ahead.close()
        self._plans.clear()
