"""MoE: the router's aux and z losses keep Megatron's default strength under every mode and layout.

Two torchrun launches of ``tests/distributed/workers/moe_worker.py`` (real megatron-core MoE layers, schedules,
DDP and finalize_model_grads on CPU/gloo): 1 rank, and 2 ranks for DP2 (allgather), DP2 x EP2
(alltoall), DP2 x EP2 (allgather, uniform microbatches) and PP2 (1F1B); ragged microbatches.
Plus in-process checks of the configuration guards and the patch's version gate.

Each test names the wrong line it would catch.
"""
from __future__ import annotations

import json

import pytest

from megatron_pg_agg import patches
from megatron_pg_agg.patches import _machinery, moe_aux_loss
from tests.support.launching import ROOT, run, torchrun, worker

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


@pytest.fixture
def clean():
    patches.revert_megatron_patches()
    moe_aux_loss.clear_moe_aux_loss_scale()
    yield
    patches.revert_megatron_patches()
    moe_aux_loss.clear_moe_aux_loss_scale()


def _moe_config(**overrides):
    from megatron.core.distributed import finalize_model_grads

    from megatron_pg_agg.parity.models import tiny_transformer_config

    kwargs = dict(num_layers=2, num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                  add_bias_linear=False)
    config = tiny_transformer_config(**{**kwargs, **overrides})
    config.finalize_model_grads_func = finalize_model_grads
    return config


