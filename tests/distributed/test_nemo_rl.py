"""The NeMo-RL plug-in on NeMo-RL's own Megatron training code (CPU, gloo, torchrun 1 and 2 ranks).

tests/distributed/workers/nemo_rl_checks.py runs NeMo-RL's ``MegatronPolicyWorkerImpl.train`` and its
split path (``process_global_batch``, ``get_microbatch_iterator``, ``LossPostProcessor`` with and
without ``SequencePackingLossWrapper``, ``megatron_forward_backward`` in megatron-core 0.19.2's
schedule, DDP, Adam) with the plug-in's loss and driver fields, in every mode, under fixed
micro-batches, dynamic batching and sequence packing, at DP 1, DP 2 and DP 1 x CP 2 (CP with
packing only, as NeMo-RL requires), 2 optimizer steps each; workers/nemo_rl_reference.py recomputes
every step in float64 from the formulas. Needs the NeMo-RL checkout (``MEGATRON_PG_AGG_NEMO_RL``) and
its Python 3.13 stack (docs/nemo-rl.md); skips without them, fails in CI
(``MEGATRON_PG_AGG_REQUIRE_NEMO_RL=1``).
"""
from __future__ import annotations

import glob
import json
import os
import sys

import pytest

from tests.support.launching import child_env, run, torchrun, worker
from tests.support.optional import require_nemo_rl

OBJECTIVE_TOL = 1e-6  # of max(|J|, 0.01)
GRAD_TOL = 1e-5  # relative, whole gradient
MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")

pytestmark = pytest.mark.optional_stack


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """The reference's rows of every case (1 rank: DP 1; 2 ranks: DP 2 and DP 1 x CP 2), and the folders
    holding the recorded cases."""
    checkout = require_nemo_rl()
    env = child_env(MEGATRON_PG_AGG_NEMO_RL=checkout)
    rows, folders = [], []
    for world in (1, 2):
        out = tmp_path_factory.mktemp(f"nemo_rl_world{world}")
        rc, log, elapsed = run(torchrun(world, *worker("nemo_rl_checks"), out), 900, f"NeMo-RL checks, {world} rank(s)",
                               env=env)
        assert rc == 0, log[-20000:]
        rc, ref_log, ref_elapsed = run([sys.executable, *worker("nemo_rl_reference"), out], 900,
                                       "NeMo-RL float64 reference", env=env)
        assert rc == 0, ref_log[-20000:]
        rows += json.loads((out / "reference.json").read_text())
        folders.append(out)
        summary = json.loads((out / f"summary_world{world}.json").read_text())
        print(f"NeMo-RL {world} rank(s): {len(summary['cases'])} cases in {elapsed:.1f}s (ready after "
              f"{summary['times']['ready']:.1f}s), reference {ref_elapsed:.1f}s")
    return {"rows": rows, "folders": folders}


def _row(results, layout: str, name: str) -> dict:
    (row,) = [r for r in results["rows"] if r["layout"] == layout and r["name"] == name]
    return row


def test_every_mode_split_layout_and_path_equals_the_float64_reference(results):
    """Every mode x fixed/dynamic/packed micro-batches x DP 1, DP 2 and CP 2, on train() and on the
    split path, 2 optimizer steps: J (NeMo-RL's own reported loss) within 1e-6 of max(|J|, 0.01)
    and the whole gradient within 1e-5 of the float64 reference. Catches a k_t computed per
    micro-batch, rank or CP shard, a field that does not travel with its row through NeMo-RL's
    sorting and packing, a prompt group from the wrong rows, the split path's placeholders divided
    by the sequence count (S' not passed), or a step cut other than NeMo-RL's."""
    plugin = [r for r in results["rows"] if r["kind"] == "plugin"]
    assert {r["layout"] for r in plugin} == {"dp1_cp1", "dp2_cp1", "dp1_cp2"}
    assert {r["mode"] for r in plugin} == set(MODES) and {r["path"] for r in plugin} == {"train", "split"}
    worst = {}
    for row in plugin:
        for step in row["steps"]:
            where = (row["layout"], row["name"], step)
            assert step["objective_error"] <= OBJECTIVE_TOL and step["grad_error"] <= GRAD_TOL, where
            assert step["grad_norm"] > 1e-3, where  # the step really trains
            key = row["mode"]
            old = worst.get(key, (0.0, 0.0))
            worst[key] = (max(old[0], step["objective_error"]), max(old[1], step["grad_error"]))
    print("worst (objective, gradient) per mode:", {k: (f"{a:.1e}", f"{b:.1e}") for k, (a, b) in worst.items()})


def test_control_nemo_rls_stock_losses_are_token_mean_and_seq_mean(results):
    """NeMo-RL's stock token-level and sequence-level losses (the plug-in off) equal the reference of
    token_mean and seq_mean (this batch has no empty response), in every layout; the stock J differs
    from the plug-in's prompt_mean and constant J on the same first step by more than 1%."""
    for layout in ("dp1_cp1", "dp2_cp1", "dp1_cp2"):
        for name in ("stock_token_level-packing", "stock_sequence_level-packing"):
            for step in _row(results, layout, name)["steps"]:
                assert step["objective_error"] <= OBJECTIVE_TOL and step["grad_error"] <= GRAD_TOL, (layout, name)
        stock = _row(results, layout, "stock_token_level-packing")["steps"][0]["objective"]
        for mode in ("prompt_mean", "constant"):
            other = _row(results, layout, f"{mode}-packing")["steps"][0]["objective"]
            assert abs(other - stock) > 0.01 * abs(stock), (layout, mode, other, stock)


def _moe_gradients(results) -> dict:
    import torch

    (folder,) = [f for f in results["folders"] if glob.glob(os.path.join(f, "dp1_cp1__moe-*.pt"))]
    out = {}
    for path in glob.glob(os.path.join(folder, "dp1_cp1__moe-*.pt")):
        case = torch.load(path, weights_only=False)
        out[case["name"].removeprefix("moe-")] = [
            torch.cat([v.reshape(-1).double() for _, v in sorted(step["grad"].items())]) for step in case["steps"]]
    return out


def test_moe_aux_loss_keeps_nemo_rls_strength_on_both_paths_in_every_mode(results):
    """An aux-only step (advantages 0, no KL) of a 4-expert top-2 MoE with aux coefficient 0.05: the
    router's gradient with the plug-in is the same in token_mean and seq_mean, on train() and on the
    split path, and equals NeMo-RL's stock token-level train() (its 1/global_valid_toks scale). The
    control shows NeMo-RL #3888: its stock sequence-level split path divides the aux gradient by the
    sequence count instead (here about 5x larger). Catches the plug-in's loss reporting
    SEQUENCE_LEVEL, or its aux scale following the mode."""
    grads = _moe_gradients(results)
    base = grads["stock_token_level"]
    assert float(base[0].norm()) > 1e-3
    for name in ("token_mean", "seq_mean", "seq_mean-split_path", "stock_sequence_level"):
        for got, want in zip(grads[name], base):
            assert float((got - want).norm() / want.norm()) <= 1e-5, name
    ratio = float(grads["stock_sequence_level-split_path"][0].norm() / base[0].norm())
    assert ratio > 2.0, ratio
    print(f"NeMo-RL's stock sequence-level split path: aux gradient {ratio:.2f}x its train() path (#3888)")
