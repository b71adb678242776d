"""CPU stand-ins (shipped as megatron_pg_agg.patches.cpu): patches that only make CPU runs and tests possible.

Each module here redirects a library's CUDA-only spots (buffers, streams, RNG, ``Tensor.cuda()``,
builds, modules that import GPU-only packages) to the CPU, so the real megatron-core,
Megatron-LM, Megatron-Bridge, AReaL and NeMo-RL code runs on a CPU machine with gloo. None of them changes
what a run computes on a GPU: every patch here refuses to apply where ``torch.cuda.is_available()``
(its precondition). The patches that can change a run, and the machinery, are one folder up
(:mod:`megatron_pg_agg.patches`, whose docstring lists both groups).
"""
