"""Rollout files: round trips, masked non-finite values, and every bad input named by file, line
(or step) and field, with nothing returned.

Bad-input cases write two good lines and then the bad one, so every line-level error must say
line 3 (blank lines count: see the first-bad-line test).
"""
import dataclasses
import json
import math
import os
import pickle
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.data.rollout_files import RolloutFormatError, load_rollouts, write_rollouts
from megatron_pg_agg.data.rollouts import PER_TOKEN_FIELDS, Rollout, RolloutBatch
from tests.support.rollouts import VOCAB, fixed_step

NAME = "rollouts.jsonl"


def _good(**changes):
    """A valid line as a dict; ``changes`` overrides fields (value ``...`` deletes one)."""
    record = {
        "step": 0,
        "group_id": "g0",
        "prompt_ids": [1, 5, 9],
        "response_ids": [4, 2, 7],
        "loss_mask": [1, 1, 0],
        "advantages": [0.5, 0.5, 0.5],
        "old_logprobs": [-2.0, -0.25, -1.0],
        "ref_logprobs": [-2.5, -0.5, -1.5],
        "numerator_mask": [1, 0, 0],
    }
    for key, value in changes.items():
        if value is ...:
            del record[key]
        else:
            record[key] = value
    return record


def _write(tmp_path, lines, name=NAME):
    """Lines are dicts (dumped with Python's json, so NaN/Infinity tokens appear) or raw strings."""
    path = tmp_path / name
    path.write_bytes(b"".join(
        (line if isinstance(line, bytes) else
         (line if isinstance(line, str) else json.dumps(line)).encode("utf-8")) + b"\n"
        for line in lines))
    return path


def _expect(excinfo, path, line, field):
    """The message prefix the format promises, and the matching attributes."""
    err = excinfo.value
    prefix = str(path) if line is None else f"{path}:{line}"
    if field is not None:
        prefix += f": field '{field}'"
    assert str(err).startswith(prefix + ": "), str(err)
    assert (err.path, err.line, err.field) == (str(path), line, field)


GOOD = [_good(group_id="a"), _good(group_id="b")]
NAN, INF = float("nan"), float("inf")

