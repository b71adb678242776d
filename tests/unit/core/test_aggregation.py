"""The aggregation contract: the public fixture, packed vs padded, dtypes, NaN safety."""
from fractions import Fraction

import pytest
import torch

from megatron_pg_agg import aggregate, token_weights, weighted_sum
from tests.support.reference import reference_objective

# The AReaL PR's public fixture and its hand-computed objectives.
LOSS = [[1, 3, 0, 0], [2, 4, 6, 0], [10, 0, 0, 0]]
MASK = [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]
GROUPS = [2, 1]
EXPECTED = {
    "token_mean": (Fraction(13, 3), 6, {}),
    "seq_mean": (Fraction(16, 3), 3, {}),
    "prompt_mean": (Fraction(33, 5), 2, {"group_sizes": GROUPS}),
    "constant": (Fraction(13, 6), 3, {"divisor": 4}),
}


def _packed(loss, mask):
    rows = [sum(r) for r in MASK]  # this fixture's valid tokens are a prefix of each row
    flat_loss = torch.cat([torch.tensor(r[:n], dtype=loss.dtype) for r, n in zip(LOSS, rows)])
    flat_mask = torch.cat([torch.tensor(r[:n]) for r, n in zip(MASK, rows)])
    cu = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    return flat_loss, flat_mask, cu


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_public_fixture_padded_packed_and_token_form(mode):
    value, weight, kw = EXPECTED[mode]
    loss, mask = torch.tensor(LOSS, dtype=torch.float32), torch.tensor(MASK)
    mean, w = aggregate(loss, mask, mode=mode, **kw)
    assert w.dtype == torch.int32 and int(w) == weight
    assert float(mean) == pytest.approx(float(value), rel=1e-6)

    flat_loss, flat_mask, cu = _packed(loss, mask)
    pmean, pw = aggregate(flat_loss, flat_mask, mode=mode, cu_seqlens=cu, **kw)
    assert int(pw) == weight and float(pmean) == pytest.approx(float(mean), rel=1e-7)

    tw = token_weights(mask, mode=mode, **kw)
    assert tw.coef.dtype == torch.float32 and tw.count.dtype == torch.int32
    assert tw.coef.shape == mask.shape == tw.count.shape
    s, c = weighted_sum(loss, mask, tw)
    assert int(c) == weight and float(s / c) == pytest.approx(float(value), rel=1e-6)


def test_token_mean_keeps_dtype_and_is_bitwise_the_bare_masked_mean():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        loss = torch.randn(5, 37).to(dtype)
        mask = torch.rand(5, 37) > 0.3
        mean, w = aggregate(loss, mask)
        bare = torch.where(mask, loss, 0).sum() / mask.sum()
        assert mean.dtype == dtype
        assert torch.equal(mean, bare), dtype


def _reference_grad(mode, kw):
    """dJ/dloss of the fixture from the independent float64 reference (rows are sequences)."""
    loss = torch.tensor(LOSS, dtype=torch.float64, requires_grad=True)
    mask = [bool(m) for row in MASK for m in row]
    J, _ = reference_objective(loss.reshape(-1), mask, mask, [len(r) for r in LOSS], GROUPS, mode,
                               kw.get("divisor"))
    J.backward()
    return loss.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", list(EXPECTED))
