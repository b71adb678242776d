"""torch FSDP2 is refused with this project's loss (megatron.config_checks.TORCH_FSDP2_REASON): the
fact the refusal rests on, on the installed megatron-core, and where the refusal stands.

megatron-core's ``finalize_model_grads`` divides the gradients by the step's token count W only
through ``model_chunk.scale_gradients(1 / W)`` under ``calculate_per_token_loss``. Its torch-FSDP2
wrapper inherits ``_BaseDataParallel.scale_gradients``, which does nothing, so that division is lost
(FSDP2 itself averages over DP x CP instead). If a release gives the wrapper a real
``scale_gradients``, the first test fails and the refusal should be revisited for that release."""
from __future__ import annotations

import torch

from megatron_pg_agg.megatron.config_checks import TORCH_FSDP2_REASON


def test_megatron_cores_torch_fsdp2_wrapper_does_not_scale_gradients():
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

    assert TorchFullyShardedDataParallel.scale_gradients is _BaseDataParallel.scale_gradients
    # what finalize_model_grads calls with 1/W: the gradient is left as it is
    layer = torch.nn.Linear(3, 2)
    layer(torch.ones(4, 3)).sum().backward()
    before = [p.grad.clone() for p in layer.parameters()]
    TorchFullyShardedDataParallel.scale_gradients(layer, 1.0 / 37)
    assert all(torch.equal(p.grad, b) for p, b in zip(layer.parameters(), before))


def test_finalize_model_grads_scales_only_through_the_wrappers_method():
    """The division by W lives in the wrapper's scale_gradients (so a no-op there loses it)."""
    import importlib
    import inspect

    module = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    source = inspect.getsource(module.finalize_model_grads)
    assert "model_chunk.scale_gradients(scaling)" in source and "num_tokens" in source


def test_the_megatron_lm_entries_and_bridge_refuse_it_naming_the_key():
    from megatron_pg_agg.megatron.upstream_bugs import MEGATRON_LM_NAMES, known_bug_problems

    base = dict(softmax_type=None, tensor_model_parallel_size=1, experimental_attention_variant=None,
                use_megatron_fsdp=False)
    assert known_bug_problems(**base, use_torch_fsdp2=False, names=MEGATRON_LM_NAMES) == []
    (problem,) = known_bug_problems(**base, use_torch_fsdp2=True, names=MEGATRON_LM_NAMES)
    assert problem.startswith("--use-torch-fsdp2: ") and TORCH_FSDP2_REASON in problem
