"""CPU stand-ins (shipped as megatron_pg_agg.patches.cpu): patches that only make CPU runs and tests possible.

Each module here redirects megatron-core's or Megatron-LM's CUDA-only spots (buffers, streams, RNG,
``Tensor.cuda()``, builds, modules that import GPU-only packages) to the CPU, so the real megatron-core
and Megatron-LM code runs on a CPU machine with gloo, for the trainer and the Megatron-LM entries.
The hosts' stand-ins (Megatron-Bridge, AReaL, NeMo-RL) live in their folders'
``megatron_pg_agg.integrations.<host>.cpu`` and build on :mod:`.cpu_gloo`, :mod:`.optimizer_cpu` and
:mod:`.cpu_torch` (the CPU proxies of ``torch``). None of them changes
what a run computes on a GPU: every patch here refuses to apply where ``torch.cuda.is_available()``
(its precondition). The patches that can change a run, and the machinery, are one folder up
(:mod:`megatron_pg_agg.patches`, whose docstring lists both groups).
"""