# (case id, bad third line, field at fault, words the message must contain, load_rollouts kwargs)
LINE_CASES = [
    ("malformed_json", '{"step": 0, "group_id": "g0",', None, ["malformed JSON", "column"], {}),
    ("trailing_garbage", json.dumps(_good()) + " x", None, ["malformed JSON", "Extra data"], {}),
    ("not_an_object", "[1, 2, 3]", None, ["[1, 2, 3] (an array)", "expected a JSON object"], {}),
    ("not_utf8", b'{"step": 0, "group_id": "\xff"}', None, ["UTF-8"], {}),
    ("missing_field", _good(advantages=...), "advantages", ["required field is missing"], {}),
    ("missing_step", _good(step=...), "step", ["required field is missing"], {}),
    ("unknown_field", _good(numerator_msk=[1, 0, 0]), "numerator_msk",
     ["unknown field", "did you mean 'numerator_mask'"], {}),
    ("duplicate_field", '{"step": 0, "step": 1}', "step", ["twice"], {}),
    ("step_string", _good(step="0"), "step", ['"0" (a string)', "integer >= 0"], {}),
    ("step_float", _good(step=1.0), "step", ["1.0 (a number)", "integer >= 0"], {}),
    ("step_bool", _good(step=True), "step", ["true (a boolean)"], {}),
    ("step_negative", _good(step=-1), "step", ["is -1", "integer >= 0"], {}),
    ("group_id_list", _good(group_id=["g0"]), "group_id", ["an array", "string or an integer"], {}),
    ("group_id_bool", _good(group_id=False), "group_id", ["a boolean", "string or an integer"], {}),
    ("prompt_ids_string", _good(prompt_ids="1 5 9"), "prompt_ids", ["a string", "expected an array"], {}),
    ("response_ids_float_token", _good(response_ids=[4, 2.0, 7]), "response_ids",
     ["response_ids[1] is 2.0 (a number)", "integer token id"], {}),
    ("response_ids_bool_token", _good(response_ids=[4, True, 7]), "response_ids",
     ["response_ids[1] is true (a boolean)", "integer token id"], {}),
    ("prompt_ids_string_token", _good(prompt_ids=[1, "5", 9]), "prompt_ids", ["prompt_ids[1]", "a string"], {}),
    ("negative_token", _good(prompt_ids=[1, -5, 9]), "prompt_ids", ["prompt_ids[1]=-5 is negative", ">= 0"], {}),
    ("prompt_token_out_of_vocab", _good(prompt_ids=[1, 5, VOCAB]), "prompt_ids",
     [f"prompt_ids[2]={VOCAB} is outside the vocabulary", f"[0, {VOCAB})"], {"vocab_size": VOCAB}),
    ("response_token_out_of_vocab", _good(response_ids=[VOCAB + 9, 2, 7]), "response_ids",
     [f"response_ids[0]={VOCAB + 9} is outside the vocabulary"], {"vocab_size": VOCAB}),
    ("empty_prompt", _good(prompt_ids=[]), "prompt_ids", ["is empty", "at least one token"], {}),
    ("empty_response", _good(response_ids=[]), "response_ids", ["is empty", "at least one token"], {}),
    ("loss_mask_length", _good(loss_mask=[1, 1]), "loss_mask", ["has 2 entries but response_ids has 3"], {}),
    ("advantages_length", _good(advantages=[0.5] * 4), "advantages", ["has 4 entries but response_ids has 3"], {}),
    ("old_logprobs_length", _good(old_logprobs=[-1.0]), "old_logprobs", ["has 1 entries but response_ids has 3"], {}),
    ("ref_logprobs_length", _good(ref_logprobs=[-1.0, -1.0]), "ref_logprobs",
     ["has 2 entries but response_ids has 3"], {}),
    ("numerator_mask_length", _good(numerator_mask=[1, 0, 0, 0]), "numerator_mask",
     ["has 4 entries but response_ids has 3"], {}),
    ("loss_mask_value_2", _good(loss_mask=[1, 2, 0]), "loss_mask", ["loss_mask[1]=2; expected 0 or 1"], {}),
    ("loss_mask_float", _good(loss_mask=[1, 1.0, 0]), "loss_mask",
     ["loss_mask[1] is 1.0 (a number)", "integer 0 or 1"], {}),
    ("loss_mask_bool", _good(loss_mask=[True, 1, 0]), "loss_mask", ["loss_mask[0] is true (a boolean)"], {}),
    ("loss_mask_not_array", _good(loss_mask=1), "loss_mask", ["1 (an integer)", "array of 0/1"], {}),
    ("numerator_mask_value", _good(numerator_mask=[1, 0, -1]), "numerator_mask",
     ["numerator_mask[2]=-1; expected 0 or 1"], {}),
    ("numerator_mask_object", _good(numerator_mask={"0": 1}), "numerator_mask", ["an object", "array"], {}),
    ("numerator_outside_loss_mask", _good(numerator_mask=[1, 0, 1]), "numerator_mask",
     ["numerator_mask[2] is 1 where loss_mask is 0", "only where loss_mask is 1"], {}),
    ("advantages_string_element", _good(advantages=[0.5, "0.5", 0.5]), "advantages",
     ['advantages[1] is "0.5" (a string)', "expected a number"], {}),
    ("advantages_null_element", _good(advantages=[0.5, None, 0.5]), "advantages", ["advantages[1] is null"], {}),
    ("old_logprobs_not_array", _good(old_logprobs=-0.5), "old_logprobs", ["-0.5 (a number)", "array of numbers"], {}),
    ("ref_logprobs_string", _good(ref_logprobs="none"), "ref_logprobs", ["a string", "array of numbers"], {}),
    ("nan_advantage_valid", _good(advantages=[0.5, NAN, 0.5]), "advantages",
     ["advantages[1]=NaN at valid position 1 (loss_mask is 1)", "finite"], {}),
    ("inf_old_logprob_valid", _good(old_logprobs=[-INF, -0.25, -1.0]), "old_logprobs",
     ["old_logprobs[0]=-Infinity at valid position 0"], {}),
    ("overflowing_old_logprob_valid", '{"step": 0, "group_id": "g0", "prompt_ids": [1], "response_ids": [4],'
     ' "loss_mask": [1], "advantages": [0.5], "old_logprobs": [-1e400]}', "old_logprobs",
     ["old_logprobs[0]=-Infinity at valid position 0"], {}),
    ("huge_int_advantage_valid", _good(advantages=[0.5, 10 ** 400, 0.5]), "advantages",
     ["advantages[1]=Infinity at valid position 1"], {}),
    ("int_with_too_many_digits", '{"step": ' + "9" * 5000 + "}", None, ["malformed JSON", "digits"], {}),
    ("nan_ref_valid", _good(ref_logprobs=[-2.5, NAN, -1.5]), "ref_logprobs",
     ["ref_logprobs[1]=NaN at valid position 1"], {}),
    ("nan_rollout_logprobs_valid", _good(rollout_logprobs=[-2.5, NAN, -1.5]), "rollout_logprobs",
     ["rollout_logprobs[1]=NaN at valid position 1"], {}),
    ("rollout_logprobs_length", _good(rollout_logprobs=[-1.0]), "rollout_logprobs",
     ["has 1 entries but response_ids has 3"], {}),
    ("rollout_logprobs_string_element", _good(rollout_logprobs=[-1.0, "x", -1.0]), "rollout_logprobs",
     ['rollout_logprobs[1] is "x" (a string)', "expected a number"], {}),
    ("missing_ref_require_ref", _good(ref_logprobs=...), "ref_logprobs", ["require_ref=True"], {"require_ref": True}),
    ("null_ref_require_ref", _good(ref_logprobs=None), "ref_logprobs", ["require_ref=True"], {"require_ref": True}),
    ("group_id_in_two_steps", _good(group_id="a", step=1), "group_id",
     ['group "a" (a string) is in step 1 here but in step 0 at line 1', "one step"], {}),
]


