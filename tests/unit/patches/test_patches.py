"""The patch machinery and the cpu_gloo patch, on the real megatron-core."""
from __future__ import annotations

import importlib
import inspect
import sys
import types

import pytest
import torch

from megatron_pg_agg import patches, versions
from megatron_pg_agg.patches import _machinery
from megatron_pg_agg.patches._machinery import MARKER, Patch, Target
from megatron_pg_agg.patches.cpu import cpu_gloo

PATCH = cpu_gloo.PATCH


def _owner_and_leaf(target: Target):
    owner = importlib.import_module(target.module)
    *path, leaf = target.attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, leaf


def _current(target: Target):
    owner, leaf = _owner_and_leaf(target)
    return vars(owner)[leaf] if inspect.isclass(owner) else getattr(owner, leaf)


def _snapshot(patch: Patch = PATCH) -> dict[str, object]:
    return {t.qualname: _current(t) for t in patch.targets}


def _assert_untouched(before: dict[str, object], patch: Patch = PATCH) -> None:
    for t in patch.targets:
        assert _current(t) is before[t.qualname], f"{t.qualname} was touched"
        assert getattr(_current(t), MARKER, None) is None
    assert patches.applied_patches() == []


@pytest.fixture(autouse=True)
def clean():
    """Every test starts and ends with no patch applied (other test modules may apply them)."""
    patches.revert_megatron_patches()
    yield
    patches.revert_megatron_patches()


def test_apply_replaces_every_target_and_keeps_original_as_wrapped():
    before = _snapshot()
    assert patches.apply_megatron_patches() == ["cpu_gloo"]
    assert patches.applied_patches() == ["cpu_gloo"] and patches.is_applied("cpu_gloo")
    for t in PATCH.targets:
        now = _current(t)
        assert now is not before[t.qualname], t.qualname
        assert now.__wrapped__ is before[t.qualname], t.qualname
        assert getattr(now, MARKER) == "cpu_gloo"
    fn = _current(Target("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", None))
    assert fn.__name__ == "_set_cuda_rng_state"  # functools.update_wrapper


def test_reapply_is_a_noop():
    patches.apply_megatron_patches()
    first = _snapshot()
    assert patches.apply_megatron_patches() == []
    assert _machinery.apply(PATCH) is False
    for name, obj in _snapshot().items():
        assert obj is first[name], name


def test_revert_restores_the_original_objects():
    before = _snapshot()
    patches.apply_megatron_patches()
    assert patches.revert_megatron_patches() == ["cpu_gloo"]
    _assert_untouched(before)
    assert patches.revert_megatron_patches() == []
    assert patches.apply_megatron_patches(cpu_gloo=False) == []
    _assert_untouched(before)


def test_an_older_release_is_refused_with_the_reason_before_touching_anything(monkeypatch):
    before = _snapshot()
    monkeypatch.setattr(_machinery, "installed_megatron_core_version", lambda: "0.14.1")
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")  # never overrides an older release
    with pytest.raises(RuntimeError) as err:
        patches.apply_megatron_patches()
    msg = str(err.value)
    assert "cpu_gloo" in msg and "0.14.1" in msg and cpu_gloo.SUPPORTED in msg
    assert "before 0.15" in msg and "grad_finalize_pgs" in msg  # the reason, not just the range
    _assert_untouched(before)


def test_a_newer_release_is_refused_naming_the_range_unless_the_override_is_set(monkeypatch):
    """Catches a range check that lets 0.20 through silently, or an override that is ignored."""
    before = _snapshot()
    monkeypatch.setattr(_machinery, "installed_megatron_core_version", lambda: "0.20.0")
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError) as err:
        patches.apply_megatron_patches()
    assert "0.20.0" in str(err.value) and versions.SUPPORTED_MEGATRON_CORE in str(err.value)
    assert versions.ALLOW_UNTESTED_ENV in str(err.value)
    _assert_untouched(before)
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    monkeypatch.setattr(versions, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="megatron-core 0.20.0 is newer than the tested range"):
        assert patches.apply_megatron_patches() == ["cpu_gloo"]


def test_every_supported_release_passes_the_version_check(monkeypatch):
    for release in ("0.15.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2"):
        monkeypatch.setattr(_machinery, "installed_megatron_core_version", lambda r=release: r)
        assert _machinery.check_version(PATCH) == release


