"""The Megatron settings under which the exact objective would silently be wrong, refused before
any step runs (both entries and every test worker call :func:`check_megatron_config`)."""
from __future__ import annotations

from typing import Optional

import torch

from megatron_pg_agg.patches import moe_aux_loss, mtp_loss

TORCH_FSDP2_REASON = (
    "megatron-core's torch-FSDP2 wrapper (TorchFullyShardedDataParallel, 0.15-0.19) does not scale "
    "gradients (it inherits _BaseDataParallel.scale_gradients, a no-op) while FSDP2 itself averages over "
    "DP x CP, so with calculate_per_token_loss finalize_model_grads' division by the step's token count W is "
    "lost and the gradient comes out W/(DP*CP) times too large; use megatron-core's DDP, optionally with the "
    "distributed optimizer")
"""Why torch FSDP2 (``use_torch_fsdp2``) is refused wherever a user can turn it on with this project's
loss (the Megatron-LM entries, Megatron-Bridge, the host plug-ins); each caller names its own key."""


class MegatronConfigError(ValueError):
    """A Megatron configuration under which the objective would silently be wrong."""


def check_megatron_config(config, ddp_config=None, *, backend: Optional[str] = None) -> None:
    """Refuse configurations that break the exact objective, before any step runs.

    MoE: experts with a router aux/z loss need the ``moe_aux_loss`` patch (otherwise megatron-core
    scales those losses by N_routed / W), and experts with linear biases are refused. Multi-token
    prediction needs the ``mtp_loss`` patch (otherwise its loss is normalised by W instead of the
    step's valid tokens) and a positive ``mtp_loss_scaling_factor``.

    ``config`` is the model's TransformerConfig (the one the schedule reads), ``ddp_config`` the
    DistributedDataParallelConfig, ``backend`` the torch.distributed backend (read from the
    default group when None and one is initialised).
    """
    problems = []
    if not getattr(config, "calculate_per_token_loss", False):
        problems.append(
            "config.calculate_per_token_loss is False: the schedule would divide each microbatch's "
            "loss by its own count and by num_microbatches (a mean of means). Set it to True."
        )
    if getattr(config, "finalize_model_grads_func", None) is None:
        problems.append(
            "config.finalize_model_grads_func is unset: nothing would all-reduce the counts and "
            "divide the gradients. Set it to megatron.core.distributed.finalize_model_grads."
        )
    if ddp_config is not None and getattr(ddp_config, "average_in_collective", False):
        problems.append(
            "ddp_config.average_in_collective is True: gradients would be averaged over DP before "
            "the division by the global count. Set it to False."
        )
    if backend is None and torch.distributed.is_available() and torch.distributed.is_initialized():
        backend = torch.distributed.get_backend()
    interleaved = getattr(config, "virtual_pipeline_model_parallel_size", None) not in (None, 1)
    if interleaved and backend == "gloo" and getattr(config, "batch_p2p_comm", True):
        problems.append(
            "interleaved pipeline with batch_p2p_comm=True on gloo matches p2p messages out of "
            "order and gives wrong gradients. Set config.batch_p2p_comm=False (and "
            "batch_p2p_sync=False)."
        )
    problems.extend(_moe_problems(config))
    problems.extend(_mtp_problems(config))
    if problems:
        raise MegatronConfigError("megatron_pg_agg cannot guarantee the objective:\n- " + "\n- ".join(problems))


def _router_loss_coefficients(config) -> list:
    coeffs = getattr(config, "moe_aux_loss_coeff", 0.0)
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs]
    return [c for c in (*coeffs, getattr(config, "moe_z_loss_coeff", None)) if c is not None]


def _mtp_problems(config) -> list:
    """Multi-token prediction needs the mtp_loss patch (otherwise megatron-core normalises its
    loss by the policy-gradient weight W) and a positive loss scaling factor."""
    layers = getattr(config, "mtp_num_layers", None)
    if not layers:
        return []
    problems = []
    if not mtp_loss.is_active():
        problems.append(
            f"config.mtp_num_layers={layers} without the mtp_loss patch: megatron-core's MTP gradient "
            "would be divided by the policy-gradient weight W instead of the step's valid tokens D "
            "(D / W times too strong under seq_mean). Apply it (megatron_pg_agg.patches."
            "apply_megatron_patches(mtp_loss=True); megatron-core 0.16 or newer) and call "
            "begin_mtp_step / set_mtp_loss_scale(pg_weight, valid_tokens) every step.")
    factor = getattr(config, "mtp_loss_scaling_factor", None)
    if factor is None or not factor > 0:
        problems.append(f"config.mtp_loss_scaling_factor={factor}: MTP needs a factor > 0 (Megatron's "
                        "default is 0.1); drop MTP (mtp_num_layers=None) to train without it.")
    return problems


def _moe_problems(config) -> list:
    """MoE settings check_megatron_config refuses."""
    problems = []
    if not getattr(config, "num_moe_experts", None):
        return problems
    if (getattr(config, "calculate_per_token_loss", False) and not moe_aux_loss.is_active()
            and any(c > 0 for c in _router_loss_coefficients(config))):
        problems.append(
            f"config.num_moe_experts={config.num_moe_experts} with a router aux/z loss "
            "(moe_aux_loss_coeff / moe_z_loss_coeff > 0) and calculate_per_token_loss: megatron-core "
            "multiplies those losses by the routed token count, which is only right when the global "
            "count is the token count; here it is the policy-gradient weight, so their gradient "
            "would be scaled by about N_routed / W (up to thousands of times, and non-zero on a "
            "W = 0 step). Apply the moe_aux_loss patch (megatron_pg_agg.patches."
            "apply_megatron_patches(moe_aux_loss=True)) and call set_moe_aux_loss_scale(pg_weight, "
            "total_microbatches) every step."
        )
    if getattr(config, "add_bias_linear", False):
        problems.append(
            f"config.num_moe_experts={config.num_moe_experts} with add_bias_linear=True: megatron-core "
            "0.16's expert MLP adds its bias in place on a custom-Function view (mlp.py ~247), which "
            "autograd refuses at the first forward. Set add_bias_linear=False (as MoE models usually do)."
        )
    return problems