@pytest.mark.parametrize("bad, field, words, kwargs", [c[1:] for c in LINE_CASES], ids=[c[0] for c in LINE_CASES])
def test_bad_line_is_named(tmp_path, bad, field, words, kwargs):
    path = _write(tmp_path, GOOD + [bad])
    with pytest.raises(RolloutFormatError) as excinfo:
        load_rollouts(path, **kwargs)
    _expect(excinfo, path, 3, field)
    for word in words:
        assert word in str(excinfo.value), (word, str(excinfo.value))


# ----------------------------------------------------------------------------- value checks, per field
# The values are judged by RolloutBatch's checker when the step is packed; each fault must still
# come back as file:line, field and position. The bad line is line 3 and its rollout is index 2
# of step 0, so a message naming the rollout index instead of the line cannot pass.

WITH_ROLLOUT = {"rollout_logprobs": [-2.25, -0.5, -1.25]}  # every optional field present
NUMBER_FIELDS = ["advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs"]
LOGPROB_FIELDS = ["old_logprobs", "ref_logprobs", "rollout_logprobs"]


def _load_refused(tmp_path, field, value, position, **kwargs):
    """A good file whose line 3 has ``field[position] = value``: the loader's error, checked for
    path, line 3 and field; its message is returned."""
    values = list(_good(**WITH_ROLLOUT)[field])
    values[position] = value
    path = _write(tmp_path, [_good(group_id="a", **WITH_ROLLOUT), _good(group_id="b", **WITH_ROLLOUT),
                             _good(**{**WITH_ROLLOUT, field: values})])
    with pytest.raises(RolloutFormatError) as excinfo:
        load_rollouts(path, **kwargs)
    _expect(excinfo, path, 3, field)
    return str(excinfo.value)


@pytest.mark.parametrize("value, shown", [(NAN, "NaN"), (INF, "Infinity"), (-INF, "-Infinity")])
@pytest.mark.parametrize("field", NUMBER_FIELDS)
def test_non_finite_at_a_valid_position_is_refused(tmp_path, field, value, shown):
    """Catches a number field left out of the checker's finiteness loop (rollout_logprobs), or a
    checker fault not mapped back to its line and field."""
    message = _load_refused(tmp_path, field, value, 1)
    assert f"field '{field}': {field}[1]={shown} at valid position 1 (loss_mask is 1)" in message, message
    assert "expected a finite number" in message


