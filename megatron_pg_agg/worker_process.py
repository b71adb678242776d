"""Process-level settings of the project's torchrun workers (both entry points use them)."""
from __future__ import annotations

import os
import sys


def die_with_launcher() -> None:
    """Ask Linux to SIGTERM this worker when its parent (the torchrun agent) dies. torchrun starts
    workers in their own sessions, so a killed agent would otherwise leave them running (and
    holding GPUs) forever."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes
    import signal

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def release_process_group() -> None:
    """Destroy this worker's process group (and megatron's model-parallel state), if it made one.

    The entry points call this on their handled stops (every rank reaches them together): a
    process that exits with a live gloo group can abort in the group's destructor ("terminate
    called without an active exception", SIGABRT), and the launcher then reports -6 instead of
    the documented status. A bad flag that stops before torch is imported imports nothing here.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from .parallel import shutdown_distributed

        shutdown_distributed()


def keep_freed_memory() -> None:
    """Tell glibc malloc to keep freed large blocks instead of returning them to the OS.

    Step planning allocates and frees many tensors of the step's size; by default glibc serves
    each from fresh mmap pages, so the kernel zero-fills every page again (the page faults made
    planning 8M tokens superlinear: 1.4 s instead of 0.75 s, benchmarks/bench_planner.py). The
    same effect as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, for this process only; an
    application decision, so the launcher makes it, never the library.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 34)


CPU_FALLBACK_WARNINGS = (
    # megatron-core, at import, when neither Transformer Engine nor NVIDIA apex is installed
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
)
"""Messages (regex, UserWarning) of megatron-core's expected fallbacks on a machine without
Transformer Engine and apex: each module warns once per process (~30 lines for 2 ranks)."""


def quiet_cpu_fallbacks(prefix: str) -> None:
    """Silence exactly megatron-core's known fallback warnings (by message and category; every
    other warning still shows) and say in one line, on rank 0, which fallbacks are in use. Call
    before importing megatron.core. Nothing is silenced where Transformer Engine is installed."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("transformer_engine") is not None:
        return
    for message in CPU_FALLBACK_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    if os.environ.get("RANK", "0") == "0":
        print(f"{prefix} no Transformer Engine or apex: megatron-core falls back to torch norms, torch "
              "optimizers and local multi-tensor kernels (its warnings about them are silenced)",
              file=sys.stderr, flush=True)
