"""What the parity check runs: the tolerances, the built-in step, the loss settings and the cases
(a parallel layout, or a negative control that must break parity)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

from megatron_pg_agg.core.losses import POLICY_LOSSES, PGLossConfig
from megatron_pg_agg.core.modes import MODES
from megatron_pg_agg.data.rollouts import Rollout
from megatron_pg_agg.megatron.layout import ParallelSizes

OBJECTIVE_RTOL = 1e-6
"""Largest relative error of the logged objective against the reference."""
GRAD_RTOL = 1e-5
"""Largest ``max |grad - ref| / max |ref|`` of any parameter."""
VOCAB = 64
MAX_SEQ_LEN = 64
NUM_LAYERS = 4
CONSTANT_DIVISOR = 16.0
MOE_EXPERTS, MOE_TOPK, MOE_AUX_COEFF, MOE_Z_COEFF = 4, 2, 0.01, 1e-3
MTP_LAYERS, MTP_FACTOR = 2, 0.3

__all__ = ["CONSTANT_DIVISOR", "DEFAULT_CASES", "GRAD_RTOL", "MODES", "OBJECTIVE_RTOL", "POLICY_LOSSES",
           "ParityCase", "VOCAB", "loss_config", "parity_rollouts"]


@dataclass(frozen=True)
class ParityCase:
    """One row group of the parity table: a parallel layout of the step (or a negative control),
    run for every selected mode and policy loss."""

    name: str
    """Label in the table."""
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None = not interleaved."""
    cp: int = 1
    """Context-parallel size (with the per-token model: CP attention needs TE)."""
    dp: int = 1
    """Data-parallel size; the world size is tp * pp * cp * dp."""
    num_microbatches: int = 1
    """Microbatches per DP rank (unless ``max_tokens`` is set)."""
    max_tokens: Optional[int] = None
    """Capacity of one microbatch in padded tokens: the planner then chooses the microbatch count
    (the fuzzer draws it); None: ``num_microbatches``."""
    per_token_model: bool = False
    """Use PerTokenLM instead of GPTModel (required for cp > 1 on CPU)."""
    experts: int = 0
    """MoE: experts per layer (top-2, router aux 0.01 and z 1e-3 losses on, ``moe_aux_loss``
    patch applied); 0 = dense. The reference has the same experts and no router losses; the
    layout's PG gradient is its total gradient minus the router losses' own gradient (an aux-only
    run of the same plan: advantages 0, KL and entropy off), whose strength tests/distributed/test_moe.py
    checks against Megatron's default averaging."""
    ep: int = 1
    """Expert-parallel size (carved out of the DP ranks)."""
    dispatcher: str = "alltoall"
    """MoE token dispatcher: 'alltoall' or 'allgather'."""
    mtp: bool = False
    """Multi-token prediction: a ``MTP_LAYERS``-depth MTP block (factor ``MTP_FACTOR``, the
    ``mtp_loss`` patch applied; megatron-core 0.16+). As for MoE, the layout's PG gradient is its
    total gradient minus an MTP-only run's (advantages 0, KL and entropy off), checked against
    the PG reference; the MTP-only gradient itself is checked against the MTP reference (every
    response forwarded alone through Megatron's MTP block, scaled by 1 / D)."""
    policy_losses: Optional[tuple] = None
    """Policy losses the case runs with (None: every selected one)."""
    control: Optional[str] = None
    """Negative control: 'megatron_default_averaging' (calculate_per_token_loss=False),
    'per_microbatch_weights' (weights computed inside each rank's microbatch, not per step) or
    'no_cp_statistic_reduction' (gspo/gmpo's sequence statistic from each CP rank's own tokens)."""
    control_modes: Optional[tuple] = None
    """Modes a control runs in (a control is only meaningful where it must change the result)."""
    control_policy_losses: tuple = ("ppo",)
    """Policy losses a control runs with."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def layout(self) -> ParallelSizes:
        """The case's parallel layout."""
        return ParallelSizes(tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, dp=self.dp)

    @property
    def expect_fail(self) -> bool:
        return self.control is not None

    @property
    def model_kind(self) -> str:
        """Which reference model the case compares with: 'per_token', 'moe', 'mtp' or 'gpt'."""
        return "per_token" if self.per_token_model else "moe" if self.experts else "mtp" if self.mtp else "gpt"

    @property
    def uniform_tokens(self) -> bool:
        """Microbatches padded to one length: the interleaved schedule, and the allgather
        dispatcher under PP (it refuses variable_seq_lengths) or EP (gloo all-gathers need equal
        sizes)."""
        allgather = self.experts and self.dispatcher == "allgather"
        return self.vpp is not None or bool(allgather and (self.pp > 1 or self.ep > 1))

    def runs(self, modes, policy_losses) -> list:
        """``(policy_loss, mode)`` pairs this case runs out of the selected ones."""
        if self.expect_fail:
            policy_losses = [p for p in policy_losses if p in self.control_policy_losses]
            modes = [m for m in modes if self.control_modes is None or m in self.control_modes]
        if self.policy_losses is not None:
            policy_losses = [p for p in policy_losses if p in self.policy_losses]
        return [(p, m) for p in policy_losses for m in modes]


