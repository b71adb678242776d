"""In-memory rollout checks: ``check_rollout`` (lists of Rollout) and ``RolloutBatch.validate``
(flat tensors) refuse a log-prob above 0 at a valid position, naming rollout, field and position;
float noise up to 1e-4 and anything at masked positions pass."""
import copy

import pytest

from megatron_pg_agg.core.losses import PGLossConfig
from megatron_pg_agg.data.planner import PlanConfig, plan_step
from megatron_pg_agg.data.rollouts import PlanError
from megatron_pg_agg.data.rollouts import RolloutBatch, check_rollout
from megatron_pg_agg.data.synthetic import synthetic_rollouts

from tests.support.rollouts import VOCAB, fixed_step

FIELDS = ["old_logprobs", "ref_logprobs"]


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


@pytest.mark.parametrize("field", FIELDS)
def test_check_rollout_refuses_positive_logprob_at_valid_position(field):
    rollouts = fixed_step()
    for r_i, r in enumerate(rollouts):
        check_rollout(r_i, r, VOCAB)  # the fixture itself is fine
    i, j = _positions(rollouts, True)[-1]
    bad = _with(rollouts, i, j, field, 0.01)
    with pytest.raises(PlanError) as excinfo:
        check_rollout(i, bad[i], VOCAB)
    message = str(excinfo.value)
    assert message.startswith(f"rollout {i}: {field}[{j}]=0.01 at valid position {j} "), message
    with pytest.raises(PlanError, match=rf"^rollout {i}: {field}\[{j}\]=0\.01 "):
        plan_step(bad, PGLossConfig(kl_coef=0.1), PlanConfig(vocab_size=VOCAB))


@pytest.mark.parametrize("field", FIELDS)
def test_check_rollout_accepts_float_noise_and_masked_positions(field):
    rollouts = fixed_step()
    (i, j), (mi, mj) = _positions(rollouts, True)[-1], _positions(rollouts, False)[-1]
    ok = _with(_with(rollouts, i, j, field, 5e-5), mi, mj, field, 0.5)
    for r_i, r in enumerate(ok):
        check_rollout(r_i, r, VOCAB)
    plan_step(ok, PGLossConfig(kl_coef=0.1), PlanConfig(vocab_size=VOCAB))
    with pytest.raises(PlanError, match=rf"rollout {i}: {field}\[{j}\]=0\.0002 "):
        check_rollout(i, _with(rollouts, i, j, field, 2e-4)[i], VOCAB)


def _flat_index(batch, i, j):
    return int(batch.response_lengths[:i].sum()) + j


@pytest.mark.parametrize("field", FIELDS)
def test_batch_validate_names_the_first_positive_logprob(field):
    rollouts = fixed_step()
    batch = RolloutBatch.from_rollouts(rollouts, vocab_size=VOCAB)
    batch.validate(vocab_size=VOCAB)
    valid = _positions(rollouts, True)
    (i, j), (later_i, later_j) = valid[len(valid) // 2], valid[-1]
    assert later_i > i
    t = getattr(batch, field)
    t[_flat_index(batch, later_i, later_j)] = 0.5  # a later offender: the first must be named
    t[_flat_index(batch, i, j)] = 0.01
    with pytest.raises(PlanError) as excinfo:
        batch.validate(vocab_size=VOCAB)
    assert str(excinfo.value).startswith(f"rollout {i}: {field}[{j}]=0.01 at valid position {j} "), str(excinfo.value)
    with pytest.raises(PlanError, match=rf"^rollout {i}: {field}\[{j}\]=0\.01 "):
        plan_step(batch, PGLossConfig(kl_coef=0.1), PlanConfig(vocab_size=VOCAB))


@pytest.mark.parametrize("field", FIELDS)
def test_batch_validate_accepts_float_noise_and_masked_positions(field):
    rollouts = fixed_step()
    batch = RolloutBatch.from_rollouts(rollouts, vocab_size=VOCAB)
    (i, j), (mi, mj) = _positions(rollouts, True)[-1], _positions(rollouts, False)[-1]
    t = getattr(batch, field)
    t[_flat_index(batch, i, j)] = 5e-5
    t[_flat_index(batch, mi, mj)] = 0.5
    batch.validate(vocab_size=VOCAB)
    plan_step(batch, PGLossConfig(kl_coef=0.1), PlanConfig(vocab_size=VOCAB))
    t[_flat_index(batch, i, j)] = 2e-4
    with pytest.raises(PlanError, match=rf"rollout {i}: {field}\[{j}\]="):
        batch.validate(vocab_size=VOCAB)


def test_synthetic_rollouts_pass_the_checks():
    """The built-in synthetic steps (log-probs near -log(vocab)) are valid log-probs."""
    for vocab in (2, 128):
        for rollouts in synthetic_rollouts(num_steps=2, vocab_size=vocab).values():
            batch = RolloutBatch.from_rollouts(rollouts, vocab_size=vocab)
            batch.validate(vocab_size=vocab)
            assert float(batch.old_logprobs.max()) < 0 and float(batch.ref_logprobs.max()) < 0
