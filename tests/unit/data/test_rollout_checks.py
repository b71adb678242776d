"""The one rollout checker: ``RolloutBatch`` checks itself on construction (``__post_init__``),
``RolloutBatch.from_rollouts`` packs records and lets it judge them, ``check_vocabulary`` bounds
token ids. Every fault names the first offending rollout, the field and the position; float noise
up to 1e-4 and anything at masked positions pass."""
import copy
import dataclasses
import math
import pickle

import pytest
import torch

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.data.rollouts import PER_TOKEN_FIELDS, PlanError, Rollout, RolloutBatch
from megatron_pg_agg.data.synthetic import synthetic_rollouts
from tests.support.rollouts import VOCAB, fixed_step

LOGPROB_FIELDS = ["old_logprobs", "ref_logprobs", "rollout_logprobs"]
NUMBER_FIELDS = ["advantages"] + LOGPROB_FIELDS
MASK_FIELDS = ["loss_mask", "numerator_mask"]
NAN, INF = float("nan"), float("inf")


def _step():
    """The fixed step with every optional per-token field (rollout_logprobs added)."""
    rollouts = fixed_step()
    for r in rollouts:
        r.rollout_logprobs = [lp - 0.1 for lp in r.old_logprobs]
    return rollouts


def _positions(rollouts, valid):
    """(rollout, position) pairs whose loss_mask is ``valid``, past position 0 and rollout 0 (so a
    message that names index 0 by mistake cannot pass)."""
    return [(i, j) for i, r in enumerate(rollouts) if i > 0
            for j, m in enumerate(r.loss_mask) if j > 0 and bool(m) == valid]


def _with(rollouts, i, j, field, value):
    out = copy.deepcopy(rollouts)
    values = list(getattr(out[i], field))
    values[j] = value
    setattr(out[i], field, values)
    return out


def _refused(rollouts, i, j, field, start, **kwargs):
    """from_rollouts refuses ``rollouts`` naming rollout ``i``, ``field`` and position ``j``."""
    with pytest.raises(PlanError) as excinfo:
        RolloutBatch.from_rollouts(rollouts, **kwargs)
    err = excinfo.value
    assert str(err).startswith(f"rollout {i}: {start}"), str(err)
    assert (err.rollout, err.field, err.position) == (i, field, j), str(err)
    return err


def _flat_index(batch, i, j):
    return int(batch.response_lengths[:i].sum()) + j


def _fields(batch):
    """The constructor arguments of ``batch``, tensors cloned (mutating them leaves ``batch`` alone)."""
    return {f.name: (v.clone() if isinstance(v, torch.Tensor) else v)
            for f in dataclasses.fields(batch) for v in [getattr(batch, f.name)]}


# ----------------------------------------------------------------------------- from_rollouts, every check x field

@pytest.mark.parametrize("value, shown", [(NAN, "NaN"), (INF, "Infinity"), (-INF, "-Infinity")])
@pytest.mark.parametrize("field", NUMBER_FIELDS)
def test_from_rollouts_refuses_non_finite_at_a_valid_position(field, value, shown):
    """Catches a field left out of the finiteness loop (rollout_logprobs was once), or a check
    that reads masked instead of valid positions."""
    rollouts = _step()
    i, j = _positions(rollouts, True)[-1]
    err = _refused(_with(rollouts, i, j, field, value), i, j, field, f"{field}[{j}]={shown} at valid position {j} ")
    assert "finite" in str(err)
    mi, mj = _positions(rollouts, False)[-1]
    batch = RolloutBatch.from_rollouts(_with(rollouts, mi, mj, field, value))  # masked: allowed
    assert float(getattr(batch, field)[_flat_index(batch, mi, mj)]) == 0.0  # stored as 0.0


@pytest.mark.parametrize("field", LOGPROB_FIELDS)
def test_from_rollouts_refuses_a_positive_logprob_at_a_valid_position(field):
    """Catches a log-prob field left out of the sign check, or the tolerance applied the wrong way."""
    rollouts = _step()
    i, j = _positions(rollouts, True)[-1]
    _refused(_with(rollouts, i, j, field, 0.01), i, j, field,
             f"{field}[{j}]=0.01 at valid position {j} is above 0 (a probability above 1)")
    with pytest.raises(PlanError, match=rf"^rollout {i}: {field}\[{j}\]=0\.01 "):
        plan_step(_with(rollouts, i, j, field, 0.01), PGLossConfig(kl_coef=0.1), PlanConfig(vocab_size=VOCAB))
    _refused(_with(rollouts, i, j, field, 2e-4), i, j, field, f"{field}[{j}]=0.0002 ")


