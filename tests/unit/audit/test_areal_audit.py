"""The audit of AReaL (1.0.4: its actor's step split, the engine's micro-batch split and weights, its
``grpo_loss_fn``): the command as a user runs it, on AReaL's GSM8K GRPO example config
(tests/unit/audit/data/areal_gsm8k_grpo_megatron.yaml) at a small size.

Catches: an audit that does not run AReaL's own M2PO (chosen per micro-batch, AReaL #1730: it moves
with the micro-batch split and with the DP size, which changes which rows share a micro-batch), a
stock token mean that is not AReaL's (a float64 token mean written here, at the configured DP and at
DP 1) or not the plug-in's (they agree step by step without M2PO), a DP size not read from
``actor.backend``, steps that are not AReaL's (its splitter balances rows by length and cuts groups),
and a plug-in line that is not exact across micro-batch splits and DP sizes. Runs where AReaL is
installed (optional_stack: CI's 0.17.1 leg); skips elsewhere, fails under MEGATRON_PG_AGG_REQUIRE_AREAL=1.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from megatron_pg_agg.audit.batch import BatchShape, synthetic_batch
from tests.support.launching import ROOT
from tests.support.optional import REQUIRE_AREAL, require

pytestmark = pytest.mark.optional_stack
CONFIG = ROOT / "tests" / "unit" / "audit" / "data" / "areal_gsm8k_grpo_megatron.yaml"
SMALL = ["train_dataset.batch_size=16", "gconfig.max_new_tokens=64", "actor.mb_spec.max_tokens_per_mb=400"]
CONFIGURED = "configured actor.mb_spec, DP 4"
"""The configured split: the config's actor.backend is megatron:d4p1t1."""
EPS_CLIP = 0.4
"""The config's actor.eps_clip (no eps_clip_higher, no c_clip, no rejection sampling)."""


@pytest.fixture(scope="module", autouse=True)
def _areal():
    require(None if importlib.util.find_spec("areal") else "AReaL is not installed (docs/areal.md)", REQUIRE_AREAL)


def _audit(tmp_path, overrides: list) -> tuple:
    path = tmp_path / "audit.json"
    out = subprocess.run([sys.executable, "-m", "megatron_pg_agg.audit", "areal", "--config", str(CONFIG),
                          *SMALL, *overrides, "--json", str(path)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    return out, (json.loads(path.read_text()) if out.returncode == 0 else None)


def _token_mean(batch) -> float:
    """AReaL's decoupled PPO loss as a token mean over the whole collection, in float64: per token
    ``max(-A r, -A clip(r, 1 - eps, 1 + eps))`` with ``r = exp(logp - prox)``; the audit's proximal
    log-probs are the batch's old ones, and without rejection sampling the behaviour policy adds no weight."""
    num, den = 0.0, 0
    for i in range(batch.rows):
        ratio, adv = (batch.logprobs[i].double() - batch.old_logprobs[i].double()).exp(), float(batch.advantages[i])
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP))
        num += float(pg[batch.masks[i]].sum())
        den += int(batch.masks[i].sum())
    return num / den


def test_m2po_moves_with_the_micro_batches_and_the_dp_size_and_the_plugin_does_not(tmp_path):
    out, data = _audit(tmp_path, ["+actor.m2_threshold=0.04"])
    assert out.returncode == 0, out.stderr[-3000:]
    splits = {s["split"]: s for s in data["splits"]}
    assert data["splits"][0]["split"] == CONFIGURED
    assert max(s["gradient"] for s in data["splits"] if s["split"].endswith("DP 4")) > 0.05, data["splits"]
    # the same mb_spec at DP 1: only AReaL's dispatch over the ranks changed (measured 0.16)
    assert splits["configured actor.mb_spec, DP 1"]["gradient"] > 0.05, splits
    assert data["other_step_membership"] == []  # one step of every row: the plug-in's spread covers both DP sizes
    assert data["plugin_spread"] < 1e-6, data["plugin_splits"]
    assert "M2PO" in data["stock"]


def test_without_m2po_areals_token_mean_is_the_float64_token_mean_at_every_dp_size(tmp_path):
    out, data = _audit(tmp_path, [])
    assert out.returncode == 0, out.stderr[-3000:]
    assert data["settings"]["DP (actor.backend)"] == 4
    names = [s["split"] for s in data["splits"]]
    assert names[0] == CONFIGURED and "configured actor.mb_spec, DP 1" in names and len(names) == 8, names
    assert data["spread"] < 1e-6 and data["plugin_spread"] < 1e-6
    want = _token_mean(synthetic_batch(BatchShape(4, 16, 64)))
    for stock, plugin in zip(data["splits"], data["plugin_splits"]):
        (got,) = stock["step_objectives"]
        assert abs(got - want) <= 1e-6 * max(abs(want), 0.01), (stock["split"], got, want)
        for a, b in zip(stock["step_objectives"], plugin["step_objectives"]):
            assert abs(a - b) <= 1e-6 * max(abs(b), 0.01), (stock, plugin)


def test_two_minibatches_cut_groups_in_areal_and_not_in_the_plugin(tmp_path):
    out, data = _audit(tmp_path, ["actor.ppo_n_minibatches=2"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert data["cut_groups"][CONFIGURED], data["cut_groups"]
    assert data["plugin_spread"] < 1e-6


def test_a_key_areal_does_not_know_is_refused_with_its_message(tmp_path):
    out, _ = _audit(tmp_path, ["actor.ppo_n_minibatch=2"])
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("refusing to audit areal: AReaL's config:") and "ppo_n_minibatch" in last, last
