"""The per-microbatch path makes no host sync and has no data-dependent shape.

Three independent proofs: an op trace (TorchDispatchMode) of forward and backward, a run on the
"meta" device (which has no data, so any read of tensor values raises), and
torch.compile(fullgraph=True), which refuses graph breaks.
"""
import pytest
import torch

from megatron_pg_agg import aggregate, token_weights, weighted_sum
from tests.support.op_trace import OpTrace

MODES = {
    "token_mean": {},
    "seq_mean": {},
    "prompt_mean": {"group_sizes": torch.tensor([2, 1, 3])},
    "constant": {"divisor": 16.0},
}


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(0)
    lengths = [5, 0, 7, 3, 9, 4]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = sum(lengths)
    den = torch.rand(total, generator=g) > 0.2
    num = den & (torch.rand(total, generator=g) > 0.2)
    loss = torch.randn(total, generator=g)
    return [t.to(device) for t in (loss, num, den, cu)]


def test_self_check_the_trace_catches_syncs():
    trace = OpTrace()
    x = torch.arange(5.0)
    with trace:
        x.sum().item()
        x[x > 2].sum()
        torch.repeat_interleave(torch.tensor([1, 2]))
    assert "_local_scalar_dense" in trace.violations
    assert any("boolean" in v for v in trace.violations)
    assert "repeat_interleave without output_size" in trace.violations


@pytest.mark.parametrize("mode", list(MODES))
def test_weighted_sum_and_aggregate_trace_is_sync_free(mode):
    loss, num, den, cu = _batch()
    kw = MODES[mode]
    weights = token_weights(num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw)  # host planner
    part = torch.arange(3, 20)
    leaf = loss.clone().requires_grad_(True)
    trace = OpTrace()
    with trace:
        s, c = weighted_sum(leaf[part], num[part], weights[part], validate=False)
        s.backward()
        leaf.grad = None
        mean, w = aggregate(leaf, num, mode=mode, cu_seqlens=cu, denominator_mask=den, validate=False, **kw)
        (mean * w).backward()
    assert trace.ops, "trace recorded nothing"
    assert trace.violations == [], trace.violations


@pytest.mark.parametrize("mode", list(MODES))
def test_runs_on_meta_device_where_values_cannot_be_read(mode):
    # default validate=None: value checks are skipped off the host, so nothing reads data
    loss, num, den, cu = _batch("meta")
    kw = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in MODES[mode].items()}
    leaf = loss.clone().requires_grad_(True)
    mean, w = aggregate(leaf, num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw)
    mean.backward()
    weights = token_weights(num, mode=mode, cu_seqlens=cu, denominator_mask=den, **kw)
    s, c = weighted_sum(leaf, num, weights)
    assert s.device.type == "meta" and c.dtype == torch.int32 and leaf.grad.shape == leaf.shape


def _assert_sum_close(actual, expected, loss, num, weights):
    """Two float32 sums of the same terms ``c_t * l_t`` in different orders (compiled vs eager)
    differ by rounding bounded by ~n * eps * sum|terms|, whatever the sum itself is: it may cancel
    to ~0, where a relative tolerance is meaningless. Far below any wrong coefficient's effect."""
    terms = torch.where(num, loss.double() * weights.coef.double(), 0.0)
    atol = terms.numel() * torch.finfo(torch.float32).eps * float(terms.abs().sum())
    diff = abs(float(actual) - float(expected))
    assert diff <= atol, f"sums differ by {diff:.3g} > {atol:.3g} (sum|terms| = {float(terms.abs().sum()):.6g})"


def _one_term_off(loss, num, weights, factor):
    """``loss`` with its largest term ``c_t * l_t`` scaled by ``factor``: the sum a coefficient
    wrong by that factor on that token would give (token_mean's sum never reads c_t)."""
    k = int(torch.where(num, (loss * weights.coef).abs(), -1.0).argmax())
    out = loss.clone()
    out[k] *= factor
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_the_sum_tolerance_still_catches_a_wrong_coefficient(mode):
    loss, num, den, cu = _batch()
    weights = token_weights(num, mode=mode, cu_seqlens=cu, denominator_mask=den, **MODES[mode])
    rs, _ = weighted_sum(loss, num, weights)
    _assert_sum_close(weighted_sum(loss.flip(0), num.flip(0), weights[torch.arange(loss.numel() - 1, -1, -1)])[0],
                      rs, loss, num, weights)  # another summation order passes
    for factor in (1.01, 1.001):
        wrong, _ = weighted_sum(_one_term_off(loss, num, weights, factor), num, weights)
        with pytest.raises(AssertionError, match="sums differ"):
            _assert_sum_close(wrong, rs, loss, num, weights)