@pytest.mark.parametrize("field", LOGPROB_FIELDS)
def test_from_rollouts_accepts_float_noise_and_masked_positions(field):
    """Catches a tolerance of 0 (float noise refused) or a sign check at masked positions."""
    rollouts = _step()
    (i, j), (mi, mj) = _positions(rollouts, True)[-1], _positions(rollouts, False)[-1]
    ok = _with(_with(rollouts, i, j, field, 5e-5), mi, mj, field, 0.5)
    RolloutBatch.from_rollouts(ok, vocab_size=VOCAB)
    plan_step(ok, PGLossConfig(kl_coef=0.1), PlanConfig(vocab_size=VOCAB))


@pytest.mark.parametrize("value", [2, -1, 1.5])
@pytest.mark.parametrize("field", MASK_FIELDS)
def test_from_rollouts_refuses_a_mask_that_is_not_0_or_1(field, value):
    """Catches masks converted to bool before their values are checked (2 and 1.5 would pass as
    True), or packed as int64 (1.5 would be truncated to 1)."""
    rollouts = _step()
    i, j = _positions(rollouts, True)[-1]
    err = _refused(_with(rollouts, i, j, field, value), i, j, field, f"{field}[{j}]={value:g}; expected 0 or 1")
    assert err.problem == f"{field}[{j}]={value:g}; expected 0 or 1"


@pytest.mark.parametrize("delta", [-1, 1, 3])
@pytest.mark.parametrize("field", PER_TOKEN_FIELDS)
def test_from_rollouts_refuses_a_per_token_field_of_the_wrong_length(field, delta):
    """Catches a per-token field missing from the per-record length comparison (an entry too many
    or too few would shift every later rollout's values silently)."""
    rollouts = _step()
    i = len(rollouts) - 2
    r = rollouts[i]
    n = len(r.response_ids)
    values = list(getattr(r, field))
    setattr(r, field, values[:n + delta] if delta < 0 else values + [0] * delta)
    with pytest.raises(PlanError) as excinfo:
        RolloutBatch.from_rollouts(rollouts)
    err = excinfo.value
    assert str(err) == (f"rollout {i}: {field} has {n + delta} entries but response_ids has {n}; "
                        "expected one per response token")
    assert (err.rollout, err.field) == (i, field)


@pytest.mark.parametrize("field", ["prompt_ids", "response_ids"])
def test_from_rollouts_refuses_an_empty_prompt_or_response(field):
    """Catches the length comparison missing an empty prompt (the first response token needs a
    prompt position) or an empty response (reported as such, not as a length mismatch)."""
    rollouts = _step()
    setattr(rollouts[3], field, [])
    if field == "response_ids":
        for name in PER_TOKEN_FIELDS:
            setattr(rollouts[3], name, [])
    with pytest.raises(PlanError, match=rf"^rollout 3: {field} is empty; expected at least one token") as excinfo:
        RolloutBatch.from_rollouts(rollouts)
    assert excinfo.value.field == field


@pytest.mark.parametrize("field", ["prompt_ids", "response_ids"])
def test_vocabulary_is_checked_where_given(field):
    """Catches from_rollouts ignoring vocab_size, or check_vocabulary naming the wrong position."""
    rollouts = _step()
    i, j = len(rollouts) - 1, 1
    bad = _with(rollouts, i, j, field, VOCAB)
    RolloutBatch.from_rollouts(bad)  # no vocabulary known: fine
    _refused(bad, i, j, field, f"{field}[{j}]={VOCAB} is outside the vocabulary [0, {VOCAB})", vocab_size=VOCAB)
    batch = RolloutBatch.from_rollouts(bad)
    with pytest.raises(PlanError, match=rf"^rollout {i}: {field}\[{j}\]={VOCAB} is outside"):
        batch.check_vocabulary(VOCAB)
    _refused(_with(rollouts, i, j, field, -3), i, j, field, f"{field}[{j}]=-3 is negative")  # always


def test_from_rollouts_names_the_first_bad_rollout_across_stages():
    """Catches from_rollouts raising the first failing stage (lengths are checked before values)
    instead of the earliest bad rollout: rollout 2's NaN must be named before rollout 6's length."""
    rollouts = _step()
    (i, j) = next((i, j) for i, j in _positions(rollouts, True) if i < 6)
    bad = _with(rollouts, i, j, "advantages", NAN)
    bad[6].old_logprobs = bad[6].old_logprobs[:-1]
    _refused(bad, i, j, "advantages", f"advantages[{j}]=NaN")


