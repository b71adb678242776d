"""The fuzzer's gradient check with a side loss subtracted (MTP): float32 rounding of the side
gradient is tolerated, a wrong weight is not."""
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_pg_agg.parity.fuzz_worker import GRAD_TOL, SIDE_ROUNDING_ULPS, TOL, _grad_error  # noqa: E402

EPS = torch.finfo(torch.float32).eps


def _case(pg_scale: float, side_scale: float):
    g = torch.Generator().manual_seed(0)
    ref = {"w": torch.randn(64, generator=g, dtype=torch.float64) * pg_scale,
           "b": torch.randn(8, generator=g, dtype=torch.float64) * pg_scale}
    side = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) * side_scale for k, v in ref.items()}
    # what the harness measures: the float32 total minus the float32 side-only gradient
    got = {k: (ref[k] + side[k]).float() - side[k].float() for k in ref}
    return ref, side, got


def test_the_float32_rounding_of_a_large_side_gradient_is_not_an_error():
    # case 1671656309's shape: a PG gradient about 1000x smaller than the MTP gradient it is taken from
    ref, side, got = _case(pg_scale=1e-4, side_scale=0.3)
    err, _, norm_err, _ = _grad_error(got, ref)
    assert err > GRAD_TOL  # without the side's rounding the check would fail on float noise
    err, _, norm_err, _ = _grad_error(got, ref, side)
    assert err <= GRAD_TOL and norm_err <= TOL


def test_a_wrong_weight_still_fails_under_a_side_gradient():
    ref, side, got = _case(pg_scale=1e-4, side_scale=0.3)
    got["b"] = got["b"] * 1.01  # one parameter's gradient 1% off: a token weight or count wrong
    err, worst, _, _ = _grad_error(got, ref, side)
    assert worst == "b" and err > GRAD_TOL
    # the tolerance the side adds is a few float32 ulps of it, not a fraction of it
    off = {k: v + SIDE_ROUNDING_ULPS * 4 * EPS * side[k].abs().max() for k, v in ref.items()}
    assert _grad_error(off, ref, side)[0] > GRAD_TOL
