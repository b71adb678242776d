"""The Megatron-LM patches (megatron_lm_cpu, megatron_lm_log) on the real checkout, in-process:
replace, re-apply, revert, wrong megatron-core version, wrong Megatron-LM release, CUDA refusal,
and the triton stand-in coming and going with the patch."""
from __future__ import annotations

import importlib
import inspect
import sys

import pytest
import torch

from megatron_pg_agg import patches
from megatron_pg_agg.patches import _machinery, _megatron_lm_release, megatron_lm_log
from megatron_pg_agg.patches._machinery import MARKER
from megatron_pg_agg.patches._megatron_lm_release import (
    SUPPORTED_TAGS,
    UnsupportedMegatronLM,
    check_pretrain_signature,
)
from megatron_pg_agg.patches.cpu import megatron_lm_cpu

STAND_IN = megatron_lm_cpu.BATCH_INVARIANT_KERNELS
TRITON = importlib.util.find_spec("triton") is not None
HAS_MODULE = next(item for item in megatron_lm_cpu.PATCH.stand_ins if item.module == STAND_IN).applies_to(
    _machinery.installed_megatron_core_version())
"""megatron-core 0.15 has no batch_invariant_kernels (and its training side never imports it)."""
STANDS_IN = HAS_MODULE and not TRITON


@pytest.fixture(autouse=True)
def clean(megatron_lm_on_path):
    patches.revert_megatron_patches()
    yield
    patches.revert_megatron_patches()


def _current(target):
    owner = importlib.import_module(target.module)
    *path, leaf = target.attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return vars(owner)[leaf] if inspect.isclass(owner) else getattr(owner, leaf)


def _targets(patch):
    """The targets the patch touches on the installed megatron-core (some exist only in some releases)."""
    return _machinery.active_targets(patch, _machinery.installed_megatron_core_version())


def _snapshot(patch):
    return {t.qualname: _current(t) for t in _targets(patch)}


def _untouched(patch, before):
    for t in _targets(patch):
        assert _current(t) is before[t.qualname], t.qualname
        assert getattr(_current(t), MARKER, None) is None, t.qualname


@pytest.fixture
def originals():
    """The real objects, resolved once under a temporary application (the targets import
    megatron.training, which needs the stand-in where triton is missing)."""
    patches.apply_megatron_patches(cpu_gloo=False, megatron_lm_cpu=True, megatron_lm_log=True)
    found = {p.name: {t.qualname: _current(t).__wrapped__ for t in _targets(p)}
             for p in (megatron_lm_cpu.PATCH, megatron_lm_log.PATCH)}
    patches.revert_megatron_patches()
    return found


def test_apply_stands_in_for_the_triton_module_and_wraps_every_target(originals):
    assert patches.apply_megatron_patches(cpu_gloo=True, megatron_lm_cpu=True, megatron_lm_log=True) == [
        "cpu_gloo", "megatron_lm_cpu", "megatron_lm_log"]
    if not STANDS_IN:  # 0.15: no such module; with triton (a CUDA torch): the real one imports
        assert _machinery.stood_in("megatron_lm_cpu") == []
        assert STAND_IN not in sys.modules or getattr(sys.modules[STAND_IN], MARKER, None) is None
        _assert_wrapped(originals)
        return
    stand_in = sys.modules[STAND_IN]
    assert getattr(stand_in, MARKER) == "megatron_lm_cpu"
    assert _machinery.stood_in("megatron_lm_cpu") == [STAND_IN]
    assert stand_in.is_batch_invariant_mode_enabled() is False
    with pytest.raises(RuntimeError, match="needs triton and a GPU"):
        stand_in.enable_batch_invariant_mode()
    _assert_wrapped(originals)


def _assert_wrapped(originals):
    for patch in (megatron_lm_cpu.PATCH, megatron_lm_log.PATCH):
        for t in _targets(patch):
            now = _current(t)
            assert getattr(now, MARKER) == patch.name, t.qualname
            assert now.__wrapped__ is originals[patch.name][t.qualname], t.qualname


