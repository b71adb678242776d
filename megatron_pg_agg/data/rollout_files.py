"""Rollout files: the on-disk format the training launcher reads, checked on the host as it is read.

Format
------
A rollout file is JSON Lines (UTF-8): one JSON object per line, one line per response. Blank
lines are ignored; line numbers in errors count every physical line, starting at 1.

===================  ========  ====================================================================
field                required  value
===================  ========  ====================================================================
``step``             yes       integer >= 0: the optimizer step the response belongs to
``group_id``         yes       string or integer: the prompt group; responses to one prompt share
                               it, and a group id belongs to exactly one step
``prompt_ids``       yes       non-empty array of integer token ids
``response_ids``     yes       non-empty array of integer token ids
``loss_mask``        yes       array of 0/1, one per response token: 1 = trained on
``advantages``       yes       array of numbers, one per response token
``old_logprobs``     yes       array of numbers, one per response token (behaviour policy)
``ref_logprobs``     no        array of numbers, one per response token (reference policy), or null
``rollout_logprobs`` no        array of numbers, one per response token (the rollout engine's
                               sampler), or null; required by a rollout-engine correction
``numerator_mask``   no        array of 0/1, one per response token, 1 only where ``loss_mask`` is 1
                               (0 filters a token out of the numerator only), or null
===================  ========  ====================================================================

Rules, and why:

* any other field is an error, and so is a field given twice: a misspelt optional field
  (``numerator_msk``) would otherwise be dropped silently and change the objective;
* types are strict: token ids and mask entries are JSON integers, never ``true``/``false`` or
  ``2.0``; ``step`` is an integer; ``group_id`` is a string or an integer (``1`` and ``"1"``
  are different groups); token ids are never negative and, when the loader is given
  ``vocab_size``, are below it;
* every per-token array has exactly as many entries as ``response_ids``;
* numbers may be any JSON number, including the ``NaN``/``Infinity``/``-Infinity`` tokens that
  Python's ``json`` writes; they are loaded as float32. A non-finite ``advantages``/
  ``old_logprobs``/``ref_logprobs``/``rollout_logprobs`` entry (after that conversion) is an
  error where ``loss_mask`` is 1 and is loaded as 0.0 where it is 0 (masked positions carry no
  signal, but a NaN there would still poison gradients downstream);
* ``old_logprobs``/``ref_logprobs``/``rollout_logprobs`` entries are log-probabilities: one above
  ``1e-4`` (float noise around 0 is allowed) where ``loss_mask`` is 1 is an error, since it is a
  probability above 1 (a sign or unit mix-up upstream); masked positions are not checked;
* a step whose responses have no valid token at all is allowed (it has weight 0);
  a file with no rollouts at all is an error.

Example line::

    {"step": 0, "group_id": "q17", "prompt_ids": [1, 5, 9], "response_ids": [4, 2],
     "loss_mask": [1, 1], "advantages": [0.5, 0.5], "old_logprobs": [-2.1, -0.3]}

Errors are :class:`RolloutFormatError`, whose message starts with ``"{path}:{line}: field
'{field}': "`` (``"{path}:{line}: "`` when no single field is at fault, ``"{path}: "`` for the
file as a whole, ``"{path}: step {k}: "`` for :func:`write_rollouts`' input) and then says what
is wrong and what was expected; a fault of one value names its position (``"loss_mask[1]=2"``).
Loading is all-or-nothing: the first bad line raises and nothing is returned.

Two kinds of check, each written once. This module checks the file format, line by line: UTF-8,
JSON, one object per line, field names, JSON types, ``step`` and ``group_id``. The values (0/1
masks, lengths, token ids, finiteness and log-prob signs at valid positions, the numerator within
``loss_mask``) are checked by :class:`~megatron_pg_agg.data.rollouts.RolloutBatch` itself when
each step is packed, the same checker every other path uses; its fault becomes a
:class:`RolloutFormatError` naming the line of the offending rollout. Both run at C speed on
valid data (type sets, vector operations) and only walk an array element by element to describe
a fault.
"""
from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Sequence
from typing import Callable, NoReturn, Optional, Union