def test_from_rollouts_checks_a_field_only_some_rollouts_have():
    """Catches a partially given field being dropped before it is checked: it is left out of the
    batch (the step cannot use it) but a bad value where it is given is still refused."""
    rollouts = _step()
    rollouts[0].ref_logprobs = None
    assert RolloutBatch.from_rollouts(rollouts).ref_logprobs is None
    i, j = _positions(rollouts, True)[-1]
    _refused(_with(rollouts, i, j, "ref_logprobs", 0.5), i, j, "ref_logprobs", f"ref_logprobs[{j}]=0.5 ")


@pytest.mark.parametrize("field, value", [("advantages", "0.5"), ("loss_mask", None), ("advantages", None)])
def test_from_rollouts_names_a_value_that_is_not_a_number(field, value):
    rollouts = _step()
    if value is None and field == "advantages":
        rollouts[4].advantages = None
        with pytest.raises(PlanError, match="^rollout 4: advantages is None; expected a sequence"):
            RolloutBatch.from_rollouts(rollouts)
        return
    bad = _with(rollouts, 4, 0, field, value)
    with pytest.raises(PlanError, match=rf"^rollout 4: {field} holds a value that is not a number") as excinfo:
        RolloutBatch.from_rollouts(bad)
    assert excinfo.value.field == field


def test_empty_step_is_refused():
    with pytest.raises(PlanError, match="^the step has no rollouts$"):
        RolloutBatch.from_rollouts([])


# ----------------------------------------------------------------------------- a batch built directly

def _bad_batch_cases():
    """(id, mutation of the constructor arguments, (rollout, field, position) or None, words)."""
    rollouts = _step()
    batch = RolloutBatch.from_rollouts(rollouts)
    i, j = _positions(rollouts, True)[-1]
    k = _flat_index(batch, i, j)
    cases = []
    for name in NUMBER_FIELDS:
        cases.append((f"nan_{name}", lambda f, name=name: f[name].__setitem__(k, NAN), (i, name, j),
                      f"{name}[{j}]=NaN at valid position {j}"))
    for name in LOGPROB_FIELDS:
        cases.append((f"positive_{name}", lambda f, name=name: f[name].__setitem__(k, 0.01), (i, name, j),
                      f"{name}[{j}]=0.01 at valid position {j}"))
    mi, mj = _positions(rollouts, False)[-1]
    mk = _flat_index(batch, mi, mj)
    cases.append(("numerator_outside_loss_mask", lambda f: f["numerator_mask"].__setitem__(mk, True),
                  (mi, "numerator_mask", mj), f"numerator_mask[{mj}] is 1 where loss_mask is 0"))
    cases.append(("negative_response_token", lambda f: f["response_tokens"].__setitem__(k, -1),
                  (i, "response_ids", j), f"response_ids[{j}]=-1 is negative"))
    cases.append(("negative_prompt_token", lambda f: f["prompt_tokens"].__setitem__(-1, -2),
                  (len(rollouts) - 1, "prompt_ids", len(rollouts[-1].prompt_ids) - 1), "=-2 is negative"))
    for name in ("response_tokens",) + PER_TOKEN_FIELDS:
        cases.append((f"size_{name}", lambda f, name=name: f.__setitem__(name, f[name][:-1]), None,
                      f"{name} holds {batch.loss_mask.numel() - 1} entries but response_lengths sum to"))
    cases.append(("size_prompt_tokens", lambda f: f.__setitem__("prompt_tokens", f["prompt_tokens"][1:]), None,
                  "prompt_tokens holds"))
    cases.append(("empty_prompt", lambda f: f["prompt_lengths"].__setitem__(2, 0), (2, "prompt_ids", None),
                  "prompt_ids is empty"))
    cases.append(("negative_response_length", lambda f: f["response_lengths"].__setitem__(2, -1),
                  (2, "response_ids", None), "response_ids has -1 tokens"))
    cases.append(("group_index_size", lambda f: f.__setitem__("group_index", f["group_index"][:-1]), None,
                  "group_index holds"))
    cases.append(("group_label_out_of_range", lambda f: f["group_index"].__setitem__(0, 99), None,
                  "group_labels has"))
    cases.append(("float_mask", lambda f: f.__setitem__("loss_mask", f["loss_mask"].float()), None,
                  "loss_mask is a 1-D torch.float32 tensor; expected a 1-D torch.bool tensor"))
    cases.append(("float64_advantages", lambda f: f.__setitem__("advantages", f["advantages"].double()), None,
                  "expected a 1-D torch.float32 tensor"))
    cases.append(("list_tokens", lambda f: f.__setitem__("response_tokens", f["response_tokens"].tolist()), None,
                  "response_tokens is list"))
    cases.append(("no_rollouts", lambda f: f.update({n: f[n][:0] for n in ("prompt_lengths", "response_lengths",
                                                                           "group_index")}), None,
                  "the step has no rollouts"))
    return batch, cases