def test_a_target_with_its_own_range_is_touched_only_on_those_releases(monkeypatch):
    """A symbol megatron-core dropped in some release: outside the target's range it is neither
    resolved nor replaced (else the patch would fail there), inside it is wrapped."""
    import megatron.core.pipeline_parallel.schedules as schedules

    original = schedules.get_forward_backward_func
    toy = Patch(name="toy_ranges", supported=cpu_gloo.SUPPORTED, why="test", targets=(
        Target("megatron.core.pipeline_parallel.schedules", "get_forward_backward_func",
               lambda o: lambda *a, **k: o(*a, **k), releases="<0.17"),
        Target("megatron.core.no_such_module_after_0_17", "x", lambda o: o, releases=">=0.17"),
    ))
    monkeypatch.setattr(_machinery, "installed_megatron_core_version", lambda: "0.16.1")
    assert _machinery.apply(toy)
    try:
        assert schedules.get_forward_backward_func.__wrapped__ is original
    finally:
        _machinery.revert(toy)
    assert schedules.get_forward_backward_func is original
    monkeypatch.setattr(_machinery, "installed_megatron_core_version", lambda: "0.18.2")
    with pytest.raises(RuntimeError, match="no_such_module_after_0_17"):
        _machinery.apply(toy)
    assert schedules.get_forward_backward_func is original


def test_prerelease_inside_range_is_accepted(monkeypatch):
    monkeypatch.setattr(_machinery, "installed_megatron_core_version", lambda: "0.16.2rc1")
    assert patches.apply_megatron_patches() == ["cpu_gloo"]


@pytest.mark.parametrize(
    "missing,needle",
    [
        (Target("megatron.core.pipeline_parallel.schedules", "no_such_symbol", lambda o: o),
         "megatron.core.pipeline_parallel.schedules.no_such_symbol"),
        (Target("megatron.core.no_such_module", "torch", lambda o: o), "megatron.core.no_such_module"),
        (Target("megatron.core.models.gpt.gpt_model", "GPTModel.setup_embeddings_and_output_layer",
                lambda o: o), "inherited"),
    ],
    ids=["symbol", "module", "inherited-method"],
)
def test_moved_symbol_raises_clear_error_and_touches_nothing(missing, needle):
    before = _snapshot()
    # the missing target comes last: every earlier (valid) target must stay untouched too
    broken = Patch(name="cpu_gloo_moved", supported=cpu_gloo.SUPPORTED, why="test",
                   targets=PATCH.targets + (missing,))
    with pytest.raises(RuntimeError, match="cpu_gloo_moved") as err:
        _machinery.apply(broken)
    assert needle in str(err.value) and "Nothing was patched" in str(err.value)
    _assert_untouched(before)
    assert not _machinery.is_applied(broken)


