"""Multi-token prediction's configuration guards and the mtp_loss patch's hygiene, on every
supported release (megatron-core 0.15 included: there the patch is refused with the reason).
Each test names the wrong line it would catch."""
from __future__ import annotations

import importlib
import inspect

import pytest

from megatron_pg_agg import patches
from megatron_pg_agg.patches import _machinery, mtp_loss
from megatron_pg_agg.versions import in_range, installed_megatron_core_version

SUPPORTED_HERE = in_range(installed_megatron_core_version(), mtp_loss.SUPPORTED)
needs_mtp_release = pytest.mark.skipif(not SUPPORTED_HERE, reason="megatron-core 0.15: refused (tested below)")


@pytest.fixture
def clean():
    patches.revert_megatron_patches()
    mtp_loss.clear_mtp_loss_scale()
    yield
    patches.revert_megatron_patches()
    mtp_loss.clear_mtp_loss_scale()


def _mtp_config(**overrides):
    from megatron.core.distributed import finalize_model_grads

    from megatron_pg_agg.parity.models import tiny_transformer_config

    config = tiny_transformer_config(**{"num_layers": 2, "mtp_num_layers": 1, "mtp_loss_scaling_factor": 0.1,
                                        **overrides})
    config.finalize_model_grads_func = finalize_model_grads
    return config


def _check(config):
    from megatron_pg_agg.megatron.config_checks import check_megatron_config
    from megatron_pg_agg.megatron.model import default_ddp_config

    check_megatron_config(config, default_ddp_config(), backend="gloo")


def test_mtp_without_the_patch_is_refused_naming_it(clean):
    """Catches check_megatron_config not looking at mtp_num_layers: megatron-core would divide
    the MTP gradient by W (D / W times too strong under seq_mean)."""
    from megatron_pg_agg.megatron.config_checks import MegatronConfigError

    with pytest.raises(MegatronConfigError, match="without the mtp_loss patch"):
        _check(_mtp_config())
    _check(_mtp_config(mtp_num_layers=None))  # no MTP: nothing to refuse


@needs_mtp_release
def test_mtp_with_the_patch_is_accepted_and_a_zero_factor_refused(clean):
    """Catches the patch check inverted, or a factor <= 0 let through (the report divides by f)."""
    from megatron_pg_agg.megatron.config_checks import MegatronConfigError

    patches.apply_megatron_patches(cpu_gloo=False, mtp_loss=True)
    _check(_mtp_config())
    with pytest.raises(MegatronConfigError, match="mtp_loss_scaling_factor=0.0"):
        _check(_mtp_config(mtp_loss_scaling_factor=0.0))


def test_the_patch_applies_from_0_16_and_is_refused_on_0_15_with_the_reason(clean):
    """megatron-core 0.15 asserts MTP on packed sequences: there the refusal says so, before
    touching anything; from 0.16 the patch applies. Catches a support range that lets 0.15
    through (its first MTP forward would assert) or refuses a release it supports."""
    if SUPPORTED_HERE:
        assert patches.apply_megatron_patches(cpu_gloo=False, mtp_loss=True) == ["mtp_loss"]
        return
    with pytest.raises(RuntimeError, match="refuses multi-token prediction with packed sequences"):
        patches.apply_megatron_patches(cpu_gloo=False, mtp_loss=True)
    assert "mtp_loss" not in patches.applied_patches()


def _current(target):
    owner = importlib.import_module(target.module)
    *path, leaf = target.attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return vars(owner)[leaf] if inspect.isclass(owner) else getattr(owner, leaf)


@needs_mtp_release
def test_patch_wraps_its_targets_for_this_release_and_reverts_exactly(clean):
    """Every target of this release is wrapped (``__wrapped__`` is the original, the marker
    names the patch), re-applying is a no-op and revert restores the originals; the 0.17+
    targets are touched only there. Catches a target resolved on the wrong release."""
    installed = installed_megatron_core_version()
    targets = _machinery.active_targets(mtp_loss.PATCH, installed)
    assert any(t.attr == "process_mtp_loss" for t in targets) == in_range(installed, ">=0.17")
    before = {t.qualname: _current(t) for t in targets}
    assert patches.apply_megatron_patches(cpu_gloo=False, mtp_loss=True) == ["mtp_loss"]
    assert patches.apply_megatron_patches(cpu_gloo=False, mtp_loss=True) == []
    for t in targets:
        now = _current(t)
        assert now.__wrapped__ is before[t.qualname] and getattr(now, _machinery.MARKER) == "mtp_loss"
    assert patches.revert_megatron_patches() == ["mtp_loss"]
    for t in targets:
        assert _current(t) is before[t.qualname]


@needs_mtp_release
def test_a_moved_target_refuses_the_patch_and_touches_nothing(clean, monkeypatch):
    """A release that renamed MTPLossAutoScaler.set_loss_scale: the patch refuses, naming it, and
    no other target is wrapped (no half-applied patch)."""
    from megatron.core.transformer import multi_token_prediction

    original_forward = vars(multi_token_prediction.MTPLossAutoScaler)["forward"]
    monkeypatch.delattr(multi_token_prediction.MTPLossAutoScaler, "set_loss_scale")
    with pytest.raises(RuntimeError, match="set_loss_scale"):
        patches.apply_megatron_patches(cpu_gloo=False, mtp_loss=True)
    assert vars(multi_token_prediction.MTPLossAutoScaler)["forward"] is original_forward
    assert "mtp_loss" not in patches.applied_patches()


def test_the_step_factor_takes_host_integers_and_w_zero_only_with_d_zero():
    """Catches a factor computed from a device tensor (a host sync per step), or D / W inverted."""
    try:
        assert mtp_loss.set_mtp_loss_scale(24, 353) == pytest.approx(24 / 353)
        assert mtp_loss.set_mtp_loss_scale(0, 0) == 0.0
        with pytest.raises(TypeError, match="host integer"):
            mtp_loss.set_mtp_loss_scale(24.0, 353)
        with pytest.raises(ValueError, match="W = 0 exactly"):
            mtp_loss.set_mtp_loss_scale(0, 5)
    finally:
        mtp_loss.clear_mtp_loss_scale()
