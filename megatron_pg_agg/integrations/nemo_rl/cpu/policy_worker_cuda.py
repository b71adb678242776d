"""NeMo-RL's Megatron policy worker's training methods on CPU: the CUDA calls in its module.

WHY
    ``MegatronPolicyWorkerImpl.train`` and the split path (``begin_train_step`` /
    ``train_microbatch`` / ``finish_train_step``) in ``nemo_rl/models/policy/workers/megatron_policy_worker.py``
    make these CUDA calls of their own (beyond the ones in ``data.py`` and ``train.py``):
    ``torch.tensor(data.size, device="cuda")`` for the dataset size (``:787``);
    ``torch.cuda.synchronize()`` around the step (``:813``, ``:1046``, ``:1638``);
    ``torch.zeros((), dtype=float64, device="cuda")`` for the split path's counters (``:1220-1221``);
    ``torch.tensor(1.0, device="cuda")`` for its placeholder count and safe divisors (``:1479``,
    ``:1581``, ``:1703``, ``:1708``); ``torch.cuda.empty_cache()`` (``empty_unused_memory_level`` >= 1;
    ``:938``, ``:1002``, ``:1520``, ``:1656``); ``torch.cuda.get_device_name()`` in the returned metrics
    (``:1067``, ``:1769``). ``_log_gpu_mem`` returns early where ``torch.cuda.is_available()`` is False.

WHAT / HOW (a namespace proxy; no method is copied or wrapped)
    ``torch`` in the worker module's namespace is the ``training`` CPU proxy of the project's
    ``cpu_gloo`` machinery (``cpu_torch.make_torch_proxy(training=True)``: a CUDA ``device``
    argument lands on the CPU, ``synchronize``/``empty_cache`` are no-ops, the current device is the
    CPU), whose ``cuda.get_device_name()`` also answers ``"cpu"`` (the metrics' ``gpu_name``). Every
    other attribute is the real ``torch`` (``torch.cuda.is_available()`` stays False).

    CPU-only: refuses to apply when ``torch.cuda.is_available()``. Applying it imports the worker
    module, so ``nemo_rl_mcore_fsdp_adapter_names`` and ``nemo_rl_global_batch_counts`` go first.

TARGETS (NeMo-RL 0.6.0 @ 7ea279a; megatron-core 0.19)
    ``nemo_rl.models.policy.workers.megatron_policy_worker.torch``.
"""
from __future__ import annotations

from megatron_pg_agg.integrations.nemo_rl.cpu._common import Target, cpu_torch, stand_in

NAME = "nemo_rl_policy_worker_cuda"
WORKER = "nemo_rl.models.policy.workers.megatron_policy_worker"


def _make_worker_torch(original):
    proxy = cpu_torch.make_torch_proxy(training=True)(original)
    proxy.cuda.get_device_name = lambda *args, **kwargs: "cpu"
    return proxy


PATCH = stand_in(NAME, __doc__, Target(WORKER, "torch", _make_worker_torch))
