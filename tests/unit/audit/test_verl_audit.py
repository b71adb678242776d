"""The audit of verl (0.9.1, its Megatron engine's loss path): the command as a user runs it, its JSON
against float64 references written here from verl's formulas.

Catches: a stock path that is not verl's (seq-mean-token-sum-norm without loss_scale_factor divides by
each micro-batch's padded width, so it moves with the micro-batch size; token-mean does not), a
token-mean that is not the float64 token mean of verl's dual-clip PPO, steps that are not verl's
(_balance_batch, the DP chunks and mini-batch slices: the cut groups and the step membership that
changes with the DP size), and a plug-in line that is not exact. Runs where verl is installed
(optional_stack: CI's 0.19.2 leg); skips elsewhere, fails under MEGATRON_PG_AGG_REQUIRE_VERL=1.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron_pg_agg.audit.batch import BatchShape, synthetic_batch
from tests.support.launching import ROOT
from tests.support.optional import REQUIRE_VERL, require

pytestmark = pytest.mark.optional_stack
ACTOR = "actor_rollout_ref.actor"
ONE_STEP = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "data.max_response_length=48",
            f"{ACTOR}.ppo_mini_batch_size=4", f"{ACTOR}.ppo_micro_batch_size_per_gpu=2", "trainer.n_gpus_per_node=2"]
CLIP, DUAL = 0.2, 3.0  # verl's actor.yaml clip_ratio and clip_ratio_c


@pytest.fixture(scope="module", autouse=True)
def _verl():
    from megatron_pg_agg.integrations.verl.config import verl_install_problem

    require(verl_install_problem(), REQUIRE_VERL)


def _audit(tmp_path, overrides: list) -> tuple:
    path = tmp_path / "audit.json"
    out = subprocess.run([sys.executable, "-m", "megatron_pg_agg.audit", "verl", *overrides, "--json", str(path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    return out, (json.loads(path.read_text()) if out.returncode == 0 else None)


def _token_mean_reference(batch) -> float:
    """verl's vanilla PPO loss (dual clip on negative advantages) as a float64 token mean over the step."""
    total, tokens = 0.0, 0
    for i in range(batch.rows):
        ratio = (batch.logprobs[i].double() - batch.old_logprobs[i].double()).exp()
        adv = float(batch.advantages[i])
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
        if adv < 0:
            pg = torch.minimum(pg, torch.full_like(pg, -adv * DUAL))
        total += float((pg * batch.masks[i]).sum())
        tokens += int(batch.masks[i].sum())
    return total / tokens


def test_seq_mean_token_sum_norm_without_a_factor_moves_and_token_mean_does_not(tmp_path):
    out, norm = _audit(tmp_path, [*ONE_STEP, f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert norm["spread"] > 0.05, norm["spread"]
    assert "padded width" in norm["stock"]
    assert norm["plugin_spread"] < 1e-6 and not norm["other_step_membership"]
    out, mean = _audit(tmp_path, [*ONE_STEP, f"{ACTOR}.loss_agg_mode=token-mean"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert mean["spread"] < 1e-6 and mean["plugin_spread"] < 1e-6
    want = _token_mean_reference(synthetic_batch(BatchShape(4, 4, 48)))
    for split in mean["splits"] + mean["plugin_splits"]:
        assert abs(split["objective"] - want) <= 1e-5 * max(abs(want), 0.01), (split, want)
    assert abs(mean["length_weight_ratio"] - 1) < 0.05


def test_balance_batch_cuts_groups_and_moves_steps_with_the_dp_size(tmp_path):
    """Two mini-batches per rollout: verl's _balance_batch spreads each group over both steps, and its
    partition depends on the DP size; the plug-in is exact over the splits that keep the steps' rows."""
    overrides = ["data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "data.max_response_length=48",
                 f"{ACTOR}.ppo_mini_batch_size=4", f"{ACTOR}.ppo_micro_batch_size_per_gpu=2",
                 "trainer.n_gpus_per_node=2"]
    out, data = _audit(tmp_path, overrides)
    assert out.returncode == 0, out.stderr[-3000:]
    assert data["cut_groups"]["micro-batch 2, DP 2"], data["cut_groups"]
    assert all(name.endswith("DP 1") for name in data["other_step_membership"]) and data["other_step_membership"]
    assert data["plugin_spread"] < 1e-6


def test_a_key_verl_does_not_know_is_refused_with_hydras_message(tmp_path):
    out, _ = _audit(tmp_path, [*ONE_STEP, f"{ACTOR}.loss_agg_mod=token-mean"])
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]  # verl's imports warn before it
    assert last.startswith("refusing to audit verl: verl's Hydra config: Could not override "
                           f"'{ACTOR}.loss_agg_mod'"), last
