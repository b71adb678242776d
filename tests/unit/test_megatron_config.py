"""check_megatron_config refuses every setting under which the objective would silently change."""
import pytest
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads

from megatron_pg_agg.megatron_loss import MegatronConfigError, check_megatron_config
from megatron_pg_agg.model import default_ddp_config
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