@pytest.mark.parametrize("mode", list(MODES))
def test_weighted_sum_compiles_fullgraph_with_backward(mode):
    torch._dynamo.reset()
    loss, num, den, cu = _batch()
    weights = token_weights(num, mode=mode, cu_seqlens=cu, denominator_mask=den, **MODES[mode])
    compiled = torch.compile(weighted_sum, fullgraph=True, backend="aot_eager")
    leaf = loss.clone().requires_grad_(True)
    s, c = compiled(leaf, num, weights, validate=False)
    s.backward()
    ref_leaf = loss.clone().requires_grad_(True)
    rs, rc = weighted_sum(ref_leaf, num, weights)
    rs.backward()
    assert torch.equal(c, rc)
    _assert_sum_close(s, rs, loss, num, weights)
    assert torch.allclose(leaf.grad, ref_leaf.grad)


def test_weighted_sum_compiles_with_inductor():
    torch._dynamo.reset()
    loss, num, den, cu = _batch()
    weights = token_weights(num, mode="seq_mean", cu_seqlens=cu, denominator_mask=den)
    compiled = torch.compile(weighted_sum, fullgraph=True)
    s, c = compiled(loss, num, weights, validate=False)
    rs, rc = weighted_sum(loss, num, weights)
    assert torch.equal(c, rc)
    _assert_sum_close(s, rs, loss, num, weights)


def _traced_loss_func(rollouts, cfg, rank: int):
    """Plan the step on 2 DP ranks x 2 microbatches, run ``pg_loss_func`` forward and backward
    on ``rank``'s second microbatch under :class:`OpTrace`; ``(count, report, logits, trace)``."""
    from megatron_pg_agg.data.planner import PlanConfig, plan_step
    from megatron_pg_agg.megatron.loss_func import pg_loss_func
    from tests.support.rollouts import VOCAB

    plan = plan_step(rollouts, cfg, PlanConfig(dp_size=2, num_microbatches=2))
    mb = plan.for_rank(rank)[1]
    logits = torch.randn(1, mb.num_tokens, VOCAB, requires_grad=True)
    trace = OpTrace()
    with trace:
        loss, count, report = pg_loss_func(mb, cfg, plan.totals, None, logits)
        loss.backward()
    return count, report, logits, trace


@pytest.mark.parametrize("mode", list(MODES))
def test_megatron_loss_func_trace_is_sync_free(mode):
    """The whole per-microbatch loss path Megatron calls (logprobs, entropy, PPO, KL, weighted
    sum, report) traced forward and backward."""
    from megatron_pg_agg.core.losses import PGLossConfig
    from tests.support.rollouts import fixed_step

    kw = {"divisor": 16.0} if mode == "constant" else {}
    cfg = PGLossConfig(mode=mode, kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0, **kw)
    count, report, _, trace = _traced_loss_func(fixed_step(), cfg, rank=1)
    assert count.dtype == torch.int32 and set(report) >= {"objective", "pg_loss", "kl", "entropy"}
    assert trace.violations == [], trace.violations


@pytest.mark.parametrize("policy,correction", [("gspo", "token_truncate"), ("gmpo", "sequence_mask"),
                                               ("cispo", "sequence_truncate")])
def test_sequence_level_losses_and_corrections_trace_is_sync_free(policy, correction):
    """gspo/gmpo's per-sequence statistic (segment ids from cu_seqlens, index_add, gather) and the
    correction's per-token weights add no host sync to the loss path."""
    from megatron_pg_agg.core.losses import PGLossConfig
    from tests.support.rollouts import fixed_step

    rollouts = fixed_step()
    for r in rollouts:
        r.rollout_logprobs = [min(lp + 0.3 * ((j % 3) - 1), 0.0) for j, lp in enumerate(r.old_logprobs)]
    cfg = PGLossConfig(mode="seq_mean", policy_loss=policy, rollout_correction=correction,
                       rollout_correction_max=1.2, rollout_correction_min=0.8)
    _, report, logits, trace = _traced_loss_func(rollouts, cfg, rank=0)
    # the correction's counts are host data of the plan (plan.correction_stats), not loss reports
    assert "objective" in report
    assert not set(report) & {"correction_masked", "correction_truncated", "correction_weight"}
    assert logits.grad is not None and bool(torch.isfinite(logits.grad).all())
    assert trace.violations == [], trace.violations