import torch

from .atomic_files import atomic_write
from .rollouts import NUMBER_FIELDS, PlanError, Rollout, RolloutBatch, number_tensor

__all__ = ["RolloutFormatError", "load_rollouts", "write_rollouts"]

PathLike = Union[str, "os.PathLike[str]"]

REQUIRED_FIELDS = ("step", "group_id", "prompt_ids", "response_ids", "loss_mask", "advantages", "old_logprobs")
OPTIONAL_FIELDS = ("ref_logprobs", "numerator_mask", "rollout_logprobs")
KNOWN_FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS
_KNOWN_SET = frozenset(KNOWN_FIELDS)
_INT = {int}
_NUMBER = {int, float}
# list field -> (allowed JSON element types, what the message expects, what the array holds)
_IDS = (_INT, "an integer token id", "integer token ids")
_FLAGS = (_INT, "the integer 0 or 1", "0/1 flags")
_NUMBERS = (_NUMBER, "a number", "numbers")
_ELEMENTS = {"prompt_ids": _IDS, "response_ids": _IDS, "loss_mask": _FLAGS, "numerator_mask": _FLAGS,
             **{name: _NUMBERS for name in NUMBER_FIELDS}}


class RolloutFormatError(ValueError):
    """A rollout file (or a step given to :func:`write_rollouts`) that breaks the format.

    ``path`` is the file, ``line`` the 1-based line (None for file- and step-level errors),
    ``field`` the offending field (None when no single field is at fault), ``step`` and
    ``rollout`` locate step-level errors (the step key and the rollout's index in it).
    """

    def __init__(self, path, problem: str, *, line: Optional[int] = None, field: Optional[str] = None,
                 step: Optional[int] = None, rollout: Optional[int] = None):
        self.path = os.fspath(path)
        self.line = line
        self.field = field
        self.step = step
        self.rollout = rollout
        self.problem = problem
        parts = [self.path if line is None else f"{self.path}:{line}"]
        if step is not None:
            parts.append(f"step {step}")
        if rollout is not None:
            parts.append(f"rollout {rollout}")
        if field is not None:
            parts.append(f"field '{field}'")
        super().__init__(": ".join(parts + [problem]))

    def __reduce__(self):
        # the default would call __init__(message) and fail: keep the exception picklable
        # (launchers pass errors between processes)
        return (_rebuild_error, (self.path, self.problem, self.line, self.field, self.step, self.rollout))


def _rebuild_error(path, problem, line, field, step, rollout):
    return RolloutFormatError(path, problem, line=line, field=field, step=step, rollout=rollout)


Fail = Callable[..., NoReturn]  # fail(field, problem): raise a located RolloutFormatError


# ----------------------------------------------------------------------------- describing values

def _describe(value) -> str:
    """``value`` as it appears in the file, with its JSON type, for error messages."""
    kind = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number",
            str: "a string", list: "an array", dict: "an object"}.get(type(value))
    if kind is None:  # only write_rollouts sees non-JSON values
        return f"{type(value).__name__} {value!r}"[:80]
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):  # a container holding non-JSON values (write_rollouts)
        shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return shown if kind == "null" else f"{shown} ({kind})"


def _first(values: list, bad: Callable[[object], bool]) -> int:
    """Index of the first bad element; only called once a fast check has found one."""
    return next(j for j, v in enumerate(values) if bad(v))


# ----------------------------------------------------------------------------- one record