def test_half_precision_losses(mode, dtype):
    """LOSS holds small integers, exact in half precision. Results computed in float32 (every mode
    but token_mean, and weighted_sum always) are float32-accurate; a value or gradient held in the
    half dtype is the float32 one rounded (one or two roundings: within eps of the dtype, bf16
    ~7.8e-3, fp16 ~9.8e-4 relative)."""
    value, weight, kw = EXPECTED[mode]
    half_rel = torch.finfo(dtype).eps
    mask = torch.tensor(MASK)
    loss = torch.tensor(LOSS, dtype=dtype, requires_grad=True)
    mean, w = aggregate(loss, mask, mode=mode, **kw)
    assert int(w) == weight
    if mode == "token_mean":  # keeps the loss dtype: an exact integer sum, one rounded division
        assert mean.dtype == dtype
        assert float(mean.detach()) == pytest.approx(float(value), rel=half_rel)
    else:
        assert mean.dtype == torch.float32
        assert float(mean.detach()) == pytest.approx(float(value), rel=1e-6)
    mean.backward()
    ref = torch.tensor(LOSS, dtype=torch.float32, requires_grad=True)
    aggregate(ref, mask, mode=mode, **kw)[0].backward()
    exact = _reference_grad(mode, kw)  # so a bug shared by every dtype fails too
    assert torch.allclose(ref.grad.double(), exact, rtol=1e-6, atol=0), (ref.grad, exact)
    assert loss.grad.dtype == dtype
    assert torch.allclose(loss.grad.float(), ref.grad, rtol=half_rel, atol=0), (loss.grad, ref.grad)

    tw = token_weights(mask, mode=mode, **kw)
    loss.grad = ref.grad = None
    s, c = weighted_sum(loss, mask, tw)
    assert s.dtype == torch.float32 and int(c) == weight
    assert float(s.detach() / c) == pytest.approx(float(value), rel=1e-6)
    s.backward()
    weighted_sum(ref, mask, tw)[0].backward()
    assert torch.allclose(ref.grad.double(), exact * weight, rtol=1e-6, atol=0), (ref.grad, exact * weight)
    assert loss.grad.dtype == dtype
    assert torch.allclose(loss.grad.float(), ref.grad, rtol=half_rel, atol=0), (loss.grad, ref.grad)


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_nan_and_inf_at_masked_positions_never_leak(mode):
    _, weight, kw = EXPECTED[mode]
    mask = torch.tensor(MASK).bool()
    clean = torch.tensor(LOSS, dtype=torch.float32, requires_grad=True)
    poison = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")])
    poisoned_values = torch.where(mask, clean.detach(), poison)
    poisoned = poisoned_values.clone().requires_grad_(True)
    m1, _ = aggregate(clean, mask, mode=mode, **kw)
    m2, _ = aggregate(poisoned, mask, mode=mode, **kw)
    m1.backward()
    m2.backward()
    assert torch.equal(m1, m2)
    assert torch.isfinite(poisoned.grad).all() and torch.equal(clean.grad, poisoned.grad)
    assert (poisoned.grad[~mask] == 0).all()

    tw = token_weights(mask, mode=mode, **kw)
    poisoned.grad = None
    s, c = weighted_sum(poisoned, mask, tw)
    s.backward()
    assert torch.isfinite(s) and torch.isfinite(poisoned.grad).all()
    assert (poisoned.grad[~mask] == 0).all()


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_all_masked_step_is_zero_with_zero_weight_and_zero_grad(mode):
    _, _, kw = EXPECTED[mode]
    loss = torch.full((3, 4), float("nan"), requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mean, w = aggregate(loss, mask, mode=mode, **kw)
    assert int(w) == 0 and float(mean) == 0.0
    mean.backward()
    assert torch.equal(loss.grad, torch.zeros(3, 4))
    tw = token_weights(mask, mode=mode, **kw)
    s, c = weighted_sum(loss, mask, tw)
    assert float(s) == 0.0 and int(c) == 0


def test_filtered_numerator_keeps_denominator():
    # Filtering the 3 (index [0,1]) removes it from the numerator but not the denominator.
    loss = torch.tensor(LOSS, dtype=torch.float32)
    den = torch.tensor(MASK).bool()
    num = den.clone()
    num[0, 1] = False
    mean, w = aggregate(loss, num, denominator_mask=den)
    assert int(w) == 6 and float(mean) == pytest.approx(23 / 6)
    mean, w = aggregate(loss, num, denominator_mask=den, mode="seq_mean")
    assert int(w) == 3 and float(mean) == pytest.approx((1 / 2 + 12 / 3 + 10) / 3)


def test_token_weights_slice_like_tokens():
    tw = token_weights(torch.tensor(MASK), mode="seq_mean")
    part = tw[1:]
    assert part.shape == (2, 4) and torch.equal(part.coef, tw.coef[1:])
    flat = tw.reshape(-1)[torch.tensor([0, 5, 8])]
    assert flat.count.tolist() == [1, 0, 1]