def test_moe_with_router_losses_is_refused_without_the_patch(clean):
    """Catches check_megatron_config not looking at experts (today's silent up-to-4000x)."""
    from megatron_pg_agg.megatron.config_checks import MegatronConfigError, check_megatron_config
    from megatron_pg_agg.megatron.model import default_ddp_config

    for overrides in ({}, {"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 1e-3}):
        with pytest.raises(MegatronConfigError, match="moe_aux_loss patch"):
            check_megatron_config(_moe_config(**overrides), default_ddp_config(), backend="gloo")
    # no router loss: nothing to scale, accepted without the patch
    check_megatron_config(_moe_config(moe_aux_loss_coeff=0.0), default_ddp_config(), backend="gloo")
    patches.apply_megatron_patches(cpu_gloo=False, moe_aux_loss=True)
    check_megatron_config(_moe_config(moe_z_loss_coeff=1e-3), default_ddp_config(), backend="gloo")


def test_mtp_and_expert_bias_are_refused_with_clear_messages(clean):
    from megatron_pg_agg.megatron.config_checks import MegatronConfigError, check_megatron_config
    from megatron_pg_agg.megatron.model import default_ddp_config

    patches.apply_megatron_patches(cpu_gloo=False, moe_aux_loss=True)
    config = _moe_config()
    config.mtp_num_layers = 1
    with pytest.raises(MegatronConfigError, match="multi-token prediction is not supported yet"):
        check_megatron_config(config, default_ddp_config(), backend="gloo")
    with pytest.raises(MegatronConfigError, match="add_bias_linear"):
        check_megatron_config(_moe_config(add_bias_linear=True), default_ddp_config(), backend="gloo")


def test_patch_wraps_its_targets_and_reverts_exactly(clean):
    import importlib
    import inspect

    def current(t):
        owner = importlib.import_module(t.module)
        *path, leaf = t.attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        return vars(owner)[leaf] if inspect.isclass(owner) else getattr(owner, leaf)

    before = {t.qualname: current(t) for t in moe_aux_loss.PATCH.targets}
    assert patches.apply_megatron_patches(cpu_gloo=False, moe_aux_loss=True) == ["moe_aux_loss"]
    assert patches.apply_megatron_patches(cpu_gloo=False, moe_aux_loss=True) == []  # idempotent
    for t in moe_aux_loss.PATCH.targets:
        now = current(t)
        assert now.__wrapped__ is before[t.qualname] and getattr(now, _machinery.MARKER) == "moe_aux_loss"
    assert patches.revert_megatron_patches() == ["moe_aux_loss"]
    for t in moe_aux_loss.PATCH.targets:
        assert current(t) is before[t.qualname]


@pytest.mark.parametrize("version", ["0.14.0", "0.20.0"])
def test_version_gate_refuses_outside_the_supported_range_before_touching_anything(clean, monkeypatch, version):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = vars(MoEAuxLossAutoScaler)["set_loss_scale"]
    monkeypatch.setattr(_machinery, "installed_megatron_core_version", lambda: version)
    monkeypatch.delenv("MEGATRON_PG_AGG_ALLOW_UNTESTED_MEGATRON", raising=False)
    with pytest.raises(RuntimeError) as err:
        patches.apply_megatron_patches(cpu_gloo=False, moe_aux_loss=True)
    assert "moe_aux_loss" in str(err.value) and version in str(err.value) and moe_aux_loss.SUPPORTED in str(err.value)
    assert vars(MoEAuxLossAutoScaler)["set_loss_scale"] is original
    assert patches.applied_patches() == []


def test_a_moved_target_symbol_is_refused_before_touching_anything(clean):
    from megatron.core.transformer.moe.router import TopKRouter

    original = vars(TopKRouter)["apply_z_loss"]
    moved = _machinery.Target("megatron.core.transformer.moe.router", "TopKRouter.attach_aux_loss", lambda o: o)
    broken = _machinery.Patch(name="moe_aux_loss_moved", supported=moe_aux_loss.SUPPORTED, why="test",
                              targets=moe_aux_loss.PATCH.targets + (moved,))
    with pytest.raises(RuntimeError, match="TopKRouter.attach_aux_loss.*Nothing was patched"):
        _machinery.apply(broken)
    assert vars(TopKRouter)["apply_z_loss"] is original and patches.applied_patches() == []


def test_step_factor_takes_host_integers():
    """Catches a factor computed from the wrong totals or accepting device tensors (a sync)."""
    import torch

    assert moe_aux_loss.set_moe_aux_loss_scale(69, 6) == 69 / 6
    assert moe_aux_loss.set_moe_aux_loss_scale(0, 6) == 0.0
    for bad, exc in (((1.5, 2), TypeError), ((True, 2), TypeError), ((torch.tensor(3), 2), TypeError),
                     ((-1, 2), ValueError), ((3, 0), ValueError)):
        with pytest.raises(exc):
            moe_aux_loss.set_moe_aux_loss_scale(*bad)
    moe_aux_loss.clear_moe_aux_loss_scale()
    assert moe_aux_loss.moe_aux_loss_scale() is None


# ----------------------------------------------------------------------------- the trainer


def test_trainer_trains_a_moe_actor_and_logs_router_losses_as_pairs(tmp_path):
    """launch/train_actor.py with experts (DP2 x EP2, alltoall, aux + z losses, prompt_mean).
    Catches: the trainer not applying the patch or not setting the step factor (the router
    refuses), and router-loss pairs counted per rank instead of per layer x microbatch."""
    metrics = tmp_path / "metrics.jsonl"
    rc, out, elapsed = run(torchrun(2, ROOT / "launch" / "train_actor.py", "--num-experts", 4,
                                    "--moe-router-topk", 2, "--moe-aux-loss-coeff", 0.01,
                                    "--moe-z-loss-coeff", 1e-3, "--expert-model-parallel-size", 2,
                                    "--moe-token-dispatcher-type", "alltoall",
                                    "--pg-loss-aggregation", "prompt_mean", "--train-iters", 3,
                                    "--metrics-file", metrics), TIMEOUT_S, "MoE trainer")
    assert rc == 0, out[-20000:]
    assert "experts=4 top2 EP=2 dispatcher=alltoall" in out
    steps = [json.loads(line) for line in open(metrics) if not json.loads(line).get("final")]
    assert len(steps) == 3
    for r in steps:
        for name in ("moe_aux_loss", "moe_z_loss"):
            total, count = r[name]
            assert count == 2 * 2 * 2  # 2 MoE layers x 2 microbatches x 2 DP ranks
            assert total / count > 0
        assert 0.9 < r["moe_aux_loss"][0] / r["moe_aux_loss"][1] < 1.5
        assert r["grad_norm"] > 0 and not r["skipped"]
    print(f"MoE trainer: {elapsed:.1f}s")


@pytest.mark.parametrize("argv,words", [
    (["--moe-aux-loss-coeff", "0.01"], ["--moe-aux-loss-coeff", "need(s) --num-experts"]),
    (["--num-experts", "4", "--moe-router-topk", "1"], ["--moe-router-topk 1", "pre-softmax"]),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], ["divide --num-experts 3"]),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], ["not divisible by EP x TP"]),
])
def test_trainer_refuses_bad_moe_flags_before_starting(argv, words):
    from megatron_pg_agg.training.run_config import RunConfig, StartupError, build_parser

    cfg = RunConfig.from_args(build_parser().parse_args(argv))
    with pytest.raises(StartupError) as err:
        cfg.validate(2, backend="gloo", te=False)
    for word in words:
        assert word in str(err.value)