def _check_field_names(record: dict, fail: Fail, require_ref: bool) -> None:
    """Unknown fields first (a typo explains a 'missing' field that follows), then missing ones."""
    if not record.keys() <= _KNOWN_SET:
        name = next(k for k in record if k not in _KNOWN_SET)
        close = difflib.get_close_matches(str(name), KNOWN_FIELDS, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        fail(name, f"unknown field; {hint}expected only {', '.join(KNOWN_FIELDS)}")
    for name in REQUIRED_FIELDS:
        if name not in record:
            fail(name, "required field is missing")
    if require_ref and record.get("ref_logprobs") is None:
        fail("ref_logprobs", "is missing or null but require_ref=True: every response needs reference "
                             "log-probs (an array of numbers, one per response token)")


def _check_step(value, fail: Fail) -> int:
    if type(value) is not int:
        fail("step", f"is {_describe(value)}; expected an integer >= 0")
    if value < 0:
        fail("step", f"is {value}; expected an integer >= 0")
    return value


def _check_group_id(value, fail: Fail):
    if type(value) not in (str, int):
        fail("group_id", f"is {_describe(value)}; expected a string or an integer")
    return value


def _check_list(record: dict, name: str, what: str, fail: Fail) -> list:
    value = record[name]
    if type(value) is not list:
        fail(name, f"is {_describe(value)}; expected an array of {what}")
    return value


def _check_elements(record: dict, name: str, fail: Fail) -> list:
    """A list field whose elements have the JSON type the format asks (token ids and mask flags
    are integers, never booleans or ``2.0``; numbers are integers or floats). Values (0/1, ranges,
    finiteness, lengths) are judged by the batch checker once the step is packed."""
    kinds, expected, what = _ELEMENTS[name]
    values = _check_list(record, name, what, fail)
    if not set(map(type, values)) <= kinds:  # C speed; the element walk only describes a fault
        j = _first(values, lambda v: type(v) not in kinds)
        fail(name, f"{name}[{j}] is {_describe(values[j])}; expected {expected}")
    return values


def _rollout_from_record(record: dict, fail: Fail, require_ref: bool):
    """Check one record's format (a parsed line: field names and JSON types) and build its
    ``(step, Rollout)``; ``fail`` locates errors. Its values are checked with its step's batch."""
    _check_field_names(record, fail, require_ref)
    step = _check_step(record["step"], fail)
    group_id = _check_group_id(record["group_id"], fail)
    lists = {name: _check_elements(record, name, fail) for name in _ELEMENTS if record.get(name) is not None}
    return step, Rollout(group_id=group_id, **lists)


# ----------------------------------------------------------------------------- reading

class _DuplicateField(Exception):
    def __init__(self, name):
        self.name = name


def _unique_fields(pairs: list) -> dict:
    """json object hook: ``{"step": 0, "step": 1}`` would otherwise keep the last value silently."""
    record = dict(pairs)
    if len(record) != len(pairs):
        seen = set()
        raise _DuplicateField(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return record


def _parse_line(raw: bytes, path, lineno: int) -> dict:
    """One non-blank line -> a JSON object, or an error naming the line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RolloutFormatError(path, f"is not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                                       "expected a UTF-8 JSON object", line=lineno) from None
    if lineno == 1:
        text = text.lstrip("\ufeff")  # tolerate a byte-order mark
    try:
        record = json.loads(text, object_pairs_hook=_unique_fields)
    except _DuplicateField as dup:
        raise RolloutFormatError(path, "appears twice in the object; expected each field once",
                                 line=lineno, field=dup.name) from None
    except json.JSONDecodeError as exc:
        raise RolloutFormatError(path, f"malformed JSON: {exc.msg} (column {exc.colno}); "
                                       "expected one JSON object per line", line=lineno) from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer with too many digits
        raise RolloutFormatError(path, f"malformed JSON: {exc}; expected one JSON object per line",
                                 line=lineno) from None
    if type(record) is not dict:
        raise RolloutFormatError(path, f"is {_describe(record)}; expected a JSON object (one rollout per line)",
                                 line=lineno)
    return record


def _step_fault(path, step, err: PlanError, where) -> RolloutFormatError:
    """The batch checker's PlanError for rollout ``err.rollout`` of ``step``, located by
    ``where(rollout)``: the file line (loader) or the step and rollout (writer)."""
    if err.rollout is None:  # not about one rollout (cannot happen for packed records): the step
        return RolloutFormatError(path, str(err), step=step)
    return RolloutFormatError(path, err.problem, field=err.field, **where(err.rollout))


def _packed_steps(path, records: dict, lines: dict, vocab_size: Optional[int], fault) -> dict:
    """Each step's records packed into a RolloutBatch by the one checker (values: masks 0/1,
    finiteness and log-prob sign at valid positions, numerator within loss_mask, lengths, token
    ids). Raises the fault of the first bad line: the earliest of the checker's faults (one per
    step) and ``fault``, the format error that stopped reading (None if none did)."""
    faults = [] if fault is None else [fault]
    batches = {}
    for step in sorted(records):
        try:
            batches[step] = RolloutBatch.from_rollouts(records.pop(step), vocab_size=vocab_size)
        except PlanError as err:
            faults.append(_step_fault(path, step, err, lambda i, _step=step: {"line": lines[_step][i]}))
    if faults:
        raise min(faults, key=lambda e: e.line if e.line is not None else 0)
    return batches


def load_rollouts(path: PathLike, *, vocab_size: Optional[int] = None,
                  require_ref: bool = False) -> dict:
    """Read and check a rollout file (format in the module docstring).

    Returns ``{step: RolloutBatch}`` with steps in ascending order and each step's rollouts in
    file order (the planner regroups them), each step packed and checked once (its values by
    :class:`~megatron_pg_agg.data.rollouts.RolloutBatch`'s own checker; non-finite numbers at
    masked positions are stored as 0.0). ``vocab_size`` bounds token ids; ``require_ref`` makes
    ``ref_logprobs`` mandatory (a KL penalty needs it). Raises :class:`RolloutFormatError` naming
    the first bad line (file, line, field and, for a value, its position); nothing is returned then.
    """
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise RolloutFormatError(path, f"cannot read the rollout file ({exc.strerror or exc}); "
                                       "expected a readable JSON Lines file") from None
    records: dict = {}  # step -> [Rollout] in file order
    lines: dict = {}  # step -> the line of each of its rollouts: a value fault names its line
    group_home: dict = {}  # group_id -> (step, first line)
    fault = None
    with f:
        try:
            for lineno, raw in enumerate(f, 1):
                if raw.isspace():
                    continue
                record = _parse_line(raw, path, lineno)

                def fail(field, problem, _line=lineno):
                    raise RolloutFormatError(path, problem, line=_line, field=field)

                step, rollout = _rollout_from_record(record, fail, require_ref)
                home = group_home.setdefault(rollout.group_id, (step, lineno))
                if home[0] != step:
                    fail("group_id", f"group {_describe(rollout.group_id)} is in step {step} here but in "
                                     f"step {home[0]} at line {home[1]}; expected a prompt group in one step")
                records.setdefault(step, []).append(rollout)
                lines.setdefault(step, []).append(lineno)
        except RolloutFormatError as err:
            fault = err  # reading stops; a value fault on an earlier line is reported first
    if fault is None and not records:
        raise RolloutFormatError(path, "has no rollouts (the file is empty or only blank lines); "
                                       "expected one JSON object per line")
    return _packed_steps(path, records, lines, vocab_size, fault)


# ----------------------------------------------------------------------------- writing

def _as_list(values):
    """Tensors and arrays become lists of Python scalars, other sequences lists (the format's
    arrays); anything else is left for the checks to reject by name."""
    if hasattr(values, "tolist"):
        return values.tolist()
    if isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
        return list(values)
    return values  # None, or something the checks will name


def _record_of(step: int, r: Rollout) -> dict:
    record = {
        "step": step,
        "group_id": r.group_id,
        "prompt_ids": _as_list(r.prompt_ids),
        "response_ids": _as_list(r.response_ids),
        "loss_mask": _as_list(r.loss_mask),
        "advantages": _as_list(r.advantages),
        "old_logprobs": _as_list(r.old_logprobs),
    }
    for name in OPTIONAL_FIELDS:
        if getattr(r, name) is not None:
            record[name] = _as_list(getattr(r, name))
    return record


_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))  # strict JSON, compact


def _loaded_numbers(record: dict) -> None:
    """The record's numbers in their loaded form, in place: floats, with a non-finite value (the
    checker allowed it only at a masked position) as 0.0, so the file is strict JSON and loads
    back to exactly what load_rollouts returns. float64 keeps every written number exact."""
    for name in NUMBER_FIELDS:
        values = record.get(name)
        if values is None:
            continue
        try:
            floats = list(map(float, values))  # C speed; the common case ends here
        except OverflowError:  # an integer too large for a float: +-inf, then 0.0 below
            floats = number_tensor(values, torch.float64).tolist()
        if not all(map(math.isfinite, floats)):
            t = torch.tensor(floats, dtype=torch.float64)
            floats = torch.where(torch.isfinite(t), t, 0.0).tolist()
        record[name] = floats


def _step_records(path, step: int, rollouts, group_home: dict) -> list:
    """Step ``step``'s records, each checked with the loader's rules: its format here, its values
    by the batch checker (the step packed as a RolloutBatch), the first bad rollout raised."""
    if not isinstance(rollouts, (list, tuple)) or not rollouts:
        raise RolloutFormatError(path, f"is {_describe(rollouts)}; expected a non-empty list of Rollout "
                                       "(an empty step cannot be written: the file has no line for it)",
                                 step=step)
    records, fault = [], None
    try:
        for i, r in enumerate(rollouts):
            def fail(field, problem, _i=i):
                raise RolloutFormatError(path, problem, step=step, rollout=_i, field=field)

            if not isinstance(r, Rollout):
                fail(None, f"is {_describe(r)}; expected a Rollout")
            record = _record_of(step, r)
            _, checked = _rollout_from_record(record, fail, False)
            home = group_home.setdefault(r.group_id, (step, i))
            if home[0] != step:
                fail("group_id", f"group {_describe(r.group_id)} is also in step {home[0]} (rollout "
                                 f"{home[1]}); expected a prompt group in one step")
            records.append((record, checked))
    except RolloutFormatError as err:
        fault = err  # the rollouts before it are value-checked first: an earlier fault comes first
    if records:
        try:
            RolloutBatch.from_rollouts([checked for _, checked in records])
        except PlanError as err:
            raise _step_fault(path, step, err, lambda i: {"step": step, "rollout": i}) from None
    if fault is not None:
        raise fault
    return [record for record, _ in records]


def _checked_lines(path, steps: dict):
    """Yield the JSON lines for ``steps``, each step after the loader's own checks (so what is
    written loads); a generator, so only one step's records are held at a time."""
    if not isinstance(steps, dict) or not steps:
        raise RolloutFormatError(path, f"nothing to write: expected a non-empty dict {{step: [Rollout, ...]}}, "
                                       f"got {_describe(steps)}")
    bad_keys = [k for k in steps if type(k) is not int or k < 0]
    if bad_keys:
        raise RolloutFormatError(path, f"step key {bad_keys[0]!r} is not an integer >= 0; expected one",
                                 field="step")
    group_home: dict = {}  # group_id -> (step, rollout index)
    for step in sorted(steps):
        for record in _step_records(path, step, steps[step], group_home):
            _loaded_numbers(record)
            yield _ENCODER.encode(record)


def write_rollouts(path: PathLike, steps: dict) -> PathLike:
    """Write ``{step: [Rollout, ...]}`` as a rollout file, atomically; returns ``path``.

    Every rollout is checked with the loader's rules; a bad one raises a step-level
    :class:`RolloutFormatError` (``"{path}: step {k}: rollout {i}: field '...': ..."``). Lines go
    to a temporary file beside the target, moved over it with ``os.replace`` only once all are
    written, so a reader never sees a half-written file and a failed write (bad input, full disk)
    leaves the old file as it was and no temporary file behind.

    ``load_rollouts(write_rollouts(p, steps))`` returns ``{k: RolloutBatch.from_rollouts(steps[k])}``
    for the steps in ascending order (non-finite values at masked positions as 0.0, in the file too).
    """
    lines = _checked_lines(path, steps)

    def write(f) -> None:
        for line in lines:
            f.write(line)
            f.write("\n")

    atomic_write(path, write, text=True)
    return path
