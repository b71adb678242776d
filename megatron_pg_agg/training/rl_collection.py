"""A rollout collection of Megatron-LM's RL loop, cut into the project's optimizer steps.

Megatron-LM's ``rl_utils.prepare_data_for_update`` flattens a collection's prompt groups into rows,
gives each DP rank a contiguous slice and trains ``--global-batch-size`` rows per optimizer step,
so a group can straddle two steps or two ranks, and nothing downstream knows where a sequence or a
group begins. :class:`CollectionPlanner` takes that function's place (registered through
``patches.megatron_rl.set_collection_planner``) and keeps every part that is Megatron-LM's:

* the group advantages: ``compute_group_stats`` (``(r - mean_g) / (1e-4 + std_g)``), and its stats
  for Megatron-LM's own RL logging;
* the trajectories: ``prepare_trajectories`` (padding, its bos/eod checks) and the position ids of
  ``get_ltor_masks_and_position_ids``;
* the old and reference log-probs in Megatron-LM's row layout (``[N, S-1]``, position ``p - 1`` of
  row ``i`` the log-prob of token ``p``), the reference weights loaded from ``ref_state_dict`` and
  restored. By default (``packed_logprobs``) each pass runs forward-only through Megatron's schedule
  on the planner's packed THD microbatches of the whole collection (the training step's capacity
  and balancing, :func:`packed_logprob_pass`), and the log-probs are laid back into the rows;
  otherwise Megatron-LM's ``compute_logprobs_batch``, one row of ``--seq-length`` per sequence,
  each DP rank a contiguous slice of the rows (as Megatron-LM does), then gathered
  (:func:`make_logprob_pass`);
* the inference log-probs aligned by ``align_unpacked_inference_logprobs`` (and its mismatch stats).

What changes is the step composition. With ``P`` prompts of ``G`` rollouts per collection and
``B = --global-batch-size`` sequences per optimizer step (``B`` a multiple of ``G`` and ``P * G`` a
multiple of ``B``, checked at start-up by :func:`shape_problems`), optimizer step ``k`` of a pass is
groups ``k * B/G .. (k+1) * B/G - 1``, whole; it is planned by
:func:`~megatron_pg_agg.data.planner.plan_step` (the step weights before the split) into THD
microbatches: packed (the default), as many whole sequences per microbatch as its capacity holds
(``--pg-max-tokens-per-microbatch``, default ``--seq-length``), token-balanced across DP ranks and
microbatches, with as few microbatches as the capacity allows (the same count on every DP rank);
or, with ``--no-pg-sequence-packing``, ``B / DP`` microbatches per DP rank of one sequence each.
Either way Megatron-LM's microbatch calculator stays at ``B / DP`` sequences per rank, so its
consumed samples and learning-rate schedule are those of its unpacked path; the schedule alone
runs the planned count (``patches.megatron_rl.set_microbatch_count``). The ``--grpo-iterations``
passes repeat the steps in order with the collection's old log-probs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from megatron_pg_agg.core.context_parallel import cp_partition_index
from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.core.segments import segment_ids
from megatron_pg_agg.data.plan_ahead import PlanAhead
from megatron_pg_agg.data.planner import PlanConfig, StepPlan, plan_step
from megatron_pg_agg.data.rollouts import RolloutBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollectionShape:
    """How one collection becomes optimizer steps (Megatron-LM's flags; host integers)."""

    prompts: int
    """``--grpo-prompts-per-step``: prompt groups per collection."""
    group_size: int
    """``--grpo-group-size``: rollouts per group."""
    global_batch: int
    """``--global-batch-size``: sequences per optimizer step."""
    passes: int
    """``--grpo-iterations``: passes over each collection."""

    @property
    def groups_per_step(self) -> int:
        return self.global_batch // self.group_size

    @property
    def steps(self) -> int:
        """Optimizer steps per pass."""
        return self.prompts * self.group_size // self.global_batch


def shape_problems(shape: CollectionShape) -> list:
    """Why a collection of this shape would cut a prompt group across optimizer steps (empty: none)."""
    p, g, b = shape.prompts, shape.group_size, shape.global_batch
    problems = []
    if b % g:
        whole = [m for m in (b - b % g, b - b % g + g) if m > 0]
        problems.append(
            f"--global-batch-size {b} is not a multiple of --grpo-group-size {g}: an optimizer step "
            f"would hold part of a prompt group and the next step the rest (prompt_mean is undefined "
            f"there, and every mode's step weight would count a group twice). Use a multiple of {g} "
            f"(e.g. --global-batch-size {' or '.join(map(str, whole))}) or change --grpo-group-size.")
    elif (p * g) % b:
        problems.append(
            f"--grpo-prompts-per-step {p} x --grpo-group-size {g} = {p * g} sequences per collection is "
            f"not a multiple of --global-batch-size {b}: Megatron-LM's loop would then train some "
            f"groups twice a pass and split others at the collection's end. Use --grpo-prompts-per-step "
            f"a multiple of {b // g}.")
    return problems


def first_generated(mask: torch.Tensor) -> torch.Tensor:
    """int64 ``[N]``: the index of each row's first generated token (``mask`` bool ``[N, S]``)."""
    return mask.int().argmax(dim=1)


def row_parts(generation_mask: torch.Tensor, lengths: torch.Tensor) -> tuple:
    """``(first, prompt, response)`` of Megatron-LM's trajectory rows ``[N, S]``: the first generated
    position of each row, and bool ``[N, S]`` masks of its prompt (before ``first``) and of its
    response (from ``first`` to ``lengths``); the cut :func:`step_batches` and
    :func:`collection_batch` both make."""
    first = first_generated(generation_mask)
    at = torch.arange(generation_mask.shape[1]).unsqueeze(0)
    prompt = at < first.unsqueeze(1)
    return first, prompt, ~prompt & (at < lengths.unsqueeze(1))


def step_batches(*, tokens: torch.Tensor, generation_mask: torch.Tensor, lengths: torch.Tensor, pad: int,
                 advantages: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: Optional[torch.Tensor],
                 rollout_logprobs: Optional[torch.Tensor], shape: CollectionShape) -> list:
    """The collection's optimizer steps as :class:`RolloutBatch` es (host tensors).

    Row ``i`` (group-major: rows ``g*G .. g*G + G - 1`` are group ``g``) holds ``lengths[i]`` tokens
    of ``tokens[i]``; its prompt is the tokens before its first generated one, its response the rest.
    The loss mask is Megatron-LM's: generated, and not the pad id (its
    ``get_ltor_masks_and_position_ids(pad_mask_loss=True)`` masks every token equal to the pad id,
    so with a tokenizer whose pad is its eod the eod is not trained on, as in Megatron-LM's own
    loss). Megatron-LM's log-prob rows ``[N, S-1]`` give at
    position ``p - 1`` the log-prob of token ``p``: response token ``j`` at position ``f + j`` reads
    position ``f + j - 1``. Vectorised: one masked gather per field and step (host work where the
    data is built; no per-row tensors)."""
    seq = tokens.shape[1]
    first, in_prompt, in_response = row_parts(generation_mask, lengths)

    def at_tokens(rows: torch.Tensor) -> torch.Tensor:
        """``[N, S]``: column ``p`` holds the log-prob of token ``p`` (column 0: nothing)."""
        return torch.nn.functional.pad(rows, (1, 0))

    per_token = {"old": at_tokens(old_logprobs),
                 "ref": None if ref_logprobs is None else at_tokens(ref_logprobs),
                 "rollout": None if rollout_logprobs is None else at_tokens(rollout_logprobs)}
    steps = []
    b = shape.global_batch
    for k in range(shape.steps):
        rows = slice(k * b, (k + 1) * b)
        prompt, response = in_prompt[rows], in_response[rows]
        response_tokens = tokens[rows][response].long()
        pick = {name: None if v is None else v[rows][response].float() for name, v in per_token.items()}
        steps.append(RolloutBatch(
            prompt_lengths=first[rows].long(), response_lengths=(lengths[rows] - first[rows]).long(),
            prompt_tokens=tokens[rows][prompt].long(), response_tokens=response_tokens,
            loss_mask=generation_mask[rows][response] & (response_tokens != pad),
            advantages=advantages[rows].float().unsqueeze(1).expand(-1, seq)[response],
            old_logprobs=pick["old"], group_index=torch.arange(rows.start, rows.stop) // shape.group_size,
            ref_logprobs=pick["ref"], rollout_logprobs=pick["rollout"]))
    return steps


@dataclass(frozen=True)
class RLStep:
    """One optimizer step of a collection: its plan and where it comes from."""

    plan: StepPlan
    collection: int
    """0-based collection of this run."""
    step: int
    """0-based optimizer step within a pass over the collection."""
    grpo_pass: int
    """0-based pass (``--grpo-iterations``)."""


class CollectionPlanner:
    """``prepare_data_for_update`` of the RL entry (see the module docstring).

    ``items(plan, iteration, dp_rank)`` makes a step's microbatch items for the forward step;
    ``capacity``: the padded tokens one packed microbatch may hold, or None for one sequence per
    microbatch. :meth:`step_at` names the step of a 0-based iteration of the current collection."""

    def __init__(self, loss_cfg: PGLossConfig, shape: CollectionShape, *, cuda: bool, items,
                 capacity: Optional[int], plan_ahead: bool = True, packed_logprobs: bool = True):
        self.loss_cfg, self.shape, self.cuda = loss_cfg, shape, cuda
        self.items, self.capacity = items, capacity
        self.packed_logprobs = packed_logprobs
        """The old and reference log-prob passes on packed THD microbatches (:func:`packed_logprob_pass`);
        False: Megatron-LM's ``compute_logprobs_batch``, one row of ``--seq-length`` per sequence."""
        self.plan_ahead = plan_ahead
        """Plan step ``k + 1`` of a collection on a host thread while step ``k`` runs
        (:class:`~megatron_pg_agg.data.plan_ahead.PlanAhead`); False: each step when it starts."""
        self.collections = 0
        self._cpu_reference: Optional[dict] = None
        self._first_iteration = 0  # Megatron-LM's 0-based iteration of the current collection's first step
        self._plans: list = []  # the current collection's step plans, filled as the steps are reached
        self._ahead: Optional[PlanAhead] = None

    def step_at(self, iteration: int) -> RLStep:
        """The step Megatron-LM's 0-based ``iteration`` trains (of the current collection). The
        first pass plans each step when first asked (its plan was built in the background while the
        step before it ran); a plan's error is raised here, at the step that needs it."""
        offset = iteration - self._first_iteration
        if not 0 <= offset < self.shape.steps * self.shape.passes:
            raise KeyError(f"iteration {iteration} is not one of collection {self.collections - 1}'s")
        k, grpo_pass = offset % self.shape.steps, offset // self.shape.steps
        if self._plans[k] is None:
            self._plans[k] = self._ahead.get(k)
        return RLStep(self._plans[k], self.collections - 1, k, grpo_pass)

    def close(self) -> None:
        """Stop planning ahead (waits for a plan in flight); at the end of a run."""
        if self._ahead is not None:
            self._ahead.close()

    def microbatches_at(self, iteration: int) -> int:
        """Microbatches per DP rank of ``iteration``'s step (the schedule's count)."""
        return self.step_at(iteration).plan.stats["microbatches_per_rank"]

    def plan_config(self, *, whole_collection: bool = False) -> PlanConfig:
        """The steps' plan config; ``whole_collection``: that of the log-prob passes' layout (every
        sequence of the collection in one plan, packed at the steps' capacity, ``--seq-length`` when
        the steps hold one sequence per microbatch)."""
        from megatron.core import parallel_state as mpu
        from megatron.training import get_args

        args = get_args()
        dp = mpu.get_data_parallel_world_size()
        packed = self.capacity is not None or whole_collection
        return PlanConfig(
            dp_size=dp, num_microbatches=None if packed else self.shape.global_batch // dp,
            tp_size=args.tensor_model_parallel_size,
            sequence_parallel=args.sequence_parallel, cp_size=args.context_parallel_size,
            vocab_size=args.padded_vocab_size, max_tokens_per_microbatch=self.capacity or args.seq_length,
            # pipeline p2p buffers have one shape: every microbatch padded to it
            microbatch_tokens=(self.capacity or args.seq_length) if args.pipeline_model_parallel_size > 1 else None)

    def __call__(self, *, model, ref_state_dict, rollouts, tokenizer, sequence_packing: bool, is_correction: bool):
        from megatron.core import parallel_state as mpu
        from megatron.rl import rl_utils
        from megatron.training import get_args

        from megatron_pg_agg.megatron.model import gather_parameters

        args = get_args()
        # --overlap-param-gather: the last optimizer step updated only this rank's shards. The
        # log-prob passes' forward pre-hooks gather them (finish_grad_sync re-armed the gather), but
        # the reference swap below reads and restores state_dict() directly: gather first, so the
        # collection does not depend on a forward having run before that read
        gather_parameters(model)
        groups = [list(g) for g in rollouts]
        self._check_groups(groups)
        group_stats = rl_utils.compute_group_stats(rollouts, tokenizer, args.seq_length)
        example_groups = {}
        for g in groups:
            example_groups.setdefault(g[0].env_id, g)
        flat = [r for g in groups for r in g]
        view = TokenizerView(tokenizer)
        trajs, generation_mask, inference, position_ids = collection_trajectories(flat, view, args)
        lengths = torch.tensor([len(r.trajectory[0]) for r in flat], dtype=torch.long)
        logprobs = self._logprob_pass(model, trajs, generation_mask, position_ids, lengths, view.pad)
        old, ref = self._old_and_reference_logprobs(model[0], logprobs, ref_state_dict)
        rollout_lp = None
        if any(x is not None for x in inference):
            # Megatron-LM's alignment (the eod's log-prob is the old one) and its mismatch stats
            rollout_lp = rl_utils.align_unpacked_inference_logprobs(
                inference_logprobs=inference, old_logprobs_for_data=old, generation_masks=generation_mask,
                group_stats=group_stats)
        advantages = torch.tensor(group_stats.advantages, dtype=torch.float64)
        batches = step_batches(tokens=trajs, generation_mask=generation_mask, lengths=lengths, pad=view.pad,
                               advantages=advantages,
                               old_logprobs=old, ref_logprobs=ref, rollout_logprobs=rollout_lp, shape=self.shape)
        self._start_collection(batches, len(groups), first_iteration=args.curr_iteration)
        from megatron.core.rerun_state_machine import RerunDataIterator

        items = self._microbatches(self._first_iteration, mpu.get_data_parallel_rank())
        return RerunDataIterator(items), group_stats, example_groups

    def _logprob_pass(self, model, trajs: torch.Tensor, generation_mask: torch.Tensor, position_ids: torch.Tensor,
                      lengths: torch.Tensor, pad: int):
        """The collection's forward-only log-prob pass, a callable run once per set of weights: on the planner's
        packed THD microbatches of the whole collection (:func:`packed_logprob_pass`), or Megatron-LM's
        ``compute_logprobs_batch`` on its rows (:func:`make_logprob_pass`)."""
        from megatron.core import parallel_state as mpu
        from megatron.core.utils import get_attr_wrapped_model

        net = model[0]
        pp_group = get_attr_wrapped_model(net, "pg_collection").pp
        if not self.packed_logprobs:
            return make_logprob_pass(net, trajs, position_ids, pad, cuda=self.cuda, pp_group=pp_group)
        layout_cfg = self.plan_config(whole_collection=True)
        layout = plan_step(collection_batch(trajs, generation_mask, lengths, pad, self.shape),
                           PGLossConfig(), layout_cfg, cp_rank=mpu.get_context_parallel_rank())
        return packed_logprob_pass(
            model, layout.for_rank(mpu.get_data_parallel_rank()), lengths, trajs.shape[1] - 1,
            cp_size=layout_cfg.cp_size, cp_rank=mpu.get_context_parallel_rank(),
            tp_group=mpu.get_tensor_model_parallel_group(),
            dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True), pp_group=pp_group,
            device=torch.device("cuda", torch.cuda.current_device()) if self.cuda else None,
            seq_length=layout_cfg.microbatch_tokens)

    def _old_and_reference_logprobs(self, net, logprobs, ref_state_dict: dict) -> tuple:
        """``(old, reference)`` log-probs: the pass ``logprobs`` with the live weights of ``net``, then with
        the reference weights of ``ref_state_dict`` loaded (the live ones restored after)."""
        old = logprobs()
        if not self.cuda:
            # on CPU Megatron-LM's ref_state_dict holds ``.cpu()`` of CPU tensors, i.e. the live
            # weights: keep the first collection's copy (the run's starting weights, which is the
            # reference on a GPU when no --pretrained-checkpoint is given)
            if self._cpu_reference is None:
                self._cpu_reference = _host_copy(ref_state_dict)
            ref_state_dict = self._cpu_reference
        # a copy (``.cpu()`` of a CPU tensor is the tensor itself: the swap would then lose the weights)
        current = _host_copy(net.state_dict())
        net.load_state_dict(ref_state_dict)
        ref = logprobs()
        net.load_state_dict(current)
        return old, ref

    def _start_collection(self, batches: list, groups: int, *, first_iteration: int) -> None:
        """Make ``batches`` (the collection's optimizer steps, ``groups`` prompt groups) what the next
        iterations train, from Megatron-LM's 0-based ``first_iteration``: their plans built ahead on a host
        thread, Megatron-LM's microbatch calculator at ``B / DP`` sequences per rank, the collection counted
        and logged."""
        from megatron.core import parallel_state as mpu
        from megatron.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator
        from megatron.rl import rl_utils

        plan_cfg = self.plan_config()
        cp_rank = mpu.get_context_parallel_rank()
        if self._ahead is not None:
            self._ahead.close()  # the previous collection's (every step of it was planned by now)
        self._ahead = PlanAhead(lambda k: plan_step(batches[k], self.loss_cfg, plan_cfg, cp_rank=cp_rank),
                                range(len(batches)), enabled=self.plan_ahead, name="pg-rl-plan-ahead")
        self._plans = [None] * len(batches)
        rl_utils.get_rl_runtime_state().packing_context = None
        reconfigure_num_microbatches_calculator(
            rank=torch.distributed.get_rank(), rampup_batch_size=None, global_batch_size=self.shape.global_batch,
            micro_batch_size=1, decrease_batch_size_if_needed=False,
            data_parallel_size=mpu.get_data_parallel_world_size())
        collection = self.collections
        self.collections += 1
        self._first_iteration = first_iteration  # Megatron-LM's 0-based iteration that asked for data
        if torch.distributed.get_rank() == 0:
            packing = (f"microbatches of at most {self.capacity} tokens" if self.capacity
                       else "one sequence per microbatch")
            logger.info(f"collection {collection}: {groups} groups x {self.shape.group_size} -> "
                        f"{self.shape.steps} optimizer steps of {self.shape.groups_per_step} whole groups "
                        f"x {self.shape.passes} passes (mode {self.loss_cfg.mode}, {packing})")

    def _check_groups(self, groups: list) -> None:
        shape = self.shape
        if len(groups) != shape.prompts or any(len(g) != shape.group_size for g in groups):
            raise RuntimeError(
                f"the collection has {len(groups)} groups of sizes {sorted({len(g) for g in groups})}; "
                f"the RL entry plans --grpo-prompts-per-step {shape.prompts} groups of --grpo-group-size "
                f"{shape.group_size}")
        multi = [r for g in groups for r in g if len(r.trajectory) != 1]
        if multi:
            raise RuntimeError(
                f"a rollout has {len(multi[0].trajectory)} turns: the RL entry plans single-turn rollouts "
                "(each rollout one sequence); a multi-turn environment needs Megatron-LM's own loss "
                "(--pg-loss-source megatron)")

    def _microbatches(self, first_iteration: int, dp_rank: int) -> Iterator:
        for iteration in range(first_iteration, first_iteration + self.shape.steps * self.shape.passes):
            yield from self.items(self.step_at(iteration).plan, iteration, dp_rank)


