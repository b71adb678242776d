"""MoE: the router's aux and z losses keep Megatron's default strength under every mode and layout.

Two torchrun launches of ``tests/distributed/workers/moe_worker.py`` (real megatron-core MoE layers, schedules,
DDP and finalize_model_grads on CPU/gloo): 1 rank, and 2 ranks for DP2 (allgather), DP2 x EP2
(alltoall), DP2 x EP2 (allgather, uniform microbatches) and PP2 (1F1B); ragged microbatches.
The in-process checks (configuration guards, the patch's version gate, the trainer's MoE refusals)
are in tests/unit/megatron/test_moe_checks.py.

Each test names the wrong line it would catch.
"""
from __future__ import annotations

import json

import pytest

from tests.support.launching import ROOT, run, torchrun, worker
from tests.support.records import trainer_records

WORKER = worker("moe_worker")
MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")
GRAD_TOL = 1e-6
TIMEOUT_S = 180
ONE_RANK = ["1 rank, 3 mb"]
TWO_RANKS = ["DP2, allgather, 3 mb", "DP2 x EP2, alltoall, 3 mb",
             "DP2 x EP2, allgather (uniform microbatches), 3 mb", "PP2 (1F1B), alltoall, 3 mb"]


def _launch(nproc, layouts, tmp_path, *extra):
    out = tmp_path / f"rows{nproc}.json"
    rc, text, elapsed = run(torchrun(nproc, *WORKER, "--out", out, "--layouts", *layouts, *extra),
                            TIMEOUT_S, f"moe worker ({nproc} ranks)")
    if rc != 0 or "MOE OK" not in text:
        pytest.fail(f"moe worker failed (rc={rc}); output:\n{text[-20000:]}")
    print(f"moe launch ({nproc} ranks, {len(layouts)} layouts) took {elapsed:.1f}s")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    got = _launch(1, ONE_RANK, tmp, "--hot-path") + _launch(2, TWO_RANKS, tmp)
    layouts = [r for r in got if r["layout"] != "hot path trace"]
    assert [r["layout"] for r in layouts] == ONE_RANK + TWO_RANKS
    return {"layouts": layouts, "trace": next(r for r in got if r["layout"] == "hot path trace")}


def test_aux_only_gradients_equal_megatron_default_in_every_mode_and_layout(rows):
    """Catches: the set_loss_scale wrapper not multiplying by W / M_total (or by W / M per rank),
    and the router wrapper leaving the token multiply on."""
    for r in rows["layouts"]:
        for mode in MODES:
            assert r[f"err_{mode}"] <= GRAD_TOL, (r["layout"], mode, r[f"err_{mode}"])
            assert abs(r[f"factor_{mode}"] - 1) <= 1e-5, (r["layout"], mode, r[f"factor_{mode}"])
        assert r["default_router_grad_max"] > 1e-5  # the aux gradient is really there


def test_control_unpatched_run_fails_by_the_predicted_factor(rows):
    """The unpatched run (megatron-core as is) must FAIL the same check, by about
    N_routed / W (tp_sp = cp = 1 here). Catches a suite that cannot see the bug."""
    for r in rows["layouts"]:
        for mode in MODES:
            assert r[f"unpatched_err_{mode}"] > 1e-2, (r["layout"], mode)
            predicted = r["tokens_total"] / r[f"weight_{mode}"]
            assert r[f"unpatched_factor_{mode}"] == pytest.approx(predicted, rel=0.03), (r["layout"], mode)


def test_w0_step_has_exactly_zero_gradients_router_included(rows):
    """Catches: a factor that is not 0 when W = 0 (e.g. max(W, 1) / M_total); the control shows
    the unpatched router gradient is not zero."""
    for r in rows["layouts"]:
        assert r["w0_weight"] == 0
        assert r["w0_max_abs_grad"] == 0.0, r["layout"]
        assert r["w0_unpatched_router_grad_max"] > 1e-3, r["layout"]