_BATCH, _CASES = _bad_batch_cases()


@pytest.mark.parametrize("mutate, where, words", [c[1:] for c in _CASES], ids=[c[0] for c in _CASES])
def test_a_batch_built_with_bad_tensors_is_refused_at_construction(mutate, where, words):
    """Catches a check missing from RolloutBatch.__post_init__ (a batch built elsewhere, e.g. by a
    benchmark or a data pipeline, would reach the planner unchecked: it no longer re-checks)."""
    fields = _fields(_BATCH)
    RolloutBatch(**fields)  # the unmutated arguments are fine
    mutate(fields)
    with pytest.raises(PlanError) as excinfo:
        RolloutBatch(**fields)
    err = excinfo.value
    assert words in str(err), str(err)
    if where is not None:
        assert (err.rollout, err.field, err.position) == where, str(err)
        assert str(err).startswith(f"rollout {where[0]}: "), str(err)


def test_a_batch_names_the_first_bad_rollout_whichever_check_finds_it():
    """Catches __post_init__ raising the first failing check (finiteness runs before the sign
    check) instead of the earliest rollout: the later NaN must not hide the earlier positive log-prob."""
    rollouts = _step()
    batch = RolloutBatch.from_rollouts(rollouts)
    valid = _positions(rollouts, True)
    (i, j), (later_i, later_j) = valid[len(valid) // 2], valid[-1]
    assert later_i > i
    fields = _fields(batch)
    fields["advantages"][_flat_index(batch, later_i, later_j)] = NAN
    fields["old_logprobs"][_flat_index(batch, later_i, later_j)] = 0.5
    fields["old_logprobs"][_flat_index(batch, i, j)] = 0.01
    with pytest.raises(PlanError) as excinfo:
        RolloutBatch(**fields)
    assert str(excinfo.value).startswith(f"rollout {i}: old_logprobs[{j}]=0.01 at valid position {j} "), \
        str(excinfo.value)


def test_a_batch_accepts_float_noise_and_anything_at_masked_positions():
    """Catches a masked position judged (NaN and positive log-probs there carry no signal)."""
    rollouts = _step()
    batch = RolloutBatch.from_rollouts(rollouts)
    (i, j), (mi, mj) = _positions(rollouts, True)[-1], _positions(rollouts, False)[-1]
    fields = _fields(batch)
    for name in LOGPROB_FIELDS:
        fields[name][_flat_index(batch, i, j)] = 1e-4
        fields[name][_flat_index(batch, mi, mj)] = 0.5
    fields["advantages"][_flat_index(batch, mi, mj)] = NAN
    plan_step(RolloutBatch(**fields), PGLossConfig(kl_coef=0.1), PlanConfig(vocab_size=VOCAB))


def test_plan_error_pickles_with_its_location():
    err = PlanError("loss_mask[3]=2; expected 0 or 1", rollout=5, field="loss_mask", position=3)
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == str(err) == "rollout 5: loss_mask[3]=2; expected 0 or 1"
    assert (back.rollout, back.field, back.position, back.problem) == (5, "loss_mask", 3, err.problem)


def test_synthetic_rollouts_pass_the_checks():
    """The built-in synthetic steps (log-probs near -log(vocab)) are valid log-probs."""
    for vocab in (2, 128):
        for rollouts in synthetic_rollouts(num_steps=2, vocab_size=vocab).values():
            batch = RolloutBatch.from_rollouts(rollouts, vocab_size=vocab)
            assert float(batch.old_logprobs.max()) < 0 and float(batch.ref_logprobs.max()) < 0


def test_rollout_is_unchanged_by_packing():
    r = Rollout([1], [2, 3], [1, 0], [0.5, math.nan], [-1.0, -1.0], "g")
    RolloutBatch.from_rollouts([r])
    assert r.advantages[1] != r.advantages[1]  # the record keeps its NaN; only the batch stores 0.0