@pytest.mark.parametrize("field", LOGPROB_FIELDS)
def test_positive_logprob_at_valid_position_is_refused(tmp_path, field):
    """log p > 0 is a probability above 1: refused where loss_mask is 1 (loss_mask is [1, 1, 0]).
    Catches a log-prob field missing from the sign check."""
    message = _load_refused(tmp_path, field, 0.01, 1)
    assert f"field '{field}': {field}[1]=0.01 at valid position 1 is above 0" in message, message
    assert "log-probability <= 0" in message


@pytest.mark.parametrize("value", [2, -1])
@pytest.mark.parametrize("field", ["loss_mask", "numerator_mask"])
def test_mask_not_0_or_1_is_refused(tmp_path, field, value):
    """Catches a mask converted to bool before its values are checked (2 and -1 would be True)."""
    message = _load_refused(tmp_path, field, value, 1)
    assert f"field '{field}': {field}[1]={value}; expected 0 or 1" in message, message


@pytest.mark.parametrize("field", PER_TOKEN_FIELDS)
@pytest.mark.parametrize("extra", [-1, 1, 5])
def test_per_token_field_of_the_wrong_length_is_refused(tmp_path, field, extra):
    """One entry too many must not be cut to the response length silently, one too few must not
    shift the next rollout's values. Catches a per-token field missing from the length check."""
    good = _good(**WITH_ROLLOUT)
    changed = good[field][:extra] if extra < 0 else good[field] + [0] * extra  # 0: valid in every field
    path = _write(tmp_path, GOOD + [_good(**{**WITH_ROLLOUT, field: changed})])
    with pytest.raises(RolloutFormatError) as excinfo:
        load_rollouts(path)
    _expect(excinfo, path, 3, field)
    message = str(excinfo.value)
    assert f"{path}:3: field '{field}': " in message
    assert f"has {3 + extra} entries but response_ids has 3" in message, message


@pytest.mark.parametrize("field", LOGPROB_FIELDS)
def test_positive_logprob_float_noise_and_masked_positions_load(tmp_path, field):
    """Up to 1e-4 above 0 is float noise; masked positions are not checked at all."""
    noise = list(_good(**WITH_ROLLOUT)[field])
    noise[0] = 5e-5
    noise[1] = 1e-4  # the bound itself is accepted
    masked = list(_good(**WITH_ROLLOUT)[field])
    masked[2] = 0.5  # loss_mask[2] is 0
    path = _write(tmp_path, [_good(group_id="a", **{**WITH_ROLLOUT, field: noise}),
                             _good(group_id="b", **{**WITH_ROLLOUT, field: masked})])
    batch = load_rollouts(path)[0]
    loaded = getattr(batch, field)
    assert loaded[:2].tolist() == torch.tensor([5e-5, 1e-4], dtype=torch.float32).tolist()
    assert float(loaded[3 + 2]) == 0.5  # rollout b, position 2
    message = _load_refused(tmp_path, field, 1.5e-4, 1)  # just above the bound
    assert f"field '{field}': {field}[1]=0.00015 at valid position 1" in message, message


def test_writer_refuses_positive_logprob(tmp_path):
    path = tmp_path / NAME
    with pytest.raises(RolloutFormatError) as excinfo:
        write_rollouts(path, {4: [_rollout(), _rollout(old_logprobs=[-1.0, 0.3, -1.0])]})
    assert str(excinfo.value).startswith(
        f"{path}: step 4: rollout 1: field 'old_logprobs': old_logprobs[1]=0.3 at valid position 1 ")
    assert (excinfo.value.step, excinfo.value.rollout, excinfo.value.field) == (4, 1, "old_logprobs")
    assert not path.exists()


@pytest.mark.parametrize("field, value, words", [
    ("advantages", NAN, "advantages[1]=NaN at valid position 1"),
    ("rollout_logprobs", 0.2, "rollout_logprobs[1]=0.2 at valid position 1"),
    ("numerator_mask", 2, "numerator_mask[1]=2; expected 0 or 1"),
    ("ref_logprobs", None, "ref_logprobs has 2 entries but response_ids has 3"),
])
def test_writer_refuses_values_with_the_loaders_rules(tmp_path, field, value, words):
    """Catches the writer skipping the checker (it would write a file the loader then refuses)."""
    record = _good(**WITH_ROLLOUT)
    if value is None:
        record[field] = record[field][:2]
    else:
        record[field][1] = value
    del record["step"]
    path = tmp_path / NAME
    with pytest.raises(RolloutFormatError) as excinfo:
        write_rollouts(path, {0: [_rollout(group_id="a"), _rollout(group_id="b"), Rollout(**record)]})
    assert str(excinfo.value).startswith(f"{path}: step 0: rollout 2: field '{field}': {words}"), str(excinfo.value)
    assert not path.exists()


