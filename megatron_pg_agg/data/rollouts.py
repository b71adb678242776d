"""Rollouts of one optimizer step: per-response records and their columnar (packed) form.

``Rollout`` is the convenient per-response record (lists of Python values). ``RolloutBatch``
holds a whole step as flat host tensors plus lengths: the step planner works on it with vector
operations, so planning a million-token step costs milliseconds, not a Python loop per token.

Checks follow megatron-core's ``__post_init__`` pattern: a ``RolloutBatch`` checks itself where it
is built (vectorised, on the host) and is then trusted; the planner does not check it again.
:meth:`RolloutBatch.from_rollouts` and the rollout-file loader pack their records and let that
one checker judge the values, so every path refuses the same data with the same message.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from itertools import chain, repeat
from typing import Optional, Sequence

import torch

from megatron_pg_agg.core.segments import exclusive_cumsum, segment_of

LOGPROB_TOLERANCE = 1e-4
"""Largest log-prob accepted at a valid position (``loss_mask`` 1): log p <= 0 up to float noise;
above it is a probability above 1 (a sign or unit mix-up upstream). Masked positions are not checked."""

PER_TOKEN_FIELDS = ("loss_mask", "advantages", "old_logprobs", "ref_logprobs", "numerator_mask", "rollout_logprobs")
"""Fields with one entry per response token (``Rollout`` and ``RolloutBatch`` names alike)."""
MASK_FIELDS = ("loss_mask", "numerator_mask")
NUMBER_FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")
LOGPROB_FIELDS = ("old_logprobs", "ref_logprobs", "rollout_logprobs")
_OPTIONAL = ("ref_logprobs", "numerator_mask", "rollout_logprobs")
# RolloutBatch token fields: (Rollout field named in messages, flat tensor, lengths)
_TOKEN_FIELDS = (("prompt_ids", "prompt_tokens", "prompt_lengths"),
                 ("response_ids", "response_tokens", "response_lengths"))
_DTYPES = {"prompt_lengths": torch.long, "response_lengths": torch.long, "prompt_tokens": torch.long,
           "response_tokens": torch.long, "group_index": torch.long, "loss_mask": torch.bool,
           "numerator_mask": torch.bool, **{name: torch.float32 for name in NUMBER_FIELDS}}
_WHY_NOT_EMPTY = {"prompt_ids": "the first response token is predicted from the last prompt position",
                  "response_ids": "a response is trained on its tokens"}


class PlanError(ValueError):
    """A step that cannot be planned; the message names the rollout and field.

    For a fault of one rollout, ``rollout`` is its index in the step, ``field`` the ``Rollout``
    field at fault and ``position`` the index in that field (each None when not known), and
    ``problem`` the message without its ``"rollout {i}: "`` prefix: the rollout-file loader
    names the file line instead.
    """

    def __init__(self, problem: str, *, rollout: Optional[int] = None, field: Optional[str] = None,
                 position: Optional[int] = None):
        super().__init__(problem if rollout is None else f"rollout {rollout}: {problem}")
        self.problem, self.rollout, self.field, self.position = problem, rollout, field, position

    def __reduce__(self):
        # the default would rebuild from the message alone: keep the location across processes
        return (_rebuild_plan_error, (self.problem, self.rollout, self.field, self.position))


def _rebuild_plan_error(problem, rollout, field, position):
    return PlanError(problem, rollout=rollout, field=field, position=position)


@dataclass
class Rollout:
    """One response to one prompt, as produced by the rollout engine."""

    prompt_ids: Sequence[int]
    """Prompt token ids."""
    response_ids: Sequence[int]
    """Response token ids (at least one)."""
    loss_mask: Sequence[int]
    """Per response token: 1 if the token is trained on (the denominator mask d)."""
    advantages: Sequence[float]
    """Per response token advantage."""
    old_logprobs: Sequence[float]
    """Per response token log-prob under the behaviour policy."""
    group_id: object
    """Prompt-group identifier: responses to the same prompt share it."""
    ref_logprobs: Optional[Sequence[float]] = None
    """Per response token log-prob under the reference policy (needed for a KL penalty)."""
    numerator_mask: Optional[Sequence[int]] = None
    """Per response token: 0 removes a token from the numerator only (filtering); None = loss_mask."""
    rollout_logprobs: Optional[Sequence[float]] = None
    """Per response token log-prob under the rollout engine's sampler (vLLM, SGLang): needed by a
    rollout-engine correction, which compares it with ``old_logprobs``."""


# ----------------------------------------------------------------------------- the one checker
# Each check finds its first offender with vector operations; the checks of a stage all run and
# the earliest rollout is reported (ties: the order below), so the message names the first bad
# rollout whichever check catches it (the file loader turns that into the first bad line).


def _show(value: float) -> str:
    """A number as the rollout file spells it (NaN, Infinity), else compactly."""
    if value != value:
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return f"{value:.6g}"


def _first(bad: torch.Tensor, starts: torch.Tensor):
    """``(rollout, position, flat index)`` of the first True of the flat per-token ``bad``
    (``starts``: the ``[N+1]`` offsets of the rollouts in it), or None when all are False."""
    if not bool(bad.any()):
        return None
    k = int(bad.int().argmax())  # argmax returns the first maximal index
    i = int(segment_of(starts, torch.tensor(k)))
    return i, k - int(starts[i]), k


def _raise_first(faults: list) -> None:
    """Raise the PlanError of the earliest rollout among ``faults`` (None entries: checks that passed)."""
    found = [f for f in faults if f is not None]
    if found:
        raise min(found, key=lambda f: f.rollout)  # min keeps the first of equals: check order


def _token_fault(name: str, bad: torch.Tensor, starts: torch.Tensor, problem) -> Optional[PlanError]:
    """The PlanError for the first True of ``bad`` in field ``name``: ``problem(j, k)`` words it."""
    hit = _first(bad, starts)
    if hit is None:
        return None
    i, j, k = hit
    return PlanError(problem(j, k), rollout=i, field=name, position=j)


def _length_faults(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
                   field_lengths: dict) -> list:
    """Per-rollout length faults, vectorised: an empty response, a per-token field without one
    entry per response token (``field_lengths``: name -> int64 ``[N]``, -1 where absent), an
    empty prompt (checked in this order within a rollout, as the fields are read)."""
    checks = [("response_ids", response_lengths < 1)]
    checks += [(name, (lengths >= 0) & (lengths != response_lengths)) for name, lengths in field_lengths.items()]
    checks.append(("prompt_ids", prompt_lengths < 1))
    faults = []
    for name, bad in checks:
        if not bool(bad.any()):
            continue
        i = int(bad.int().argmax())
        if name in _WHY_NOT_EMPTY:
            n = int((response_lengths if name == "response_ids" else prompt_lengths)[i])
            problem = (f"{name} is empty" if n == 0 else f"{name} has {n} tokens") + \
                f"; expected at least one token ({_WHY_NOT_EMPTY[name]})"
        else:
            problem = (f"{name} has {int(field_lengths[name][i])} entries but response_ids has "
                       f"{int(response_lengths[i])}; expected one per response token")
        faults.append(PlanError(problem, rollout=i, field=name))
    return faults


def _positive_logprob(name: str, j: int, value: float) -> str:
    return (f"{name}[{j}]={_show(value)} at valid position {j} is above 0 (a probability above 1); "
            f"expected a log-probability <= 0 (up to {LOGPROB_TOLERANCE:g} is allowed as float noise)")


@dataclass
class RolloutBatch:
    """A step's rollouts as flat host tensors (response fields concatenated in rollout order).

    Checked on construction (:meth:`__post_init__`): a batch that exists is valid, and the planner
    trusts it. Token ids against the vocabulary are checked where it is known
    (:meth:`check_vocabulary`)."""

    prompt_lengths: torch.Tensor
    """int64 ``[N]``: prompt tokens per rollout."""
    response_lengths: torch.Tensor
    """int64 ``[N]``: response tokens per rollout."""
    prompt_tokens: torch.Tensor
    """int64 ``[sum P]``: every prompt, concatenated."""
    response_tokens: torch.Tensor
    """int64 ``[sum R]``: every response, concatenated."""
    loss_mask: torch.Tensor
    """bool ``[sum R]``: the denominator mask d."""
    advantages: torch.Tensor
    """float32 ``[sum R]``."""
    old_logprobs: torch.Tensor
    """float32 ``[sum R]``."""
    group_index: torch.Tensor
    """int64 ``[N]``: prompt group of each rollout (any integers; equal = same group)."""
    ref_logprobs: Optional[torch.Tensor] = None
    """float32 ``[sum R]`` or None."""
    numerator_mask: Optional[torch.Tensor] = None
    """bool ``[sum R]`` (filtering; within loss_mask) or None for no filtering."""
    rollout_logprobs: Optional[torch.Tensor] = None
    """float32 ``[sum R]`` (the rollout engine's log-probs) or None."""
    group_labels: Optional[list] = None
    """The original group ids, indexed by ``group_index`` (for messages); optional."""

    def __len__(self) -> int:
        return self.prompt_lengths.numel()

    def __post_init__(self) -> None:
        """Check the batch where it is built (structure, then values); raises PlanError naming the
        first offender (rollout, field, position). Vectorised: milliseconds for a million tokens."""
        self._check_structure()
        self._check_values()

    def _check_structure(self) -> None:
        """Types, dtypes, non-empty rollouts and array sizes consistent with the lengths."""
        for name, dtype in _DTYPES.items():
            t = getattr(self, name)
            if t is None and name in _OPTIONAL:
                continue
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
                what = (f"a {t.dim()}-D {t.dtype} tensor" if isinstance(t, torch.Tensor)
                        else type(t).__name__)
                raise PlanError(f"{name} is {what}; expected a 1-D {dtype} tensor")
        n = len(self)
        if n == 0:
            raise PlanError("the step has no rollouts")
        _raise_first(_length_faults(self.prompt_lengths, self.response_lengths, {}))
        p_total, r_total = int(self.prompt_lengths.sum()), int(self.response_lengths.sum())
        if self.prompt_tokens.numel() != p_total:
            raise PlanError(f"prompt_tokens holds {self.prompt_tokens.numel()} ids but prompt_lengths sum to {p_total}")
        for name in ("response_tokens",) + PER_TOKEN_FIELDS:
            t = getattr(self, name)
            if t is not None and t.numel() != r_total:
                raise PlanError(f"{name} holds {t.numel()} entries but response_lengths sum to {r_total}")
        if self.group_index.numel() != n:
            raise PlanError(f"group_index holds {self.group_index.numel()} entries for {n} rollouts")
        if self.group_labels is not None:
            low, high = int(self.group_index.min()), int(self.group_index.max())
            if low < 0 or high >= len(self.group_labels):
                raise PlanError(f"group_index spans [{low}, {high}] but group_labels has "
                                f"{len(self.group_labels)} entries; expected indices into group_labels")

    def _check_values(self) -> None:
        """Token ids >= 0; at valid positions finite numbers and log-probs <= LOGPROB_TOLERANCE;
        numerator_mask within loss_mask. Masked positions may hold anything (they are never read)."""
        starts = exclusive_cumsum(self.response_lengths)
        valid = self.loss_mask
        faults = [self._token_ids_fault(lambda t: t < 0, "is negative; expected a token id >= 0")]
        for name in NUMBER_FIELDS:
            t = getattr(self, name)
            if t is not None:
                faults.append(_token_fault(
                    name, valid & ~torch.isfinite(t), starts,
                    lambda j, k, t=t, name=name: f"{name}[{j}]={_show(float(t[k]))} at valid position {j} "
                    "(loss_mask is 1); expected a finite number (non-finite values are only allowed "
                    "where loss_mask is 0)"))
        for name in LOGPROB_FIELDS:
            t = getattr(self, name)
            if t is not None:
                faults.append(_token_fault(name, valid & (t > LOGPROB_TOLERANCE), starts,
                                           lambda j, k, t=t, name=name: _positive_logprob(name, j, float(t[k]))))
        if self.numerator_mask is not None:
            faults.append(_token_fault(
                "numerator_mask", self.numerator_mask & ~valid, starts,
                lambda j, k: f"numerator_mask[{j}] is 1 where loss_mask is 0; expected 1 only where "
                             "loss_mask is 1 (the numerator is a subset of the valid tokens)"))
        _raise_first(faults)

    def _token_ids_fault(self, is_bad, what: str) -> Optional[PlanError]:
        """The first prompt or response token id for which ``is_bad`` holds (earliest rollout)."""
        faults = []
        for name, tokens_name, lengths_name in _TOKEN_FIELDS:
            tokens = getattr(self, tokens_name)
            faults.append(_token_fault(name, is_bad(tokens), exclusive_cumsum(getattr(self, lengths_name)),
                                       lambda j, k, tokens=tokens, name=name: f"{name}[{j}]={int(tokens[k])} {what}"))
        found = [f for f in faults if f is not None]
        return min(found, key=lambda f: f.rollout) if found else None

    def check_vocabulary(self, vocab_size: int) -> None:
        """Token ids against the vocabulary, checked where it is known (at start-up, or by the
        planner when ``PlanConfig.vocab_size`` is set); PlanError names rollout, field, position."""
        _raise_first([self._token_ids_fault(
            lambda t: (t < 0) | (t >= vocab_size),
            f"is outside the vocabulary [0, {vocab_size}); expected a token id in [0, {vocab_size})")])

    def with_numerator_mask(self, numerator_mask: torch.Tensor) -> "RolloutBatch":
        """A shallow copy whose numerator is ``numerator_mask``, without re-running the checks.

        Only for narrowing: ``numerator_mask`` must be within this batch's numerator (the
        planner's rollout correction only removes tokens from it), so the copy stays valid;
        building a batch with an arbitrary mask goes through the constructor, which checks it."""
        out = copy.copy(self)
        out.numerator_mask = numerator_mask
        return out

    @staticmethod
    def from_rollouts(rollouts: Sequence[Rollout], *, vocab_size: Optional[int] = None) -> "RolloutBatch":
        """Pack per-response records and check them with the one checker (messages name the first
        bad rollout, its field and position): list lengths and 0/1 masks while packing, then the
        batch's own checks, then the vocabulary when ``vocab_size`` is given.

        A non-finite number at a masked position is stored as 0.0 (it carries no signal). A
        per-token field that only some rollouts have is checked where given and then left out
        (None), as the step cannot use it."""
        rollouts = list(rollouts)
        try:
            return _pack(rollouts, vocab_size)
        except PlanError as err:
            first = err
        if first.rollout:
            # the stages run one after another, so an earlier rollout may break a later stage:
            # check the ones before the named rollout (each level is one stage further on)
            try:
                RolloutBatch.from_rollouts(rollouts[:first.rollout], vocab_size=vocab_size)
            except PlanError as earlier:
                raise earlier from None
        raise first


# ----------------------------------------------------------------------------- packing records


def _lengths(rollouts: list, name: str) -> torch.Tensor:
    """int64 ``[N]``: the length of field ``name`` of each record (-1 where it is None)."""
    try:
        return torch.tensor([-1 if getattr(r, name) is None else len(getattr(r, name)) for r in rollouts],
                            dtype=torch.long)
    except TypeError:  # describe the fault: find the record whose field has no length
        i = next(i for i, r in enumerate(rollouts) if getattr(r, name) is not None
                 and not hasattr(getattr(r, name), "__len__"))
        raise PlanError(f"{name} is {type(getattr(rollouts[i], name)).__name__}; expected a sequence",
                        rollout=i, field=name) from None


def number_tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (Python numbers) as a 1-D tensor; an integer too large for a float becomes
    +-inf (then judged as such) instead of failing the whole conversion."""
    try:
        return torch.tensor(values, dtype=dtype)
    except OverflowError:  # rare: only then is each value converted on its own
        return torch.tensor([_float_or_inf(v) for v in values], dtype=dtype)


def _float_or_inf(v) -> float:
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def _flat(rollouts: list, name: str, dtype: torch.dtype, fill=None) -> torch.Tensor:
    """Field ``name`` of every record, concatenated (``fill(r)`` stands in where it is None);
    itertools.chain walks the tokens at C speed. A value that does not convert is named."""
    parts = [getattr(r, name) if getattr(r, name) is not None else fill(r) for r in rollouts]
    try:
        if dtype.is_floating_point:
            return number_tensor(list(chain.from_iterable(parts)), dtype)
        return torch.tensor(list(chain.from_iterable(parts)), dtype=dtype)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        for i, part in enumerate(parts):  # describe the fault: the first record that fails alone
            try:
                number_tensor(list(part), dtype)
            except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
                what = "number" if dtype.is_floating_point else "token id"
                raise PlanError(f"{name} holds a value that is not a {what} ({exc})", rollout=i, field=name) from None
        raise


def _pack(rollouts: list, vocab_size: Optional[int]) -> RolloutBatch:
    """:meth:`RolloutBatch.from_rollouts` without the first-offender refinement: one stage after
    another (lengths, mask values, the batch's checks, the vocabulary)."""
    for i, r in enumerate(rollouts):
        if not isinstance(r, Rollout):
            raise PlanError(f"is {type(r).__name__}; expected a Rollout", rollout=i)
    lengths = {name: _lengths(rollouts, name) for name in ("prompt_ids", "response_ids") + PER_TOKEN_FIELDS}
    missing = [(name, lengths[name] < 0) for name in lengths if name not in _OPTIONAL]
    _raise_first([PlanError(f"{name} is None; expected a sequence", rollout=int(bad.int().argmax()), field=name)
                  for name, bad in missing if bool(bad.any())])
    prompt_lengths, response_lengths = lengths.pop("prompt_ids"), lengths.pop("response_ids")
    field_lengths = lengths
    _raise_first(_length_faults(prompt_lengths, response_lengths, field_lengths))
    starts = exclusive_cumsum(response_lengths)
    given = {name: int((field_lengths[name] >= 0).sum()) for name in _OPTIONAL}
    # masks packed as float64, which holds every 0/1 candidate exactly (int64 would truncate 1.5
    # to 1 silently): values are checked before the conversion to bool
    masks = {"loss_mask": _flat(rollouts, "loss_mask", torch.float64)}
    if given["numerator_mask"]:  # None on a record means its loss_mask
        masks["numerator_mask"] = _flat(rollouts, "numerator_mask", torch.float64, fill=lambda r: r.loss_mask)
    _raise_first([_token_fault(name, (m != 0) & (m != 1), starts,
                               lambda j, k, m=m, name=name: f"{name}[{j}]={_show(float(m[k]))}; expected 0 or 1")
                  for name, m in masks.items()])
    loss_mask = masks["loss_mask"].bool()
    numbers = {}
    for name in NUMBER_FIELDS:
        if name in ("advantages", "old_logprobs") or given[name]:
            t = _flat(rollouts, name, torch.float32, fill=lambda r: repeat(0.0, len(r.response_ids)))
            numbers[name] = torch.where(loss_mask | torch.isfinite(t), t, 0.0)  # masked non-finite -> 0.0
    labels, index = [], {}
    for i, r in enumerate(rollouts):
        try:
            if r.group_id not in index:
                index[r.group_id] = len(labels)
                labels.append(r.group_id)
        except TypeError:
            raise PlanError(f"group_id {r.group_id!r} is not hashable; expected a string or an integer",
                            rollout=i, field="group_id") from None
    batch = RolloutBatch(
        prompt_lengths=prompt_lengths, response_lengths=response_lengths,
        prompt_tokens=_flat(rollouts, "prompt_ids", torch.long),
        response_tokens=_flat(rollouts, "response_ids", torch.long),
        loss_mask=loss_mask,
        numerator_mask=masks["numerator_mask"].bool() if "numerator_mask" in masks else None,
        group_index=torch.tensor([index[r.group_id] for r in rollouts], dtype=torch.long),
        group_labels=labels, **numbers)
    for name in ("ref_logprobs", "rollout_logprobs"):
        if 0 < given[name] < len(rollouts):  # checked where given (filled with 0.0 elsewhere), not a step field
            setattr(batch, name, None)
    if vocab_size is not None:
        batch.check_vocabulary(vocab_size)
    return batch
