"""Tensor parallelism for the losses outside the parity run: ``vocab_parallel_logprobs`` on two
vocabulary shards (two gloo ranks) against the unsharded float64 computation, values and logit
gradients, with and without the entropy."""
import pytest

from tests.support.launching import worker_rows


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    return worker_rows("tp_logprobs_worker", 2, tmp_path_factory.mktemp("tp") / "tp.json", 180)


@pytest.mark.parametrize("case", ["logprobs", "entropy"])
def test_tp2_logprobs_and_entropy_match_the_unsharded_computation(tp2, case):
    got = tp2[case]
    assert tp2["world"] == 2
    assert got["returned_entropy"] == (case == "entropy")
    assert got["logprob_err"] < 1e-5, got  # float32 on logits of spread ~ +-40
    assert got["entropy_err"] < 1e-5, got
    assert got["rank_spread"] == 0.0, got  # every TP rank holds the same values: the same loss


@pytest.mark.parametrize("case", ["logprobs", "entropy"])
def test_tp2_logit_gradients_match_the_unsharded_computation(tp2, case):
    """Each rank's shard gradient equals the matching slice of the full gradient: a missing
    cross-shard term (the normaliser's dependence on the other shards) or a gradient summed over
    the TP ranks (doubled) is far outside this bound."""
    got = tp2[case]
    assert got["grad_scale"] > 0.1
    assert got["grad_err"] < 1e-5, got  # gradients of order 1
