"""Process-group and model-parallel set-up shared by tests, workers and benchmarks.

WHY
    Starting a process and importing megatron-core costs seconds, so tests run many parallel
    layouts inside one launch: ``init_parallel`` tears down the previous layout
    (``destroy_model_parallel``) and initialises the next one, then seeds megatron's RNG tracker
    the way Megatron-LM does. On CPU the RNG tracker needs the ``cpu_gloo`` patch
    (``megatron_pg_agg.patches``).

    A torn-down layout's models must be freeable: megatron-core caches rotary ``forward`` per
    module instance (``functools.lru_cache`` on the method, up to 32 calls per class), which keeps
    a finished model alive, and through its hooks the DDP wrapper, its buckets and every process
    group they hold: on gloo each group keeps 3 threads, so runs back to back in one process grew
    to thousands of threads. :func:`teardown_parallel` empties those caches.
"""
from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from .layout import ParallelSizes

__all__ = ["ParallelSizes", "free_port", "init_distributed", "init_parallel", "release_module_caches",
           "teardown_parallel"]

MODULE_CACHES = (
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding"),
)
"""megatron-core classes whose ``forward`` is an ``lru_cache`` keyed by the module instance
(module, class name; both releases 0.16 and 0.19)."""


def free_port() -> int:
    """A TCP port that was free a moment ago (for single-process rendezvous in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    *, backend: Optional[str] = None, world_size: Optional[int] = None, rank: Optional[int] = None,
    port: Optional[int] = None, timeout_s: float = 120.0,
) -> None:
    """Initialise ``torch.distributed`` once (a no-op if already initialised).

    Under ``torchrun`` the environment provides rank, world size and rendezvous. Without it,
    pass nothing for a 1-rank group on a free local port (tests). The backend defaults to gloo
    without CUDA and nccl with it.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ and rank is None:
        rank = 0
        world_size = 1 if world_size is None else world_size
    if port is not None or "MASTER_PORT" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port if port is not None else free_port())
    kwargs = {} if rank is None else dict(rank=rank, world_size=world_size)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)


def init_parallel(
    layout: ParallelSizes, *, seed: int = 1234, ep: int = 1, timeout_minutes: Optional[float] = None,
) -> ParallelSizes:
    """(Re)initialise megatron's model-parallel state for one layout and seed its RNG tracker.

    ``torch.distributed`` must be initialised (see :func:`init_distributed`); the data-parallel
    size is ``world_size / (tp * pp * cp)`` (a ``layout.dp`` that disagrees is refused). ``ep``:
    expert-parallel size (carved out of DP). ``timeout_minutes`` is the timeout of megatron's
    process groups (DP, TP, PP, ...: the ones the schedules and DDP use); None keeps megatron's
    default (30 minutes). Returns the layout with ``dp`` filled in.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_distributed() first")
    tp, pp, vpp, cp = layout.tp, layout.pp, layout.vpp, layout.cp
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp * pp * cp}")
    if layout.dp is not None and layout.dp * tp * pp * cp != world:
        raise ValueError(f"{layout} needs {layout.dp * tp * pp * cp} ranks; the world has {world}")
    if vpp is not None and pp < 2:
        raise ValueError("virtual pipeline stages (vpp) need pp >= 2")
    teardown_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        **({} if timeout_minutes is None else {"distributed_timeout_minutes": timeout_minutes}),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelSizes(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=world // (tp * pp * cp))


def teardown_parallel() -> None:
    """Forget megatron's model-parallel state and the module caches that would keep its models
    alive (the process group itself stays)."""
    release_module_caches()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def release_module_caches() -> None:
    """Empty the :data:`MODULE_CACHES` of the classes that are loaded (see the module docstring):
    a model nothing else holds can then be collected with its process groups."""
    for module_name, class_name in MODULE_CACHES:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        cache_clear = getattr(getattr(cls, "forward", None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


def shutdown_distributed() -> None:
    """Forget megatron's model-parallel state and destroy the default process group, if any
    (:func:`megatron_pg_agg.training.worker_process.release_process_group` says why every exit needs it)."""
    teardown_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
