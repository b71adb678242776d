"""CPU/gloo shim for Megatron-LM's RL loop (``megatron/rl``): its data path runs on a CPU-only machine.

WHY
    ``megatron.rl.rl_utils`` and ``megatron.rl.sequence_packing_utils`` prepare each rollout
    collection on the GPU: advantages and microbatches are moved with ``Tensor.cuda()``, the
    log-prob pass of the old and reference policies ends with ``torch.cuda.synchronize()`` and
    ``empty_cache()``, counters are made with ``device='cuda'``. None of it computes anything a
    CPU cannot; with this patch (and :mod:`.cpu_gloo`, :mod:`.megatron_lm_cpu`) Megatron-LM's own
    RL data path (advantages, trajectories, the old and reference log-prob passes, its own loss
    for the peer cross-check) runs on CPU with gloo, so the RL entry is tested for real in CI.
    CPU-only: it refuses to apply when ``torch.cuda.is_available()``.

HOW (wrappers only, never a copy of an upstream function)
    * ``torch`` in ``megatron.rl.rl_utils`` and ``megatron.rl.sequence_packing_utils`` is the CPU
      proxy of :mod:`.cpu_torch` (CUDA factories on the CPU, synchronize/empty_cache no-ops).
    * ``rl_utils.get_grpo_data_iterator`` (the whole collection: rollouts, advantages, the
      log-prob passes, the data iterator) runs with ``Tensor.cuda()`` as the identity.

TARGETS (megatron-core >=0.19,<0.20 with Megatron-LM core_v0.19.x): the names above. CPU only.
"""
from __future__ import annotations

from .._machinery import Patch, Target
from .._megatron_lm_release import check_checkout
from ..megatron_rl import RL_UTILS, SUPPORTED, UNSUPPORTED_REASON
from .cpu_torch import _TensorCudaIsIdentity, make_torch_proxy, under_mode
from .megatron_lm_cpu import _require_cpu_only

NAME = "megatron_rl_cpu"
PACKING_UTILS = "megatron.rl.sequence_packing_utils"

PATCH = Patch(
    name=NAME,
    supported=SUPPORTED,
    why=__doc__,
    unsupported_reason=UNSUPPORTED_REASON + ".",
    precondition=_require_cpu_only,
    verify=check_checkout,
    targets=(
        Target(RL_UTILS, "torch", make_torch_proxy(training=True)),
        Target(PACKING_UTILS, "torch", make_torch_proxy(training=True)),
        Target(RL_UTILS, "get_grpo_data_iterator", under_mode(_TensorCudaIsIdentity)),
    ),
)