def _host_copy(state: dict) -> dict:
    """A state dict copied to host memory (a real copy on every device)."""
    return {k: (v.detach().to("cpu", copy=True) if v is not None else v) for k, v in state.items()}


class TokenizerView:
    """Megatron-LM's tokenizer, with ``bos`` None where its library has no bos token
    (``NullTokenizer`` has no ``bos_id``; Megatron-LM reads None as "no bos check")."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        if name == "bos":
            try:
                return self._tokenizer.bos
            except AttributeError:
                return None
        return getattr(self._tokenizer, name)


def collection_trajectories(rollouts: list, view, args) -> tuple:
    """Megatron-LM's trajectories of a collection's single-turn ``rollouts`` (``prepare_trajectories``:
    padding to ``--seq-length``, its bos/eod checks; ``view`` the tokenizer): ``(trajectories, generation
    masks, inference log-probs, position ids)``, the position ids those of ``get_ltor_masks_and_position_ids``."""
    from megatron.rl import rl_utils
    from megatron.training.utils import get_ltor_masks_and_position_ids

    trajs, generation_mask, inference = rl_utils.prepare_trajectories(
        [(r, 0) for r in rollouts], view, args.seq_length, args.rl_skip_bos_token)
    _, _, position_ids = get_ltor_masks_and_position_ids(
        trajs, view.eod, view.pad, args.reset_position_ids, args.reset_attention_mask,
        eod_mask_loss=False, pad_mask_loss=True)
    return trajs, generation_mask, inference, position_ids


def make_logprob_pass(net, trajs: torch.Tensor, position_ids: torch.Tensor, pad: int, *, cuda: bool, pp_group):
    """A function computing Megatron-LM's log-prob rows ``[N, S-1]`` of every trajectory with the
    model's current weights: each DP rank runs ``compute_logprobs_batch`` on a contiguous slice
    (padded with pad rows to equal slices, as Megatron-LM pads), then the slices are gathered."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.rl import rl_utils
    from megatron.training import get_args
    from torch.utils.data import DataLoader, TensorDataset

    args = get_args()
    dp, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    n = trajs.shape[0]
    per_rank = -(-n // dp)
    pad_rows = per_rank * dp - n
    trajs = torch.cat([trajs, torch.full((pad_rows, trajs.shape[1]), pad, dtype=trajs.dtype)])
    position_ids = torch.cat([position_ids, torch.zeros((pad_rows, position_ids.shape[1]), dtype=position_ids.dtype)])
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)

    def logprobs() -> torch.Tensor:
        loader = DataLoader(TensorDataset(trajs[mine], position_ids[mine]), batch_size=args.micro_batch_size)
        with torch.no_grad():
            local = rl_utils.compute_logprobs_batch(
                model=net, data_loader=loader, forward_backward_func=get_forward_backward_func(),
                packing_context=None, trajs_batch_size=per_rank, seq_length=args.seq_length,
                logprobs_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
                dtype=dtype, pp_group=pp_group, is_correction=False)
        device = "cuda" if cuda else "cpu"
        parts = [torch.empty_like(local, device=device) for _ in range(dp)]
        torch.distributed.all_gather(parts, local.to(device), group=mpu.get_data_parallel_group())
        return torch.cat(parts).cpu()[:n]

    return logprobs