def test_earliest_bad_line_is_named_across_steps(tmp_path):
    """Steps are packed and checked one by one; the fault of the earliest line must be named, not
    the first step's. Catches raising step 0's fault (line 4) before step 5's (line 2)."""
    lines = [_good(group_id="a"),
             _good(step=5, group_id="b", advantages=[0.5, NAN, 0.5]),  # line 2, step 5, rollout 0
             _good(group_id="c"),
             _good(group_id="d", loss_mask=[1, 7, 0])]  # line 4, step 0, rollout 2
    path = _write(tmp_path, lines)
    with pytest.raises(RolloutFormatError) as excinfo:
        load_rollouts(path)
    _expect(excinfo, path, 2, "advantages")
    assert "advantages[1]=NaN" in str(excinfo.value)


def test_earliest_bad_line_is_named_within_a_step(tmp_path):
    """Within a step the checker's stages (lengths, masks, values) all run and the earliest rollout
    wins. Catches naming line 4's length fault (an earlier stage) before line 3's NaN."""
    lines = GOOD + [_good(group_id="c", old_logprobs=[NAN, -1.0, -1.0]), _good(group_id="d", loss_mask=[1])]
    path = _write(tmp_path, lines)
    with pytest.raises(RolloutFormatError) as excinfo:
        load_rollouts(path)
    _expect(excinfo, path, 3, "old_logprobs")
    assert "old_logprobs[0]=NaN at valid position 0" in str(excinfo.value)


@pytest.mark.parametrize("contents", ["", "\n  \n\t\n"], ids=["empty", "blank_lines_only"])
def test_file_without_rollouts(tmp_path, contents):
    path = tmp_path / NAME
    path.write_text(contents)
    with pytest.raises(RolloutFormatError, match="has no rollouts") as excinfo:
        load_rollouts(path)
    _expect(excinfo, path, None, None)


def test_missing_file(tmp_path):
    path = tmp_path / NAME
    with pytest.raises(RolloutFormatError, match=re.escape("No such file or directory")) as excinfo:
        load_rollouts(path)
    _expect(excinfo, path, None, None)


def test_unreadable_file(tmp_path):
    path = tmp_path / NAME
    path.mkdir()  # a directory: open() fails even for root, unlike chmod 000
    with pytest.raises(RolloutFormatError, match="cannot read the rollout file") as excinfo:
        load_rollouts(path)
    _expect(excinfo, path, None, None)


