"""The audit of slime (a user's checkout, snapshot 624b824, with Megatron-LM's training side for slime's
parser): the command as a user runs it (with the slime CPU workers' stand-ins for what slime imports and
this path never calls: tests/unit/audit/slime_stand_ins.py), its JSON against float64 references
written here from slime's formulas.

Catches: a stock reduction that is not slime's (the masked-sample scale N/(N+k) of
--calculate-per-token-loss, the mean of sample means over --global-batch-size without it), a schedule
that maps slime's local micro-batch indices wrongly (the per-step references fix which rows a step
holds), a plug-in line that is not a token mean, cut groups left unseen, and a split slime refuses that
is not reported as such. Skips without a slime checkout (MEGATRON_PG_AGG_SLIME) or a Megatron-LM one;
fails instead under MEGATRON_PG_AGG_REQUIRE_SLIME=1 (CI's 0.16.1 leg), as tests/distributed/test_slime.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_pg_agg.audit.batch import BatchShape, synthetic_batch
from megatron_pg_agg.integrations.slime.plugin import CHECKOUT_ENV, checkout_problem
from tests.support.launching import ROOT, child_env
from tests.support.optional import require

REQUIRE_SLIME = "MEGATRON_PG_AGG_REQUIRE_SLIME"
BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "1", "--seq-length", "512",
        "--max-position-embeddings", "512", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "64", "--actor-num-gpus-per-node", "2"]
EPS = 0.2  # slime's --eps-clip default (eps_clip_high defaults to it)


@pytest.fixture(scope="module")
def env(megatron_lm_checkout):
    path = os.environ.get(CHECKOUT_ENV)
    require(checkout_problem(path), REQUIRE_SLIME)
    # child_env: never the rendezvous variables an in-process test of this worker left set (its port still bound)
    return child_env(**{CHECKOUT_ENV: os.path.abspath(path), "MEGATRON_LM_PATH": str(megatron_lm_checkout)})


def _audit(env, tmp_path, flags: list) -> tuple:
    path = tmp_path / "audit.json"
    out = subprocess.run([sys.executable, "-m", "tests.unit.audit.slime_stand_ins", "slime", "--json", str(path),
                          "--", *BASE, *flags], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    return out, (json.loads(path.read_text()) if out.returncode == 0 else None)


def _ppo(batch, i) -> torch.Tensor:
    """slime's per-token PPO term (compute_policy_loss) of row i in float64, masked."""
    ratio = (batch.logprobs[i].double() - batch.old_logprobs[i].double()).exp()
    adv = float(batch.advantages[i])
    return torch.maximum(-ratio * adv, -ratio.clamp(1 - EPS, 1 + EPS) * adv) * batch.masks[i]


BATCH = synthetic_batch(BatchShape(4, 4, 64))
STEPS = (range(0, 8), range(8, 16))  # --global-batch-size 8: slime's steps of 8 rollouts in order


def test_per_token_loss_counts_a_fully_masked_sample_as_one_token(env, tmp_path):
    out, data = _audit(env, tmp_path, ["--calculate-per-token-loss", "--global-batch-size", "8",
                                       "--micro-batch-size", "2"])
    assert out.returncode == 0, out.stderr[-3000:]
    stock, plugin = data["splits"][0]["step_objectives"], data["plugin_splits"][0]["step_objectives"]
    for s, rows in enumerate(STEPS):
        n = sum(int(BATCH.masks[i].sum()) for i in rows)
        k = sum(1 for i in rows if not BATCH.masks[i].any())
        token_mean = float(sum(_ppo(BATCH, i).sum() for i in rows)) / n
        assert k >= 1
        assert abs(plugin[s] - token_mean) <= 1e-5 * max(abs(token_mean), 0.01), (s, plugin[s], token_mean)
        assert abs(stock[s] - token_mean * n / (n + k)) <= 1e-5 * max(abs(token_mean), 0.01), (s, stock[s])
    assert data["spread"] < 1e-6 and data["plugin_spread"] < 1e-6
    assert "drop --calculate-per-token-loss" in data["fix"] and "counts one token" in data["stock"]
    assert len(data["splits"]) >= 6  # micro-batch 1/2/4 and dynamic, at DP 2 and DP 1


def test_the_default_is_a_mean_of_sample_means_over_the_global_batch(env, tmp_path):
    out, data = _audit(env, tmp_path, ["--global-batch-size", "8", "--micro-batch-size", "2"])
    assert out.returncode == 0, out.stderr[-3000:]
    for s, rows in enumerate(STEPS):
        want = sum(float(_ppo(BATCH, i).sum()) / max(int(BATCH.masks[i].sum()), 1) for i in rows) / 8
        got = data["splits"][0]["step_objectives"][s]
        assert abs(got - want) <= 1e-5 * max(abs(want), 0.01), (s, got, want)
    assert data["spread"] < 1e-6 and data["plugin_spread"] < 1e-6
    assert data["length_weight_ratio"] < 0.5  # a long response's token weighs less than a short one's


def test_a_step_of_six_cuts_a_group_of_four_and_slime_refuses_what_it_refuses(env, tmp_path):
    out, data = _audit(env, tmp_path, ["--global-batch-size", "6", "--micro-batch-size", "1"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert data["cut_groups"]["micro-batch 1, DP 2"] == ["group 1 over steps [0, 1]"]
    # 6 rollouts over DP 2 x micro-batch 2 is no whole number of micro-batches per rank: slime's assert
    assert "micro-batch 2, DP 2" in data["refused_splits"]
    assert "not a multiple of" in data["refused_splits"]["micro-batch 2, DP 2"]
    assert data["plugin_spread"] < 1e-6


def test_a_flag_slime_does_not_know_is_refused_with_its_parsers_message(env, tmp_path):
    out, _ = _audit(env, tmp_path, ["--global-batch-size", "8", "--n-samples-per-promt", "4"])
    assert out.returncode == 2 and "error: unrecognized arguments: --n-samples-per-promt 4" in out.stderr
