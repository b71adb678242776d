"""Bad input gets a ValueError/TypeError naming the argument, never an IndexError or a silent result."""
import pytest
import torch

from megatron_pg_agg import aggregate, token_weights, weighted_sum

LOSS = torch.tensor([1.0, 3.0, 2.0, 4.0, 6.0, 10.0])
MASK = torch.tensor([1, 1, 1, 1, 1, 1], dtype=torch.bool)
CU = torch.tensor([0, 2, 5, 6], dtype=torch.int32)


def _call(fn, **overrides):
    kw = dict(mode="seq_mean", cu_seqlens=CU)
    kw.update(overrides)
    loss = kw.pop("loss", LOSS)
    mask = kw.pop("loss_mask", MASK)
    if fn == "aggregate":
        return aggregate(loss, mask, **kw)
    weights = token_weights(mask, **kw)
    return weighted_sum(loss, mask, weights)


CASES = [
    # (overrides, exception, words the message must contain)
    (dict(mode="sequence_mean"), ValueError, ["unknown mode", "token_mean"]),
    (dict(mode="constant"), ValueError, ["divisor"]),
    (dict(mode="constant", divisor=0), ValueError, ["divisor", "positive"]),
    (dict(mode="constant", divisor=-3.0), ValueError, ["divisor", "positive"]),
    (dict(mode="constant", divisor=float("inf")), ValueError, ["divisor", "finite"]),
    (dict(mode="constant", divisor=float("nan")), ValueError, ["divisor", "finite"]),
    (dict(mode="constant", divisor="4"), TypeError, ["divisor"]),
    (dict(mode="seq-mean-token-sum-norm"), ValueError, ["divisor"]),
    (dict(mode="seq_mean", divisor=4), ValueError, ["divisor", "constant"]),
    (dict(mode="seq-mean-token-sum", divisor=3), ValueError, ["divisor"]),
    (dict(loss_mask=MASK[:5], mode="token_mean", cu_seqlens=None), ValueError, ["loss", "shape"]),
    (dict(denominator_mask=MASK[:4]), ValueError, ["denominator_mask", "shape"]),
    (dict(cu_seqlens=None), ValueError, ["cu_seqlens"]),
    (dict(cu_seqlens=CU.reshape(1, 4)), ValueError, ["cu_seqlens", "1-D"]),
    (dict(cu_seqlens=CU.float()), TypeError, ["cu_seqlens", "int"]),
    (dict(cu_seqlens=torch.tensor([1, 2, 5, 6])), ValueError, ["cu_seqlens", "start at 0"]),
    (dict(cu_seqlens=torch.tensor([0, 4, 2, 6])), ValueError, ["cu_seqlens", "non-decreasing"]),
    (dict(cu_seqlens=torch.tensor([0, 2, 5])), ValueError, ["cu_seqlens", "end", "T=6"]),
    (dict(cu_seqlens=torch.tensor([0, 2, 5, 9])), ValueError, ["cu_seqlens", "end"]),
    (dict(mode="prompt_mean", group_sizes=[2, 0, 1]), ValueError, ["group_sizes", "positive"]),
    (dict(mode="prompt_mean", group_sizes=[2, -1, 2]), ValueError, ["group_sizes", "positive"]),
    (dict(mode="prompt_mean", group_sizes=[2, 2]), ValueError, ["group_sizes", "sum", "3"]),
    (dict(mode="prompt_mean", group_sizes=torch.tensor([1, 1])), ValueError, ["group_sizes", "sum"]),
    (dict(mode="prompt_mean", group_sizes=torch.tensor([1.0, 2.0])), TypeError, ["group_sizes"]),
    (dict(mode="prompt_mean", group_sizes=[1.5, 1.5]), TypeError, ["group_sizes"]),
    (dict(mode="prompt_mean"), ValueError, ["prompt_mean", "group_sizes"]),
    (dict(denominator_mask=torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)), ValueError,
     ["denominator_mask", "numerator"]),
    (dict(loss_mask=torch.tensor([1, 1, 2, 1, 1, 1])), ValueError, ["loss_mask", "0 and 1"]),
    (dict(loss=torch.tensor([1, 3, 2, 4, 6, 10])), TypeError, ["loss", "floating"]),
    (dict(loss=LOSS.reshape(1, 2, 3), loss_mask=MASK.reshape(1, 2, 3), cu_seqlens=None), ValueError,
     ["dims"]),
    (dict(loss=LOSS.reshape(2, 3), loss_mask=MASK.reshape(2, 3)), ValueError, ["cu_seqlens", "padded"]),
]


@pytest.mark.parametrize("fn", ["aggregate", "token_form"])
@pytest.mark.parametrize("overrides,exc,words", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_input_names_the_argument(fn, overrides, exc, words):
    with pytest.raises(exc) as info:
        _call(fn, **overrides)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)


def test_weighted_sum_rejects_mismatched_parts():
    weights = token_weights(MASK, mode="seq_mean", cu_seqlens=CU)
    with pytest.raises(ValueError, match="weights shape"):
        weighted_sum(LOSS[:4], MASK[:4], weights)
    with pytest.raises(ValueError, match="loss_mask shape"):
        weighted_sum(LOSS, MASK[:4], weights)
    with pytest.raises(TypeError, match="floating"):
        weighted_sum(LOSS.long(), MASK, weights)
    with pytest.raises(TypeError, match="TokenWeights"):
        weighted_sum(LOSS, MASK, (weights.coef, weights.count))


def test_token_mean_packed_needs_no_cu_seqlens_but_checks_one_given():
    mean, w = aggregate(LOSS, MASK)
    assert int(w) == 6
    with pytest.raises(ValueError, match="cu_seqlens"):
        aggregate(LOSS, MASK, cu_seqlens=torch.tensor([0, 2, 5]))
