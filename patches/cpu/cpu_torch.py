"""The CPU stand-ins that the CPU patches put in place of ``torch`` in a module's namespace.

A module of megatron-core or Megatron-LM that assumes CUDA looks ``torch`` up in its own globals;
the patches replace that one name by :class:`_TorchOnCpu`, a thin proxy that delegates every
attribute to the real ``torch`` except the few CUDA calls listed on :class:`_CudaOnCpu`. No
attribute of the real ``torch`` is ever changed, so code outside the patched modules sees the
real ``torch``. The two torch-function modes below scope ``Tensor`` method overrides to one call.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    # torch reads a bare int device as a CUDA ordinal
    return isinstance(device, int) and not isinstance(device, bool)


def _device_to_cpu(fn):
    """Wrap a torch factory so that a CUDA ``device`` keyword lands on the CPU."""

    def factory(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        return fn(*args, **kwargs)

    factory.__name__ = getattr(fn, "__name__", "factory")
    factory.__wrapped__ = fn
    return factory


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


class _Proxy:
    """Delegates every attribute it does not define to the real object it stands in front of."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name == "_real":  # not constructed yet (copy/pickle): never recurse
            raise AttributeError(name)
        return getattr(self._real, name)

    def __repr__(self) -> str:
        return f"<cpu_gloo proxy of {self._real!r}>"


class _RandomOnCpu(_Proxy):
    """``torch.cuda.random`` as seen by the RNG module: its state is the CPU generator's."""

    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return torch.get_rng_state()



_NO_GPU_PROPERTIES = type("CpuDeviceProperties", (), dict(
    name="cpu", major=0, minor=0, total_memory=0, multi_processor_count=0))()
"""What ``get_device_properties`` reports for the CPU: compute capability 0.0, no device memory."""


class _NoStream:
    """A CUDA stream stand-in: CPU work is already ordered, so waiting and switching are no-ops."""

    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None


class _CudaOnCpu(_Proxy):
    """``torch.cuda`` as seen by one megatron module: the current device is the CPU.

    ``rng``: the CUDA RNG calls map onto the CPU generator (on CPU it *is* the device generator).
    ``training``: the calls Megatron-LM's training side makes around its loop become CPU
    equivalents: ``set_device``/``empty_cache`` and streams are no-ops, memory statistics are
    zero, the compute capability is 0.0, and ``device_count()`` is 1 (Megatron-LM initialises
    model parallelism and seeds the RNG tracker only when it sees a device; the CPU is that
    device here).
    """

    def __init__(self, real: Any, rng: bool, training: bool = False) -> None:
        super().__init__(real)
        # megatron-core 0.19's DDP start_grad_sync always reads the current stream and waits on
        # any CUDA-graph event a parameter carries (none on CPU): a no-op stream here
        self.current_stream = lambda *a, **k: _NoStream()
        if rng or training:
            self.get_rng_state = _RandomOnCpu.get_rng_state
            self.set_rng_state = _set_cpu_rng_state
            self.manual_seed = torch.manual_seed
            self.random = _RandomOnCpu(real.random)
        if training:
            self.device_count = lambda: 1
            self.set_device = lambda device: None
            self.empty_cache = lambda: None
            self.Stream = lambda *a, **k: _NoStream()
            self.stream = lambda s: contextlib.nullcontext()
            self.memory_stats = lambda *a, **k: {}
            self.get_device_properties = lambda *a, **k: _NO_GPU_PROPERTIES
            self.get_device_capability = lambda *a, **k: (0, 0)
            for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                         "max_memory_reserved", "device_memory_used"):
                setattr(self, name, lambda *a, **k: 0)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None




class _TorchOnCpu(_Proxy):
    """``torch`` as seen by one megatron module; everything else delegates to the real torch."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "empty_like")

    def __init__(self, real: Any, rng: bool = False, training: bool = False) -> None:
        super().__init__(real)
        self.cuda = _CudaOnCpu(real.cuda, rng, training)
        for name in self._FACTORIES:
            setattr(self, name, _device_to_cpu(getattr(real, name)))




def make_torch_proxy(*, rng: bool = False, training: bool = False):
    """A ``Target.make`` that replaces a module's ``torch`` by a :class:`_TorchOnCpu` proxy."""

    def make(original: Any) -> _TorchOnCpu:
        return _TorchOnCpu(original, rng=rng, training=training)

    return make


class _TensorCudaIsIdentity(TorchFunctionMode):
    """Inside this mode ``Tensor.cuda()`` returns the tensor itself (it stays on the CPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **(kwargs or {}))


def under_mode(mode: type):
    """A ``Target.make`` whose replacement runs the original inside ``mode()`` (a torch-function
    mode), for the duration of that call only."""

    def make(original):
        def wrapper(*args, **kwargs):
            with mode():
                return original(*args, **kwargs)

        return wrapper

    return make
