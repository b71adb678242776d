"""The megatron_rl patch: its wrappers alone (any release), and applied to the real
megatron-core 0.19 + Megatron-LM core_v0.19 (only there: the patch supports that release alone)."""
from __future__ import annotations

import inspect
import sys
import types

import pytest

from megatron_pg_agg.patches import megatron_rl
from megatron_pg_agg.versions import in_range, installed_megatron_core_version

RL_RELEASE = in_range(installed_megatron_core_version(), megatron_rl.SUPPORTED)


def test_fp32_output_is_dropped_only_when_it_asks_for_fp32_logits():
    calls = []

    def forward(self, input_ids, position_ids, attention_mask, **kwargs):
        calls.append(kwargs)
        return "logits"

    wrapped = megatron_rl._make_forward(forward)
    assert wrapped(None, 1, 2, 3, fp32_output=True, packed_seq_params="p") == "logits"
    assert calls == [{"packed_seq_params": "p"}]
    with pytest.raises(TypeError, match="Float16Module"):
        wrapped(None, 1, 2, 3, fp32_output=False)

    def fixed(self, input_ids, fp32_output=True):  # a release that takes the keyword keeps its forward
        return fp32_output

    assert megatron_rl._make_forward(fixed) is fixed


def test_the_shutdown_is_skipped_only_when_nothing_was_started(monkeypatch):
    module = types.SimpleNamespace(_INFERENCE_INTERFACE=None, _ROLLOUT_GENERATOR=None)
    monkeypatch.setitem(sys.modules, megatron_rl.RL_UTILS, module)
    called = []
    shutdown = megatron_rl._make_shutdown(lambda: called.append(1))
    assert shutdown() is None and called == []
    module._INFERENCE_INTERFACE = object()  # a live engine: upstream's shutdown (and its hard exit) runs
    shutdown()
    assert called == [1]
    module._INFERENCE_INTERFACE, module._ROLLOUT_GENERATOR = None, object()
    shutdown()
    assert called == [1, 1]


def test_a_registered_function_gets_every_argument_by_name(monkeypatch):
    def original(model, ref_state_dict, rollouts, tokenizer, sequence_packing, is_correction):
        return "megatron"

    got = {}
    monkeypatch.setattr(megatron_rl, "_COLLECTION_PLANNER", None)
    dispatch = megatron_rl._make_dispatch(lambda: megatron_rl._COLLECTION_PLANNER)(original)
    assert dispatch(1, 2, 3, 4, False, is_correction=True) == "megatron"
    megatron_rl.set_collection_planner(lambda **kw: got.update(kw) or "ours")
    assert dispatch(1, 2, 3, 4, False, is_correction=True) == "ours"
    assert got == dict(model=1, ref_state_dict=2, rollouts=3, tokenizer=4, sequence_packing=False, is_correction=True)


def _schedule_calls():
    calls = []

    def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                                       micro_batch_size, forward_only=False):
        calls.append((num_microbatches, forward_only))
        return []

    return calls, megatron_rl._make_schedule_getter(lambda: forward_backward_no_pipelining)()


def test_the_training_schedule_runs_the_registered_microbatch_count(monkeypatch):
    """Megatron-LM's train_step passes get_num_microbatches() (B / DP sequences): with a count
    registered, the schedule runs the packed step's microbatches instead."""
    monkeypatch.setattr(megatron_rl, "_MICROBATCH_COUNT", None)
    calls, schedule = _schedule_calls()
    kw = dict(forward_step_func=None, data_iterator=None, model=[], seq_length=64, micro_batch_size=1)
    schedule(num_microbatches=8, **kw)
    megatron_rl.set_microbatch_count(lambda: 3)
    schedule(num_microbatches=8, **kw)
    schedule(num_microbatches=8, forward_only=True, **kw)  # log-prob and eval passes keep theirs
    megatron_rl.set_microbatch_count(None)
    schedule(num_microbatches=8, **kw)
    assert calls == [(8, False), (3, False), (8, True), (8, False)]


@pytest.mark.skipif(not RL_RELEASE, reason=f"the megatron_rl patch supports megatron-core {megatron_rl.SUPPORTED} "
                                           f"(installed {installed_megatron_core_version()})")
def test_applied_to_megatron_lm_core_v0_19_and_reverted(megatron_lm_on_path):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_pg_agg.patches import apply_megatron_patches, revert_megatron_patches
    from megatron_pg_agg.patches._machinery import MARKER, is_applied

    original = GPTModel.forward
    # the defect the patch is for: still in this release (when this fails, upstream fixed it)
    assert "fp32_output" not in inspect.signature(original).parameters
    try:
        assert "megatron_rl" in apply_megatron_patches(cpu_gloo=False, megatron_rl=True)
        from megatron.rl import rl_utils

        assert GPTModel.forward.__wrapped__ is original
        for name in ("get_environment_rollouts", "prepare_data_for_update", "rl_inference_interface_shutdown"):
            assert getattr(getattr(rl_utils, name), MARKER) == "megatron_rl", name
        from megatron.training import training

        assert getattr(training.get_forward_backward_func, MARKER) == "megatron_rl"
        rl_utils.rl_inference_interface_shutdown()  # nothing started: returns (the original would os._exit)
    finally:
        revert_megatron_patches()
    assert not is_applied("megatron_rl") and GPTModel.forward is original
