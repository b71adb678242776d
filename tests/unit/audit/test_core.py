"""The audit's host-independent core: the synthetic batch, the measurement and the report, on a toy host
whose losses are written here (a token mean, exact under any split, and a mean of micro-batch means,
which moves)."""
from __future__ import annotations

import json

import torch

from megatron_pg_agg.audit.batch import MASKED_EVERY, BatchShape, synthetic_batch
from megatron_pg_agg.audit.measure import Split, length_weight_ratio, measure_splits
from megatron_pg_agg.audit.report import AuditReport

SHAPE = BatchShape(group_size=4, prompts=6, max_response=40, seed=3)


def test_the_batch_has_what_the_audit_needs():
    """Ragged lengths up to the maximum, fully masked rows, holes, both signs of advantages, and old
    log-probs far enough that a 0.2 clip is active on a share of the tokens."""
    batch = synthetic_batch(SHAPE)
    assert batch.rows == 24 and max(batch.lengths) == 40 and min(batch.lengths) <= 10
    assert all(not batch.masks[i].any() for i in range(1, batch.rows, MASKED_EVERY))
    holes = [i for i in range(batch.rows) if i % MASKED_EVERY != 1 and not batch.masks[i].all()]
    assert holes
    assert (batch.advantages > 0).any() and (batch.advantages < 0).any()
    ratio = torch.cat([(lp - old).exp() for lp, old in zip(batch.logprobs, batch.old_logprobs)])
    clipped = float(((ratio > 1.2) | (ratio < 0.8)).double().mean())
    assert 0.2 < clipped < 0.8
    assert batch.group_ids[:5] == [0, 0, 0, 0, 1]
    again = synthetic_batch(SHAPE)
    assert all(torch.equal(a, b) for a, b in zip(batch.logprobs, again.logprobs))


def _microbatches(batch, size):
    return [list(range(a, min(a + size, batch.rows))) for a in range(0, batch.rows, size)]


def _term(batch, leaves, i):
    """The unclipped PPO term of row i: -A r_t summed over its valid tokens (r_t = exp(logp_t - old_t))."""
    return ((leaves[i] - batch.old_logprobs[i]).exp() * batch.masks[i]).sum() * -batch.advantages[i]


def _token_mean(config, batch, split, leaves):
    total = sum(_term(batch, leaves, i) for i in range(batch.rows))
    return [total / batch.valid_tokens()], [list(range(batch.rows))]


def _mean_of_means(config, batch, split, leaves):
    means = []
    for rows in _microbatches(batch, split.settings["mbs"]):
        n = sum(int(batch.masks[i].sum()) for i in rows)
        means.append(sum(_term(batch, leaves, i) for i in rows) / max(n, 1))
    return [sum(means) / len(means)], [list(range(batch.rows))]


SPLITS = [Split(f"mbs {m}", {"mbs": m}) for m in (4, 2, 8)]


def test_a_token_mean_does_not_move_and_a_mean_of_means_does():
    batch = synthetic_batch(SHAPE)
    exact = measure_splits(_token_mean, None, batch, SPLITS)
    moving = measure_splits(_mean_of_means, None, batch, SPLITS)
    assert max(r.relative for r in exact) < 1e-6 and max(r.gradient for r in exact) < 1e-6
    assert max(r.gradient for r in moving) > 0.05
    # the token mean's coefficient is 1/N on every token: the ratio longest / shortest is 1
    assert abs(length_weight_ratio(exact[0], batch) - 1.0) < 1e-6
    # the gradient is dJ/dlogp: -A_i r_t mask_t / N for every token of row i
    n = batch.valid_tokens()
    want = torch.cat([-batch.advantages[i].double() * (batch.logprobs[i] - batch.old_logprobs[i]).double().exp()
                      * batch.masks[i] / n for i in range(batch.rows)])
    assert torch.allclose(exact[0].weights[0], want, atol=1e-9)


def test_the_report_names_the_cut_groups_and_writes_the_json_keys(tmp_path):
    batch = synthetic_batch(SHAPE)

    def two_steps(config, b, split, leaves):  # steps of 6 rows: groups of 4 are cut
        steps = [list(range(0, 6)), list(range(6, 12)), list(range(12, 18)), list(range(18, 24))]
        return [sum((leaves[i] * b.masks[i]).sum() for i in s) for s in steps], steps

    results = measure_splits(two_steps, None, batch, SPLITS[:1])
    report = AuditReport("toy", "J = ...", {"k": 1}, batch.rows, batch.valid_tokens(), results, results,
                         None, "k: 2")
    # rows 4-7 (group 1) and 16-19 (group 4) straddle a step boundary
    assert [line.split(" over")[0] for line in results[0].cut] == ["group 1", "group 4"]
    path = tmp_path / "a.json"
    report.write_json(str(path))
    data = json.loads(path.read_text())
    for key in ("host", "stock", "splits", "spread", "cut_groups", "length_weight_ratio", "fix", "plugin_spread"):
        assert key in data
    assert data["splits"][0]["split"] == "mbs 4" and set(data["splits"][0]) >= {"split", "objective", "relative"}
    text = report.render()
    assert "prompt groups cut across optimizer steps:" in text and "mbs 4: 2" in text and "k: 2" in text
