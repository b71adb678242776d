"""MoE in-process checks: the configuration guards, the moe_aux_loss patch's wrapping, revert,
version gate and moved-target refusal, the step factor's host integers, and the trainer's MoE
start-up refusals. Each test names the wrong line it would catch."""
from __future__ import annotations

import pytest

from megatron_pg_agg import patches
from megatron_pg_agg.patches import _machinery, moe_aux_loss


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
    """Catches check_megatron_config not looking at experts (a silent scaling of the router losses'
    gradient by up to ~4000x)."""
    from megatron_pg_agg.megatron.config_checks import MegatronConfigError, check_megatron_config
    from megatron_pg_agg.megatron.model import default_ddp_config

    for overrides in ({}, {"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 1e-3}):
        with pytest.raises(MegatronConfigError, match="moe_aux_loss patch"):
            check_megatron_config(_moe_config(**overrides), default_ddp_config(), backend="gloo")
    # no router loss: nothing to scale, accepted without the patch
    check_megatron_config(_moe_config(moe_aux_loss_coeff=0.0), default_ddp_config(), backend="gloo")
    patches.apply_megatron_patches(cpu_gloo=False, moe_aux_loss=True)
    check_megatron_config(_moe_config(moe_z_loss_coeff=1e-3), default_ddp_config(), backend="gloo")


def test_expert_bias_is_refused_with_a_clear_message(clean):
    from megatron_pg_agg.megatron.config_checks import MegatronConfigError, check_megatron_config
    from megatron_pg_agg.megatron.model import default_ddp_config

    patches.apply_megatron_patches(cpu_gloo=False, moe_aux_loss=True)
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


@pytest.mark.parametrize("argv,words", [
    (["--moe-aux-loss-coeff", "0.01"], ["--moe-aux-loss-coeff", "need(s) --num-experts"]),
    (["--num-experts", "4", "--moe-router-topk", "1"], ["--moe-router-topk 1", "pre-softmax"]),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], ["divide --num-experts 3"]),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], ["not divisible by EP x TP"]),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"],
     ["MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel"]),
])
def test_trainer_refuses_bad_moe_flags_before_starting(argv, words):
    from megatron_pg_agg.training.run_config import RunConfig, StartupError, build_parser

    cfg = RunConfig.from_args(build_parser().parse_args(argv))
    with pytest.raises(StartupError) as err:
        cfg.validate(2, backend="gloo", te=False)
    for word in words:
        assert word in str(err.value)
