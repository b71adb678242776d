"""The rollout steps of a run, planned per iteration on the host, as the data iterator of a loop
that owns the schedule (Megatron-LM's ``pretrain()`` and RL loop, Megatron-Bridge's ``pretrain``).

Each item is one THD microbatch with its step's host totals (the step weights were computed once
on the whole step, before the split), so the forward step needs nothing else."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..core.losses import StepTotals
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
    ``i`` trains on ``steps[keys[i mod S]]``."""

    def __init__(self, steps: dict, loss_cfg, plan_cfg, *, dp_rank: int, cp_rank: int, pin: bool = False):
        self.steps, self.keys = steps, sorted(steps)
        self.pin = pin  # CUDA: page-locked microbatches, so the forward step's copies are async
        self.loss_cfg, self.plan_cfg = loss_cfg, plan_cfg
        self.dp_rank, self.cp_rank = dp_rank, cp_rank
        self._plans: dict = {}

    def step_key(self, iteration: int):
        return self.keys[iteration % len(self.keys)]

    def plan(self, iteration: int):
        """The plan of ``iteration`` (each rollout step is planned once and kept)."""
        key = self.step_key(iteration)
        if key not in self._plans:
            plan = plan_step(self.steps[key], self.loss_cfg, self.plan_cfg, cp_rank=self.cp_rank)
            if self.pin:
                plan.microbatches = [[mb.pin_memory() for mb in row] for row in plan.microbatches]
            self._plans[key] = plan
        return self._plans[key]

    def problems(self) -> list:
        """Plan every step once (vocabulary, capacity, microbatch count), listing each failure."""
        found = []
        for i, key in enumerate(self.keys):
            try:
                self.plan(i)
            except PlanError as err:
                found.append(f"rollout step {key}: {err}")
        return found

    def microbatches(self, start_iteration: int) -> Iterator[PlannedMicrobatch]:
        """This rank's microbatches, iteration after iteration, from ``start_iteration`` on."""
        iteration = start_iteration
        while True:
            plan = self.plan(iteration)
            for mb in plan.for_rank(self.dp_rank):
                yield PlannedMicrobatch(mb, plan.totals, iteration)
            iteration += 1