def test_first_bad_line_is_reported_and_nothing_returned(tmp_path):
    lines = [_good(group_id=f"g{i}", step=i // 2) for i in range(4)]
    lines.insert(2, "")  # a blank physical line still counts: the bad line below is line 6
    lines.append(_good(group_id="bad", loss_mask=[1, 3, 0]))  # line 6: the first bad line
    lines += [_good(group_id=f"h{i}") for i in range(3)]  # fine lines after it
    lines.append(_good(group_id="worse", prompt_ids="oops"))  # a later bad line: not reported
    path = _write(tmp_path, lines)
    result = "untouched"
    with pytest.raises(RolloutFormatError) as excinfo:
        result = load_rollouts(path)
    _expect(excinfo, path, 6, "loss_mask")
    assert result == "untouched"  # all-or-nothing: no partial dict escapes


# ----------------------------------------------------------------------------- round trips

def _steps():
    """Four steps: with ref and numerator, without ref, without numerator, integer group ids."""
    def regroup(rollouts, prefix):
        for r in rollouts:
            r.group_id = f"{prefix}/{r.group_id}"
        return rollouts

    s0 = regroup(fixed_step(seed=1), "s0")
    s1 = regroup(fixed_step(seed=2, with_ref=False), "s1")
    s3 = regroup(fixed_step(seed=3), "s3")
    for r in s3:
        r.numerator_mask = None
    s7 = fixed_step(seed=4)[:5]
    for i, r in enumerate(s7):
        r.group_id = 100 + i % 2
    return {7: s7, 0: s0, 1: s1, 3: s3}  # unsorted on purpose


def _same(a: RolloutBatch, b: RolloutBatch) -> bool:
    """Field-by-field equality of two batches (tensors equal in dtype, shape and values)."""
    for f in dataclasses.fields(RolloutBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def test_round_trip(tmp_path):
    steps = _steps()
    path = tmp_path / NAME
    assert write_rollouts(path, steps) == path
    loaded = load_rollouts(path, vocab_size=VOCAB)
    assert list(loaded) == [0, 1, 3, 7]
    for k in loaded:
        assert isinstance(loaded[k], RolloutBatch)
        assert _same(loaded[k], RolloutBatch.from_rollouts(steps[k]))  # every field, in order
    assert loaded[1].ref_logprobs is None
    assert loaded[3].numerator_mask is None
    assert loaded[7].group_labels == [100, 101] and loaded[7].group_index.tolist() == [0, 1, 0, 1, 0]
    assert write_rollouts(tmp_path / "again.jsonl", steps)  # the writer is deterministic
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()


def test_loaded_steps_plan(tmp_path):
    """What the loader accepts, the planner accepts (a KL loss, vocabulary known)."""
    path = write_rollouts(tmp_path / NAME, _steps())
    loaded = load_rollouts(path, vocab_size=VOCAB)
    for k in (0, 3, 7):
        plan = plan_step(loaded[k], PGLossConfig(mode="seq_mean", kl_coef=0.1), PlanConfig(dp_size=2, vocab_size=VOCAB))
        assert plan.stats["sequences"] == len(loaded[k])


def test_non_finite_at_masked_positions_loads_as_zero(tmp_path):
    line = _good(loss_mask=[1, 0, 0], numerator_mask=None, advantages=[0.5, NAN, INF],
                 old_logprobs=[-1.0, -INF, NAN], ref_logprobs=[-1.0, NAN, -INF], rollout_logprobs=[-1.0, INF, NAN])
    path = _write(tmp_path, ["", line, "   "])
    text = path.read_text()
    assert "NaN" in text and "Infinity" in text  # the JSON tokens Python writes
    batch = load_rollouts(path)[0]
    assert len(batch) == 1
    for name in NUMBER_FIELDS:
        assert getattr(batch, name).tolist() == [0.5 if name == "advantages" else -1.0, 0.0, 0.0], name
    assert batch.numerator_mask is None


def test_writer_writes_strict_json(tmp_path):
    r = Rollout([1], [2, 3], [1, 0], [1.0, NAN], [-1.0, -INF], "g", ref_logprobs=[-1.0, INF])
    path = write_rollouts(tmp_path / NAME, {0: [r]})
    record = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON token {c}"))
    assert record["advantages"] == [1.0, 0.0] and record["old_logprobs"] == [-1.0, 0.0]
    assert record["ref_logprobs"] == [-1.0, 0.0]
    back = load_rollouts(path)[0]
    assert back.advantages.tolist() == [1.0, 0.0] and back.old_logprobs.tolist() == [-1.0, 0.0]
    assert back.ref_logprobs.tolist() == [-1.0, 0.0]


def test_all_masked_step_and_loose_layout_are_accepted(tmp_path):
    """A step with no valid token has weight 0 (allowed); blank lines, CRLF, a BOM, interleaved
    steps and integer-valued advantages are fine."""
    lines = [
        "\ufeff" + json.dumps(_good(step=2, group_id="z", loss_mask=[0, 0, 0], numerator_mask=None)),
        "",
        json.dumps(_good(step=0, group_id=0, advantages=[1, 0, -1])),
        json.dumps(_good(step=2, group_id="z")),
    ]
    path = tmp_path / NAME
    path.write_bytes("\r\n".join(lines).encode("utf-8"))
    loaded = load_rollouts(path)
    assert list(loaded) == [0, 2] and len(loaded[2]) == 2
    assert loaded[0].advantages.tolist() == [1.0, 0.0, -1.0]
    assert loaded[0].advantages.dtype == torch.float32
    assert loaded[2].numerator_mask.tolist() == [False] * 3 + [True, False, False]  # None -> loss_mask


# ----------------------------------------------------------------------------- writer

def _rollout(**changes):
    record = _good(**changes)
    del record["step"]
    return Rollout(**record)


@pytest.mark.parametrize("steps, step, rollout, field, words", [
    ({1: [_rollout(), _rollout(loss_mask=[1, 1])]}, 1, 1, "loss_mask", ["has 2 entries"]),
    ({0: [_rollout(group_id="a")], 1: [_rollout(group_id="a")]}, 1, 0, "group_id", ["also in step 0"]),
    ({2: [_rollout(group_id=1.5)]}, 2, 0, "group_id", ["string or an integer"]),
    ({0: []}, 0, None, None, ["non-empty list"]),
], ids=["length", "group_in_two_steps", "float_group_id", "empty_step"])
def test_writer_refuses_bad_steps_and_keeps_the_old_file(tmp_path, steps, step, rollout, field, words):
    path = tmp_path / NAME
    path.write_text("old contents\n")
    with pytest.raises(RolloutFormatError) as excinfo:
        write_rollouts(path, steps)
    err = excinfo.value
    prefix = f"{path}: step {step}: " + (f"rollout {rollout}: " if rollout is not None else "")
    assert str(err).startswith(prefix + (f"field '{field}': " if field else "")), str(err)
    assert (err.line, err.step, err.rollout, err.field) == (None, step, rollout, field)
    assert all(w in str(err) for w in words), str(err)
    assert path.read_text() == "old contents\n"
    assert os.listdir(tmp_path) == [NAME]  # no temp file left behind


def test_writer_is_atomic_and_keeps_normal_permissions(tmp_path):
    path = tmp_path / NAME
    write_rollouts(path, {0: [_rollout()]})
    write_rollouts(path, {5: [_rollout(group_id="x")]})  # replaces the file
    assert list(load_rollouts(path)) == [5]
    assert os.listdir(tmp_path) == [NAME]
    plain = tmp_path / "plain"
    plain.write_text("")
    assert os.stat(path).st_mode & 0o777 == os.stat(plain).st_mode & 0o777  # not mkstemp's 0600


def test_error_pickles():
    err = RolloutFormatError("x.jsonl", "is bad; expected good", line=4, field="step")
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) == "x.jsonl:4: field 'step': is bad; expected good"
    assert (back.path, back.line, back.field) == ("x.jsonl", 4, "step")


_finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)
_logprob = st.floats(min_value=-1e6, max_value=1e-4, allow_nan=False)  # log p <= 0, up to float noise


@st.composite
def _random_steps(draw):
    steps = {}
    for k in draw(st.lists(st.integers(0, 50), min_size=1, max_size=3, unique=True)):
        rollouts = []
        for i in range(draw(st.integers(1, 3))):
            n = draw(st.integers(1, 6))
            mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
            rollouts.append(Rollout(
                prompt_ids=draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4)),
                response_ids=draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)),
                loss_mask=mask,
                advantages=draw(st.lists(_finite, min_size=n, max_size=n)),
                old_logprobs=draw(st.lists(_logprob, min_size=n, max_size=n)),
                group_id=draw(st.sampled_from([f"{k}-{i % 2}", k * 10 + i % 2])),
                ref_logprobs=draw(st.none() | st.lists(_logprob, min_size=n, max_size=n)),
                numerator_mask=draw(st.none() | st.just([m & (j % 2) for j, m in enumerate(mask)])),
            ))
        steps[k] = rollouts
    return steps


@settings(max_examples=40, deadline=None)
@given(steps=_random_steps())
def test_round_trip_property(tmp_path_factory, steps):
    path = tmp_path_factory.mktemp("prop") / NAME
    loaded = load_rollouts(write_rollouts(path, steps), vocab_size=VOCAB)
    assert list(loaded) == sorted(steps)
    assert all(_same(loaded[k], RolloutBatch.from_rollouts(steps[k])) for k in steps)
    assert all(math.isfinite(v) for batch in loaded.values() for v in batch.advantages.tolist())
