"""Process-level settings of the project's torchrun workers (both entry points use them)."""
from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import re
import signal
import sys
import warnings
from dataclasses import dataclass
from typing import Optional

from megatron_pg_agg.versions import distribution_version, in_range

logger = logging.getLogger(__name__)


def die_with_launcher() -> None:
    """Ask Linux to SIGTERM this worker when its parent (the torchrun agent) dies. torchrun starts
    workers in their own sessions, so a killed agent would otherwise leave them running (and
    holding GPUs) forever."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
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
        # megatron-core only where a process group exists (it is loaded by then)
        from megatron_pg_agg.megatron.parallel import shutdown_distributed  # noqa: PLC0415

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
    libc = ctypes.CDLL("libc.so.6")
    # mallopt(int, int): declared, so that a value that does not fit a C int is an error here
    # rather than silently truncated (1 << 34 became 0: trim on every free, the opposite intent)
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3
    for name, param, value in (("M_MMAP_THRESHOLD", m_mmap_threshold, 1 << 30),
                               ("M_TRIM_THRESHOLD", m_trim_threshold, (1 << 31) - 1)):
        if libc.mallopt(param, value) != 1:  # glibc returns 1 on success
            logger.warning(f"glibc refused mallopt({name}, {value}): freed planning buffers go back to "
                           "the OS (slower planning, same results)")


@dataclass(frozen=True)
class KnownNoise:
    """One start-up message of megatron-core (or torch) that says nothing a user of this project
    can act on, silenced by its exact message, only on the releases where it was seen."""

    message: str
    """Regex, matched at the start of the message (``re.match``)."""
    why: str
    """Why it is harmless here."""
    releases: Optional[str] = None
    """megatron-core releases (specifier set) that emit it; None: all supported."""
    category: Optional[type] = UserWarning
    """A ``warnings.warn`` message of this category; None for a ``logging`` record."""
    logger: Optional[str] = None
    """The logger of a ``logging`` record."""
    cpu_fallback: bool = False
    """Only where Transformer Engine is not installed (the fallback it announces is then in use)."""


KNOWN_NOISE: tuple[KnownNoise, ...] = (
    KnownNoise(r"Transformer Engine and Apex are not installed\. Falling back to ",
               "megatron-core's local kernels stand in (each module warns once per process)", cpu_fallback=True),
    KnownNoise(r"Apex is not installed\. Falling back to Torch Norm", "torch norms stand in", cpu_fallback=True),
    KnownNoise(r"Only transformer-engine>=1\.7\.0 supports MoE experts, but your version is 0\.0\.0",
               "without TE the local expert implementation is used", releases=">=0.18", cpu_fallback=True),
    KnownNoise(r"MimoModelConfig is experimental", "an import-time notice of a model class this project never "
               "builds", releases=">=0.17"),
    KnownNoise(r"absl\.logging is not installed", "megatron-core's grid falls back to the logging module",
               releases=">=0.17"),
    KnownNoise(r"Failed to create unified memory mempool", "inference's unified memory: CUDA only, never "
               "used by training", releases="<0.16"),
    KnownNoise(r"GPTModel IS DEPRECATED", "a notice on every GPTModel (what Megatron-LM's gpt_builder builds "
               "too); it works unchanged", releases=">=0.19", category=None,
               logger="megatron.core.models.gpt.gpt_model"),
    KnownNoise(r"fused_indices_to_multihot has reached end of life", "an experimental MoE helper's notice at "
               "import; the project never calls it", releases="<0.16", category=None, logger="megatron.core.utils"),
    KnownNoise(r"No CUDA runtime is found, using CUDA_HOME", "a CUDA build of torch on a CPU machine (the "
               "Python 3.12 route) when megatron-core imports torch's extension loader", category=None,
               logger="torch.utils.cpp_extension", cpu_fallback=True),
    KnownNoise(r"When using (sequence parallelism|async grad allreduce) it is recommended to set the environment "
               r"variable CUDA_DEVICE_MAX_CONNECTIONS", "a CUDA scheduling hint from the tensor-parallel layers "
               "(TP > 1); nothing to schedule on CPU", cpu_fallback=True),
    # Megatron-Bridge and transformers, on the --hf-model path (Python 3.12)
    KnownNoise(r"gradient_accumulation_fusion requires either TransformerEngine or the fused_weight_gradient_mlp_cuda",
               "Megatron-Bridge's provider turns the fusion off without TE/apex (a GPU kernel)", category=None,
               logger="megatron.bridge.utils.fusions", cpu_fallback=True),
    KnownNoise(r"`torch_dtype` is deprecated! Use `dtype` instead!", "Megatron-Bridge 0.6 loads the HF config with "
               "transformers' old argument name; the dtype is the same", category=None,
               logger="transformers.configuration_utils"),
    KnownNoise(r"`torch\.jit\.script` is deprecated", "torch 2.14 on megatron-core's (and Bridge's) import-time "
               "jit decorators; they still compile", category=FutureWarning),
    KnownNoise(r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
               "torch 2.13 and 2.14 on the names megatron-core's distributed optimizer reduce-scatters its gradients "
               "and gathers its parameters with (once per process, at the first step); they run unchanged",
               category=FutureWarning),
)
"""Every start-up message the entry points silence (per release, by message; nothing else)."""


class _DropMessages(logging.Filter):
    def __init__(self, patterns: list) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def active_noise(installed: Optional[str], te: bool) -> list:
    """The entries of :data:`KNOWN_NOISE` for megatron-core ``installed`` (None: unknown, only
    the release-independent ones) with or without Transformer Engine."""
    return [n for n in KNOWN_NOISE if (not n.cpu_fallback or not te)
            and (n.releases is None or (installed is not None and in_range(installed, n.releases)))]


OUTSIDE_LINES: tuple[tuple[str, str], ...] = (
    (r"W\d{4} [\d:.]+ +\d+ torch/distributed/run\.py:\d+\] ",
     "torchrun's notice that it sets OMP_NUM_THREADS=1 for each worker (5 lines, printed by torchrun itself "
     "before any worker starts; `OMP_NUM_THREADS=1 torchrun ...` does the same without the notice)"),
    (r"Loading from \S+ .*(\(\d+/\d+\) \w+Bridge|\u2026)$",
     "Megatron-Bridge's progress line while it loads the HF weights (rank 0, an --hf-model run; rich cuts "
     "its fields with '\u2026' to fit 80 columns where the line is longer, as with a long model path)"),
)
"""The lines from outside the project a successful trainer run still prints (regex matched at
the start of a line, and why it stays); every other line starts with the entry's prefix."""
VERBOSE_ENV = "MEGATRON_PG_AGG_VERBOSE"
"""Set to 1 (or pass ``--verbose``) to see every outside line: nothing is silenced."""
QUIET_LOGGERS = ("megatron.bridge.utils.import_utils",)
"""Loggers that set themselves to INFO with a handler of their own at import (Megatron-Bridge's
optional-import probe logs a traceback for each symbol TE lacks): their records below WARNING are
dropped."""


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def quiet_outside_logging() -> None:
    """Keep other libraries' INFO records (config dumps, bucket lists, import probes) off the
    console, and their warnings on it. A library that calls ``logging.basicConfig(level=INFO)`` at
    import (NVIDIA modelopt, which Megatron-Bridge imports) would turn the root logger to INFO for
    everyone: a root handler at WARNING, installed first, makes that call a no-op and shows what
    Python's last-resort handler would have shown."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
        root.addHandler(handler)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).addFilter(_BelowWarning())


def verbose_requested(argv=None) -> bool:
    """``--verbose`` on the command line or ``MEGATRON_PG_AGG_VERBOSE=1``."""
    return os.environ.get(VERBOSE_ENV) == "1" or "--verbose" in (sys.argv[1:] if argv is None else argv)


def quiet_startup_noise(verbose: bool = False, *, outside_info: bool = False) -> None:
    """Silence exactly :data:`KNOWN_NOISE` for the installed release (warnings by message and
    category, log records by logger and message; every other message still shows) and say in one
    line, on rank 0, which fallbacks are in use. ``outside_info``: also keep other libraries' INFO
    records off the console (:func:`quiet_outside_logging`; the project's own entries, not
    Megatron-LM's, which configures logging itself). ``verbose``: change nothing. Call before
    importing megatron.core."""
    if verbose:
        return
    if outside_info:
        quiet_outside_logging()
    te = importlib.util.find_spec("transformer_engine") is not None
    installed = distribution_version()  # importing megatron.core would emit the warnings now
    by_logger: dict = {}
    for noise in active_noise(installed, te):
        if noise.category is not None:
            warnings.filterwarnings("ignore", message=noise.message, category=noise.category)
        else:
            by_logger.setdefault(noise.logger, []).append(noise.message)
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_DropMessages(patterns))
    if not te:
        logger.info("no Transformer Engine or apex: megatron-core falls back to torch norms, torch "
                    "optimizers and local multi-tensor kernels (its warnings about them are silenced)")