DEFAULT_CASES = (
    ParityCase("DP=2, 3 mb", dp=2, num_microbatches=3),
    ParityCase("TP=2, 3 mb", tp=2, num_microbatches=3),
    ParityCase("PP=2 (1F1B), 3 mb", pp=2, num_microbatches=3),
    ParityCase("PP=2 interleaved (2 virtual), 4 mb", pp=2, vpp=2, num_microbatches=4),
    ParityCase("1 mb (TP=2)", tp=2, num_microbatches=1),
    ParityCase("8 mb (PP=2)", pp=2, num_microbatches=8),
    ParityCase("DP=2 x PP=2, 3 mb", dp=2, pp=2, num_microbatches=3),
    ParityCase("TP=2 x PP=2, 3 mb", tp=2, pp=2, num_microbatches=3),
    ParityCase("TP=2 x DP=2, 2 mb", tp=2, dp=2, num_microbatches=2),
    ParityCase("CP=2 x DP=2 (per-token model), 2 mb", cp=2, dp=2, num_microbatches=2, per_token_model=True),
    ParityCase("MoE DP=2 x EP=2 (alltoall), 3 mb", dp=2, ep=2, experts=MOE_EXPERTS, num_microbatches=3),
    ParityCase("MoE DP=2 (allgather), 3 mb", dp=2, experts=MOE_EXPERTS, dispatcher="allgather",
               num_microbatches=3),
    ParityCase("MoE PP=2 (1F1B), 3 mb", pp=2, experts=MOE_EXPERTS, num_microbatches=3),
    # the MTP term does not depend on the policy loss: ppo rows only
    ParityCase("MTP DP=2, 3 mb", dp=2, num_microbatches=3, mtp=True, policy_losses=("ppo",)),
    ParityCase("MTP TP=2, 3 mb", tp=2, num_microbatches=3, mtp=True, policy_losses=("ppo",)),
    ParityCase("MTP PP=2 (1F1B), 3 mb", pp=2, num_microbatches=3, mtp=True, policy_losses=("ppo",)),
    ParityCase("control: Megatron default averaging, DP=2, 3 mb", dp=2, num_microbatches=3,
               control="megatron_default_averaging", control_modes=("token_mean",)),
    ParityCase("control: per-microbatch weights, DP=2, 3 mb", dp=2, num_microbatches=3,
               control="per_microbatch_weights", control_modes=("prompt_mean",)),
    ParityCase("control: per-microbatch weights, CP=2 x DP=2", cp=2, dp=2, num_microbatches=2,
               per_token_model=True, control="per_microbatch_weights", control_modes=("seq_mean",)),
    ParityCase("control: GSPO statistic without the CP all-reduce, CP=2 x DP=2", cp=2, dp=2,
               num_microbatches=2, per_token_model=True, control="no_cp_statistic_reduction",
               control_modes=("seq_mean",), control_policy_losses=("gspo",)),
)


def loss_config(mode: str, policy_loss: str = "ppo") -> PGLossConfig:
    """The loss settings of every parity row: DAPO-style asymmetric clips, KL (k3) and entropy on;
    the dual clip with the ppo surrogate only (the other policy losses refuse it)."""
    return PGLossConfig(
        mode=mode, divisor=CONSTANT_DIVISOR if mode == "constant" else None,
        clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0 if policy_loss == "ppo" else None,
        kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01, policy_loss=policy_loss,
    )


def parity_rollouts(seed: int = 7, with_ref: bool = True) -> list:
    """The built-in step: ragged prompt groups (3, 1, 2, 4, 2), one response with no valid
    token, filtered numerator tokens, 3..21 tokens per sequence, groups interleaved in input order
    (so microbatches and ranks get different token counts and the planner must regroup).
    Advantages vary a little within a response (so a loss that should use them per token cannot
    pass by using one per sequence), and old log-probs are far from the model's (so the clips are
    active)."""
    rng = random.Random(seed)
    rollouts, seq = [], 0
    for g, size in enumerate((3, 1, 2, 4, 2)):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        for _ in range(size):
            n = rng.randint(1, 15)
            mask = [0] * n if seq == 4 else [1 if rng.random() > 0.15 else 0 for _ in range(n)]
            adv = rng.uniform(-1.5, 1.5)
            rollouts.append(Rollout(
                prompt_ids=prompt,
                response_ids=[rng.randrange(VOCAB) for _ in range(n)],
                loss_mask=mask,
                advantages=[adv + rng.uniform(-0.1, 0.1) for _ in range(n)],
                old_logprobs=[-rng.uniform(3.0, 5.5) for _ in range(n)],
                ref_logprobs=[-rng.uniform(3.0, 5.5) for _ in range(n)] if with_ref else None,
                group_id=f"prompt-{g}",
                numerator_mask=[m if rng.random() > 0.2 else 0 for m in mask],
            ))
            seq += 1
    rng.shuffle(rollouts)
    return rollouts
