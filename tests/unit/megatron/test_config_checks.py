"""check_megatron_config refuses every setting under which the objective would silently change."""
import pytest
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

from megatron_pg_agg.megatron.config_checks import MegatronConfigError, check_megatron_config
from megatron_pg_agg.megatron.model import default_ddp_config
from megatron_pg_agg.parity.models import tiny_transformer_config


def _good(**overrides):
    config = tiny_transformer_config(**overrides)
    config.finalize_model_grads_func = finalize_model_grads
    return config


def test_a_correct_configuration_passes():
    check_megatron_config(_good(), default_ddp_config(), backend="gloo")
    check_megatron_config(_good(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                num_layers=4, batch_p2p_comm=True), default_ddp_config(), backend="nccl")


@pytest.mark.parametrize("make,words", [
    (lambda: (_good(calculate_per_token_loss=False), default_ddp_config()), ["calculate_per_token_loss"]),
    (lambda: (tiny_transformer_config(), default_ddp_config()), ["finalize_model_grads_func"]),
    (lambda: (_good(), DistributedDataParallelConfig(average_in_collective=True)), ["average_in_collective"]),
    (lambda: (_good(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, num_layers=4,
                    batch_p2p_comm=True), default_ddp_config()), ["batch_p2p_comm", "gloo"]),
])
def test_each_bad_setting_is_named(make, words):
    config, ddp = make()
    with pytest.raises(MegatronConfigError) as info:
        check_megatron_config(config, ddp, backend="gloo")
    for word in words:
        assert word in str(info.value)


def test_all_problems_are_listed_at_once():
    config = tiny_transformer_config(calculate_per_token_loss=False)
    with pytest.raises(MegatronConfigError) as info:
        check_megatron_config(config, DistributedDataParallelConfig(average_in_collective=True), backend="gloo")
    message = str(info.value)
    assert all(w in message for w in ("calculate_per_token_loss", "finalize_model_grads_func", "average_in_collective"))


def test_fusions_follow_the_device():
    """The trainer's model config: every fused kernel off on CPU (they are CUDA-only), Megatron-LM's
    defaults on CUDA (the JIT fusions on; the TE-kernel fusions on exactly when TE is usable), so a
    GPU run is never silently built with the CPU settings."""
    from megatron_pg_agg.megatron.model import JIT_FUSIONS, TE_FUSIONS, device_settings, transformer_config

    fusions = JIT_FUSIONS + TE_FUSIONS
    assert len(set(fusions)) == 6
    cpu = device_settings(cuda=False)
    assert all(cpu[name] is False for name in fusions) and cpu["use_cpu_initialization"]
    for te in (False, True):
        gpu = device_settings(cuda=True, te=te)
        assert all(gpu[name] is True for name in JIT_FUSIONS)
        assert all(gpu[name] is te for name in TE_FUSIONS)
        assert "use_cpu_initialization" not in gpu and "batch_p2p_comm" not in gpu  # Megatron's defaults
    here = device_settings()  # this machine's device
    config = transformer_config(num_layers=2, hidden_size=32, num_attention_heads=4)
    assert all(getattr(config, name) == here[name] for name in fusions) and config.calculate_per_token_loss