def test_pg_plus_aux_gradient_is_pg_only_plus_aux_only(rows):
    """Catches: an aux scale that depends on the PG loss or the step's data other than through W
    (e.g. the factor applied to the main loss too, or set per microbatch)."""
    for r in rows["layouts"]:
        assert r["linearity_err"] <= 1e-5, (r["layout"], r["linearity_err"])
        assert r["aux_share_of_grad"] > 1e-3  # not vacuous: a 2x aux error would be visible


def test_router_loss_pairs_equal_megatron_logged_values(rows):
    """[sum, count] pairs of the aux and z losses: identical with and without the patch (the patch
    changes gradients, not logged values), counted once per MoE layer and microbatch over the
    step. Catches: counting the aux loss on every rank of its reduce group, or logging the
    token-multiplied loss."""
    for r in rows["layouts"]:
        flat = [x for pair in r["pairs_patched"] for x in pair]
        assert flat == pytest.approx([x for pair in r["pairs_default"] for x in pair], rel=1e-6)
        aux, seq, glob, z = r["pairs_patched"]
        count = r["moe_layers"] * r["microbatches_total"]
        assert aux[1] == count and z[1] == count, r["layout"]
        assert seq == [0.0, 0.0] and glob == [0.0, 0.0]
        assert 0.9 < aux[0] / aux[1] < 1.5  # Switch load-balancing loss: 1 when balanced
        assert z[0] > 0


def test_hot_path_trace_has_no_host_sync_with_the_patch_active(rows):
    """Router forward + backward (aux and z losses attached) and the patched set_loss_scale under
    the project's op trace. Catches e.g. a ``float(scale)`` or ``.item()`` in the wrapper."""
    t = rows["trace"]
    assert t["patched"] == "moe_aux_loss" and t["ops"] > 20
    assert t["violations"] == []
    assert t["scale_after"] == 7.0  # set_loss_scale(1) stored 1 * W / M_total = 7 / 1


def test_router_without_a_step_factor_refuses(rows):
    """Catches a training loop that forgot set_moe_aux_loss_scale (the gradient would be 1/W)."""
    msg = rows["trace"]["missing_factor_error"]
    assert msg is not None and "set_moe_aux_loss_scale" in msg


# ----------------------------------------------------------------------------- in-process


# ----------------------------------------------------------------------------- the trainer


def test_trainer_trains_a_moe_actor_and_logs_router_losses_as_pairs(tmp_path):
    """launch/train_actor.py with experts (DP2 x EP2, alltoall, aux + z losses, prompt_mean).
    Catches: the trainer not applying the patch or not setting the step factor (the router
    refuses), and router-loss pairs counted per rank instead of per layer x microbatch."""
    metrics = tmp_path / "metrics.jsonl"
    rc, out, elapsed = run(torchrun(2, ROOT / "launch" / "train_actor.py", "--rollouts", "synthetic",
                                    "--num-experts", 4,
                                    "--moe-router-topk", 2, "--moe-aux-loss-coeff", 0.01,
                                    "--moe-z-loss-coeff", 1e-3, "--expert-model-parallel-size", 2,
                                    "--moe-token-dispatcher-type", "alltoall",
                                    "--pg-loss-aggregation", "prompt_mean", "--train-iters", 3,
                                    "--metrics-file", metrics), TIMEOUT_S, "MoE trainer")
    assert rc == 0, out[-20000:]
    assert "experts=4 top2 EP=2 dispatcher=alltoall" in out
    steps = trainer_records(metrics)[0]
    assert len(steps) == 3
    for r in steps:
        for name in ("moe_aux_loss", "moe_z_loss"):
            total, count = r[name]
            assert count == 2 * 2 * 2  # 2 MoE layers x 2 microbatches x 2 DP ranks
            assert total / count > 0
        assert 0.9 < r["moe_aux_loss"][0] / r["moe_aux_loss"][1] < 1.5
        assert r["grad_norm"] > 0 and not r["skipped"]
    print(f"MoE trainer: {elapsed:.1f}s")