def collection_batch(trajs: torch.Tensor, generation_mask: torch.Tensor, lengths: torch.Tensor, pad: int,
                     shape: CollectionShape) -> RolloutBatch:
    """Every sequence of the collection as one :class:`RolloutBatch` (rollout ``i`` is row ``i``, its
    prompt the tokens before its first generated one, as in :func:`step_batches`), with zero
    advantages and log-probs: the layout of the log-prob passes (its plan places the sequences;
    nothing of the loss is read from it). Vectorised: one pass over the rows' positions."""
    n = trajs.shape[0]
    first, prompt, response = row_parts(generation_mask, lengths)
    response_tokens = trajs[response].long()
    return RolloutBatch(
        prompt_lengths=first.long(), response_lengths=lengths - first,
        prompt_tokens=trajs[prompt].long(), response_tokens=response_tokens,
        loss_mask=generation_mask[response] & (response_tokens != pad),
        advantages=torch.zeros(response_tokens.numel()), old_logprobs=torch.zeros(response_tokens.numel()),
        group_index=torch.arange(n) // shape.group_size)


def row_positions(microbatches: list, lengths: torch.Tensor, width: int, *, cp_size: int = 1,
                  cp_rank: int = 0) -> tuple:
    """Where this rank's packed log-probs go in Megatron-LM's rows (host, once per collection).

    Position ``j`` of a sequence in a microbatch scores its token ``j + 1``: that is column ``j`` of
    the sequence's row ``i`` (its ``sequence_ids`` entry), for ``j < lengths[i] - 1``. Returns int64
    ``(src, dst)``: ``src`` indexes the concatenation of the microbatches' ``[T]`` log-probs (this
    CP rank's positions: chunks ``cp_rank`` and ``2 cp - 1 - cp_rank`` of each sequence), ``dst`` the
    flat rows ``[N * width]``; positions that score no token of the sequence (its last, padding)
    are left out."""
    src, dst = [], []
    base = 0
    for mb in microbatches:
        cu = mb.cu_seqlens_padded.long()
        total = int(cu[-1])
        local = mb.num_tokens
        at = cp_partition_index(cu[1:] - cu[:-1], cp_size, cp_rank) if cp_size > 1 else torch.arange(total)
        seq = segment_ids(cu, total).index_select(0, at)
        column = at - cu[:-1].index_select(0, seq)
        row = torch.as_tensor(mb.sequence_ids, dtype=torch.long).index_select(0, seq)
        keep = column < lengths.index_select(0, row) - 1
        src.append(torch.arange(base, base + local)[keep])
        dst.append((row * width + column)[keep])
        base += local
    return torch.cat(src), torch.cat(dst)


def packed_logprob_pass(model: list, microbatches: list, lengths: torch.Tensor, width: int, *, cp_size: int,
                        cp_rank: int, tp_group, dp_cp_group, pp_group, device: Optional[torch.device],
                        seq_length: Optional[int]):
    """A function computing Megatron-LM's log-prob rows ``[N, width]`` (``width = --seq-length - 1``)
    of every trajectory with the model's current weights, from this rank's planned packed THD
    microbatches of the whole collection (:func:`~megatron_pg_agg.megatron.logprob_pass.planned_logprobs`:
    forward-only through Megatron's schedule, each microbatch's logits dropped after its log-prob
    gather). Each rank writes its sequences' log-probs into zero rows (:func:`row_positions`, built
    here once for both passes), the DP x CP group sums them (every entry is written by one rank:
    the sums are exact), and with pipeline parallelism the last stage broadcasts them, as
    Megatron-LM's ``compute_logprobs_batch`` does. Entries no sequence scores are 0 (Megatron-LM
    reads only a row's generated positions). float32 host rows, as Megatron-LM's fp32 runs give."""
    from megatron_pg_agg.megatron.logprob_pass import planned_logprobs

    rows = lengths.numel()
    src, dst = row_positions(microbatches, lengths, width, cp_size=cp_size, cp_rank=cp_rank)
    if device is not None:
        src, dst = src.to(device, non_blocking=True), dst.to(device, non_blocking=True)
    pp_size = torch.distributed.get_world_size(pp_group) if pp_group is not None else 1
    last_stage = pp_size == 1 or torch.distributed.get_rank(pp_group) == pp_size - 1
    reduce = torch.distributed.get_world_size(dp_cp_group) > 1

    def logprobs() -> torch.Tensor:
        out = planned_logprobs(model, microbatches, tp_group=tp_group, is_last_stage=last_stage, device=device,
                               seq_length=seq_length)
        flat = torch.zeros(rows * width, dtype=torch.float32, device=device)
        if last_stage:
            flat.index_copy_(0, dst, torch.cat(out).float().index_select(0, src))
            if reduce:
                torch.distributed.all_reduce(flat, group=dp_cp_group)
        if pp_size > 1:
            last = torch.distributed.get_process_group_ranks(pp_group)[-1]
            torch.distributed.broadcast(flat, src=last, group=pp_group)
        return flat.view(rows, width).cpu()

    return logprobs