def test_the_training_side_sees_a_cpu_device_and_the_users_torch_is_real():
    patches.apply_megatron_patches(cpu_gloo=True, megatron_lm_cpu=True)
    from megatron.training import initialize, training

    utils = importlib.import_module(next(t.module for t in _targets(megatron_lm_cpu.PATCH)
                                         if t.module.startswith("megatron.training.utils")))
    assert training.torch.tensor([1], device="cuda").device.type == "cpu"
    assert initialize.torch.cuda.device_count() == 1  # model parallelism is initialised on CPU
    assert utils.torch.cuda.get_device_properties(torch.device("cuda:0")).major == 0
    assert training.torch.cuda.memory_allocated() == 0 and training.torch.cuda.empty_cache() is None
    with training.torch.cuda.stream(training.torch.cuda.Stream()):
        pass
    assert torch.cuda.device_count() == 0  # outside the patched modules: the real torch
    assert training.initialize_megatron.__wrapped__ is not None
    assert initialize._warmup_jit_function() is None


def test_reapply_is_a_noop_and_revert_restores_everything(originals):
    patches.apply_megatron_patches(cpu_gloo=False, megatron_lm_cpu=True, megatron_lm_log=True)
    first = {p.name: _snapshot(p) for p in (megatron_lm_cpu.PATCH, megatron_lm_log.PATCH)}
    assert patches.apply_megatron_patches(cpu_gloo=False, megatron_lm_cpu=True, megatron_lm_log=True) == []
    for patch in (megatron_lm_cpu.PATCH, megatron_lm_log.PATCH):
        assert _snapshot(patch) == first[patch.name]
    assert patches.revert_megatron_patches() == ["megatron_lm_log", "megatron_lm_cpu"]
    for patch in (megatron_lm_cpu.PATCH, megatron_lm_log.PATCH):
        _untouched(patch, originals[patch.name])
    assert _machinery.stood_in("megatron_lm_cpu") == []
    if STANDS_IN:
        assert STAND_IN not in sys.modules  # the stand-in leaves with the patch
        with pytest.raises(ModuleNotFoundError, match="triton"):
            importlib.import_module(STAND_IN)


def test_wrong_megatron_core_version_is_refused_before_anything(monkeypatch, originals):
    monkeypatch.setattr(_machinery, "installed_megatron_core_version", lambda: "0.14.0")
    with pytest.raises(RuntimeError, match="0.14.0") as err:
        patches.apply_megatron_patches(cpu_gloo=False, megatron_lm_cpu=True)
    assert megatron_lm_cpu.SUPPORTED in str(err.value) and "nothing was patched" in str(err.value)
    monkeypatch.undo()  # resolve the targets of the installed release again
    _untouched(megatron_lm_cpu.PATCH, originals["megatron_lm_cpu"])
    assert patches.applied_patches() == [] and _machinery.stood_in("megatron_lm_cpu") == []


def test_a_checkout_of_another_release_than_megatron_core_is_refused_naming_both(monkeypatch, originals,
                                                                                 megatron_lm_on_path):
    """The checkout's training side calls megatron-core internals of its own release: a 0.19
    megatron-core under this checkout (or any other minor) is refused, both versions named."""
    release = _megatron_lm_release.checkout_release(str(megatron_lm_on_path))
    other = "0.19.2" if release.minor != (0, 19) else "0.18.2"
    # what the checkout check reads (the patch's own range check passes: both are supported)
    monkeypatch.setattr(_megatron_lm_release, "installed_megatron_core_version", lambda: other)
    for patch in ("megatron_lm_cpu", "megatron_lm_log"):
        with pytest.raises(UnsupportedMegatronLM) as err:
            patches.apply_megatron_patches(cpu_gloo=False, **{patch: True})
        assert release.tag in str(err.value) and f"megatron-core {other}" in str(err.value), str(err.value)
        assert patches.applied_patches() == [] and _machinery.stood_in(patch) == []
    _untouched(megatron_lm_cpu.PATCH, originals["megatron_lm_cpu"])


def test_a_megatron_lm_release_with_another_pretrain_is_refused(monkeypatch, originals, megatron_lm_on_path):
    """A pretrain() whose parameters are not those of the release the checkout names (here:
    Megatron-LM main's, without extra_args_provider or a config container): refused, nothing is
    patched and the stand-in is removed again."""
    release = _megatron_lm_release.checkout_release(str(megatron_lm_on_path))
    patches.apply_megatron_patches(cpu_gloo=False, megatron_lm_cpu=True)
    from megatron.training import training

    real = training.pretrain
    patches.revert_megatron_patches()

    def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                 process_non_loss_data_func=None, args_defaults={}, store=None):  # noqa: B006  (Megatron-LM's own)
        raise AssertionError("never called")

    monkeypatch.setattr(training, "pretrain", pretrain)
    for patch in ("megatron_lm_cpu", "megatron_lm_log"):
        with pytest.raises(UnsupportedMegatronLM, match=f"core_v{release.minor[0]}.{release.minor[1]}.x") as err:
            patches.apply_megatron_patches(cpu_gloo=False, **{patch: True})
        assert "inprocess_call_wrapper" in str(err.value)  # named as missing
        assert patches.applied_patches() == [] and _machinery.stood_in(patch) == []
    monkeypatch.setattr(training, "pretrain", real)
    _untouched(megatron_lm_cpu.PATCH, originals["megatron_lm_cpu"])


