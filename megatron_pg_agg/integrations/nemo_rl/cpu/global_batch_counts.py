"""NeMo-RL's global-batch valid counts on CPU: ``process_global_batch``'s ``.cuda()`` keeps them on the CPU.

WHY
    ``process_global_batch`` (``nemo_rl/models/megatron/data.py:778-828``) computes this rank's
    ``local_valid_seqs = sum(sample_mask)`` and ``local_valid_toks = sum(token_mask[:, 1:] * sample_mask)``
    (``:806-813``), stacks them with ``torch.tensor([...]).cuda()`` (``:815``) and all-reduces them over
    the data-parallel group (``:816``). ``.cuda()`` is a ``Tensor`` method, so no module namespace can
    redirect it; on a CPU machine the call fails. The worker's ``train`` calls the function once per
    optimizer step (``megatron_policy_worker.py:821-826``).

WHAT
    The same function, run in the torch-function mode of the project's ``cpu_gloo`` patch in which
    ``Tensor.cuda()`` returns the tensor itself (``cpu_torch._TensorCudaIsIdentity``), for the
    duration of the call only. The counts keep NeMo-RL's dtype (that of ``sample_mask``/``token_mask``:
    float32 for float masks) and the gloo all-reduce runs unchanged.

HOW (a wrapper, never a copy)
    ``nemo_rl.models.megatron.data.process_global_batch`` is wrapped. The worker module imports the name
    at its top (``megatron_policy_worker.py:71-74``), so this patch must be applied before the worker
    is imported (:func:`standins.apply_nemo_rl_cpu_patches` does so; the worker cannot be imported
    earlier anyway without ``nemo_rl_mcore_fsdp_adapter_names``). Applying it after the worker was
    imported is refused with that reason. Reverting restores the name in ``data``; a worker module
    imported while the patch was applied keeps the wrapper it bound at import (re-import it for a clean
    state).

    CPU-only: refuses to apply when ``torch.cuda.is_available()``.

TARGETS (NeMo-RL 0.6.0 @ 7ea279a; megatron-core 0.19)
    ``nemo_rl.models.megatron.data.process_global_batch``.
"""
from __future__ import annotations

import sys

from megatron_pg_agg.integrations.nemo_rl.cpu._common import Target, cpu_torch, require_cpu, stand_in

NAME = "nemo_rl_global_batch_counts"
DATA = "nemo_rl.models.megatron.data"
WORKER = "nemo_rl.models.policy.workers.megatron_policy_worker"


def _precondition() -> None:
    require_cpu(NAME)()
    worker = sys.modules.get(WORKER)
    if worker is not None and not hasattr(getattr(worker, "process_global_batch", None), "__wrapped__"):
        raise RuntimeError(
            f"patch {NAME!r}: {WORKER} was imported before the patch and holds the unwrapped "
            f"process_global_batch; apply the NeMo-RL CPU stand-ins before importing the worker. Nothing was patched.")


PATCH = stand_in(NAME, __doc__,
                 Target(DATA, "process_global_batch", cpu_torch.under_mode(cpu_torch._TensorCudaIsIdentity)),
                 precondition=_precondition)