@pytest.mark.parametrize("missing,words", [
    ("openai", ["imports 'openai', which is not installed", "a missing dependency", 'pip install -e ".[megatron-rl]"']),
    ("some_unlisted_package", ["imports 'some_unlisted_package'", "pip install some_unlisted_package"]),
])
def test_a_missing_dependency_is_named_as_such_not_as_a_moved_module(tmp_path, monkeypatch, missing, words):
    """A target module whose own import fails for a package that is not installed (Megatron-LM's
    megatron.rl imports openai) is reported as a missing dependency with the extra that installs it,
    never as "megatron-core moved it"."""
    (tmp_path / "needs_a_package.py").write_text(f"import {missing}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, missing, None)  # importing it raises ModuleNotFoundError here
    before = _snapshot()
    broken = Patch(name="cpu_gloo_dependency", supported=cpu_gloo.SUPPORTED, why="test",
                   targets=PATCH.targets + (Target("needs_a_package", "torch", lambda o: o),))
    with pytest.raises(RuntimeError) as err:
        _machinery.apply(broken)
    for word in (*words, "Nothing was patched"):
        assert word in str(err.value), (word, str(err.value))
    assert "moved" not in str(err.value)
    _assert_untouched(before)


def test_refuses_when_cuda_is_available(monkeypatch):
    before = _snapshot()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CPU-only"):
        patches.apply_megatron_patches()
    _assert_untouched(before)


def test_shim_redirects_cuda_only_inside_megatron_modules():
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.transformer.utils import get_default_causal_mask

    patches.apply_megatron_patches()
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert p2p_communication.torch.cuda.current_device() == torch.device("cpu")
    assert p2p_communication.torch.cuda.synchronize() is None
    assert p2p_communication.torch.distributed is torch.distributed  # everything else delegates
    assert torch.equal(get_default_causal_mask(3), torch.ones(3, 3).triu(1).bool())
    # the user's torch is untouched
    assert sys.modules["torch"] is torch and torch.cuda.synchronize is not None
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_ddp_grad_sync_runs_on_cpu_on_this_release():
    """megatron-core 0.19's ``start_grad_sync`` always reads ``torch.cuda.current_stream()`` and
    waits on each parameter's CUDA-graph event: a real DDP model's grad sync (the path
    finalize_model_grads takes) must run on CPU under the patch. Catches a proxy without
    ``current_stream``/``wait_event`` ("Torch not compiled with CUDA" on a CPU torch, or no
    device on a CUDA build)."""
    import torch.distributed as dist

    from megatron_pg_agg.megatron.layout import ParallelSizes
    from megatron_pg_agg.megatron.model import build_model_chunks, wrap_in_ddp
    from megatron_pg_agg.megatron.parallel import init_distributed, init_parallel, teardown_parallel
    from megatron_pg_agg.parity.models import tiny_transformer_config

    patches.apply_megatron_patches()
    from megatron.core.distributed import param_and_grad_buffer

    stream = param_and_grad_buffer.torch.cuda.current_stream()
    assert stream.wait_event(object()) is None
    owns_group = not dist.is_initialized()
    init_distributed()
    init_parallel(ParallelSizes())
    try:
        config = tiny_transformer_config(num_layers=1)
        chunks = wrap_in_ddp(build_model_chunks(config, 64, 32, share_embeddings_and_output_weights=False), config)
        out = chunks[0](torch.randint(0, 64, (1, 8)), torch.arange(8)[None], None)
        out.float().sum().backward()
        for chunk in chunks:
            chunk.start_grad_sync()
            chunk.finish_grad_sync()
        grads = [p.main_grad for c in chunks for p in c.parameters() if p.requires_grad]
        assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    finally:
        teardown_parallel()
        if owns_group:
            dist.destroy_process_group()


def test_rng_tracker_forks_the_cpu_generator():
    from megatron.core import tensor_parallel

    patches.apply_megatron_patches()
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0,
                                                    force_reset_rng=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # default stream restored
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advanced
    expected = torch.Generator().manual_seed(123 + 2718)  # megatron's TP seed offset, tp_rank 0
    assert torch.equal(a, torch.rand(3, generator=expected))


def test_tensor_cuda_is_identity_only_inside_the_mode():
    t = torch.ones(2)
    with cpu_gloo._TensorCudaIsIdentity():
        assert t.cuda() is t
    with pytest.raises((AssertionError, RuntimeError)):
        t.cuda()


def test_revert_refuses_when_someone_else_replaced_a_target(monkeypatch):
    module = types.ModuleType("pg_agg_toy_module")
    module.f = lambda: "original"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    toy = Patch(name="toy", supported=cpu_gloo.SUPPORTED, why="test",
                targets=(Target(module.__name__, "f", lambda orig: lambda: "patched"),))
    original = module.f
    assert _machinery.apply(toy) and module.f() == "patched"
    module.f = lambda: "someone else"
    with pytest.raises(RuntimeError, match="replaced by something else"):
        _machinery.revert(toy)
    module.f = _machinery._APPLIED["toy"][0].replacement
    assert _machinery.revert(toy) and module.f is original


def test_interleaved_schedule_refuses_variable_seq_lengths():
    from megatron.core.pipeline_parallel import schedules

    patches.apply_megatron_patches()
    stub = types.SimpleNamespace(config=types.SimpleNamespace(variable_seq_lengths=True))
    with pytest.raises(RuntimeError, match="variable_seq_lengths"):
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=None, data_iterator=None, model=[stub], num_microbatches=2,
            seq_length=8, micro_batch_size=1,
        )


def test_the_optimizer_stand_in_is_needed_only_on_cpu_with_a_mixed_precision_or_distributed_optimizer():
    """What the trainer and both Megatron-LM entries ask before applying optimizer_cpu: a GPU never takes it,
    and a CPU run of plain fp32 torch Adam (which sorts no parameter by CUDA type) does not need it."""
    from megatron_pg_agg.patches.cpu import optimizer_cpu

    table = {(cuda, bf16, dist): optimizer_cpu.needed(cuda=cuda, bf16=bf16, distributed_optimizer=dist)
             for cuda in (False, True) for bf16 in (False, True) for dist in (False, True)}
    assert [key for key, needed in table.items() if needed] == [(False, False, True), (False, True, False),
                                                                 (False, True, True)]