def test_pretrain_signature_check_names_the_supported_tags():
    def core_v0_16(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                   process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},  # noqa: B006
                   get_embedding_ranks=None, get_position_embedding_ranks=None, non_loss_data_func=None,
                   store=None, inprocess_call_wrapper=None):
        pass

    check_pretrain_signature(core_v0_16, (0, 16))
    check_pretrain_signature(core_v0_16, (0, 15))
    with pytest.raises(UnsupportedMegatronLM, match="core_v0.18.x"):
        check_pretrain_signature(core_v0_16, (0, 18))  # 0.18 takes a config container

    def renamed(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                process_non_loss_data_func=None, extra_args=None, args_defaults={},  # noqa: B006
                get_embedding_ranks=None, get_position_embedding_ranks=None, non_loss_data_func=None,
                store=None, inprocess_call_wrapper=None):
        pass

    with pytest.raises(UnsupportedMegatronLM) as err:
        check_pretrain_signature(renamed, (0, 16))
    assert SUPPORTED_TAGS in str(err.value) and "extra_args_provider" in str(err.value)


def test_cpu_patch_refuses_where_cuda_is_available(monkeypatch, originals):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CPU-only"):
        patches.apply_megatron_patches(cpu_gloo=False, megatron_lm_cpu=True)
    _untouched(megatron_lm_cpu.PATCH, originals["megatron_lm_cpu"])
    assert _machinery.stood_in("megatron_lm_cpu") == []


def test_training_log_observers_get_each_iteration_after_the_original():
    calls = []

    def original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                 skipped_iter, grad_norm, params_norm, num_zeros_in_grad, max_attention_logit, **kw):
        calls.append(("original", iteration))
        return "flag"

    wrapped = megatron_lm_log._make_training_log(original)
    seen = []
    observer = seen.append
    megatron_lm_log.add_observer(observer)
    try:
        out = wrapped({"objective": torch.tensor(-0.5)}, {}, 1e-3, 7, 1.0, True, 0, 0.25, None, None, 0,
                      pg_collection=None, is_first_iteration=False)
    finally:
        megatron_lm_log.remove_observer(observer)
    assert out == "flag" and calls == [("original", 7)]
    (event,) = seen
    assert event.iteration == 7 and event.grad_norm == 0.25 and event.learning_rate == 1e-3
    assert float(event.loss_dict["objective"]) == -0.5 and event.skipped_iter == 0
    wrapped({}, {}, 1e-3, 8, 1.0, True, 0, None, None, None, 0)
    assert len(seen) == 1  # removed observers are not called


def test_training_log_fields_are_bound_by_name_on_core_v0_15s_signature():
    """core_v0.15's training_log has decoupled_learning_rate fourth: a wrapper that reads fields
    by position reports the decoupled LR as the iteration, the iteration as the loss scale, and
    so on, with no error. Bound by name, each field is the one its name says."""
    def original(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, iteration, loss_scale,
                 report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad):
        return report_memory_flag

    wrapped = megatron_lm_log._make_training_log(original)
    wrapped.__wrapped__ = original  # as the machinery sets it
    seen = []
    megatron_lm_log.add_observer(seen.append)
    try:
        assert wrapped({"objective": torch.tensor(-0.25)}, {}, 2e-3, 5e-4, 11, 1.0, True, 1, 0.5, None, None) is True
        wrapped({}, {}, learning_rate=3e-3, decoupled_learning_rate=None, iteration=12, loss_scale=1.0,
                report_memory_flag=False, skipped_iter=0, grad_norm=None, params_norm=None, num_zeros_in_grad=None)
    finally:
        megatron_lm_log.remove_observer(seen.append)
    first, second = seen
    assert (first.iteration, first.learning_rate, first.skipped_iter, first.grad_norm) == (11, 2e-3, 1, 0.5)
    assert float(first.loss_dict["objective"]) == -0.25
    assert (second.iteration, second.learning_rate, second.grad_norm) == (12, 3e-3, None)
