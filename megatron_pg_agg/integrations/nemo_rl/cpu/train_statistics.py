"""NeMo-RL's training-statistics reduction on CPU: ``aggregate_training_statistics``'s ``device="cuda"``.

WHY
    ``aggregate_training_statistics`` (``nemo_rl/models/megatron/train.py:834-866``) puts this rank's
    per-step losses in ``torch.tensor(losses, device="cuda")`` (``:855``) before all-reducing them over
    the data-parallel group. Both worker paths end with it (``train``: ``megatron_policy_worker.py:1053``;
    ``finish_train_step``: ``:1759``), so on a CPU machine every training step fails after the
    optimizer step.

WHAT / HOW (a namespace proxy; no NeMo-RL function is copied or wrapped)
    ``torch`` in ``nemo_rl.models.megatron.train``'s namespace is the CPU proxy of the project's
    ``cpu_gloo`` patch (``cpu_torch._TorchOnCpu``): a CUDA ``device`` argument of the tensor
    factories lands on the CPU and ``torch.cuda.current_device()`` is the CPU; every other attribute
    is the real ``torch``. That module has no other CUDA spot (``LossPostProcessor``,
    ``megatron_forward_backward`` and the forward step use their inputs' devices).

    CPU-only: refuses to apply when ``torch.cuda.is_available()``.

TARGETS (NeMo-RL 0.6.0 @ 7ea279a; megatron-core 0.19)
    ``nemo_rl.models.megatron.train.torch``.
"""
from __future__ import annotations

from megatron_pg_agg.integrations.nemo_rl.cpu._common import Target, cpu_torch, stand_in

NAME = "nemo_rl_train_statistics"

PATCH = stand_in(NAME, __doc__, Target("nemo_rl.models.megatron.train", "torch", cpu_torch.make_torch_proxy()))
