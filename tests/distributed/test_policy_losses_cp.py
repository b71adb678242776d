"""Sequence-level policy losses under context parallelism (2 gloo ranks, real CP sharding of the
planner): exact against the unsharded step, one CP all-reduce per microbatch for gspo/gmpo and
none for ppo/cispo, and a control without the CP reduction that must differ."""
import pytest

from tests.support.launching import worker_rows


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return worker_rows("policy_cp_worker", 2, tmp_path_factory.mktemp("policy_cp") / "rows.json", 240)


def test_every_policy_loss_is_exact_under_cp(rows):
    assert {(r["policy"], r["mode"]) for r in rows} == {
        (p, m) for p in ("ppo", "gspo", "gmpo", "cispo") for m in ("seq_mean", "token_mean", "prompt_mean", "constant")}
    for r in rows:
        assert r["weight"] == r["reference_weight"] > 0, r
        assert r["objective"] == pytest.approx(r["reference"], rel=1e-6, abs=1e-9), r
        assert r["grad_relerr"] <= 1e-5, r


def test_one_cp_all_reduce_per_microbatch_for_sequence_losses_and_none_otherwise(rows):
    for r in rows:
        expected = r["microbatches"] if r["policy"] in ("gspo", "gmpo") else 0
        assert r["calls"] == ["all_reduce"] * expected, r


def test_control_without_the_cp_reduction_differs(rows):
    """Each CP rank's own partial sequence statistic (what a local mean would give) is wrong."""
    for r in rows:
        if r["policy"] in ("gspo", "gmpo"):
            assert abs(r["control_objective"] - r["reference"]) > 1e-4 * abs(r["reference"]) + 1e-7, r
