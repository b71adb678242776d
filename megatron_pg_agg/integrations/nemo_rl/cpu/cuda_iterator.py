"""NeMo-RL's processed micro-batch iterator on CPU: its ``data_dict.to("cuda")`` keeps the tensors on the CPU.

WHY
    ``make_processed_microbatch_iterator`` (``nemo_rl/models/megatron/data.py:94-155``, the move at
    ``:127``) starts every micro-batch with ``data_dict = data_dict.to("cuda")``: a literal device, not
    the model's. Every Megatron training path of NeMo-RL goes through it (``get_microbatch_iterator``,
    ``data.py:158-244``, which the worker's ``train`` and ``train_microbatch`` call), so on a CPU
    machine the first micro-batch fails (``Torch not compiled with CUDA enabled`` /
    ``no CUDA GPUs are available``). ``process_microbatch`` (``:259``), the per-micro-batch work under
    it, builds everything on its input's device and needs nothing.

WHAT
    The same iterator, with each of its steps (the ``.to("cuda")`` and ``process_microbatch``) run in a
    torch-function mode in which ``Tensor.to(<a CUDA device>, ...)`` and ``Tensor.cuda()`` leave the
    tensor on the CPU (dtype and other arguments of ``to`` are kept). Nothing else changes: the
    micro-batches, their order, ``ProcessedMicrobatch`` and the ``BatchedDataDict`` the loss receives
    are NeMo-RL's own.

HOW (a wrapper, never a copy)
    ``make_processed_microbatch_iterator`` is replaced by a generator that creates the original
    generator and advances it (``next``) inside the mode, yielding outside it, so the mode covers the
    original's frame only while it runs (the model forward and the loss, which run between two
    ``next`` calls in megatron-core's schedule, are outside it). ``get_microbatch_iterator`` looks the
    name up in its module globals, so every caller gets the wrapper.

    The smaller alternative, ``BatchedDataDict.to`` mapping a CUDA device to the CPU, was not taken:
    it changes every ``.to`` of every ``BatchedDataDict`` in NeMo-RL, not this one spot.

    CPU-only: refuses to apply when ``torch.cuda.is_available()``.

TARGETS (NeMo-RL 0.6.0 @ 7ea279a; megatron-core 0.19)
    ``nemo_rl.models.megatron.data.make_processed_microbatch_iterator``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_pg_agg.integrations.nemo_rl.cpu._common import Target, cpu_torch, stand_in

NAME = "nemo_rl_cuda_iterator"
DATA = "nemo_rl.models.megatron.data"


def _cpu_if_cuda(device: Any) -> Any:
    return torch.device("cpu") if cpu_torch._is_cuda_device(device) else device


class CudaMovesStayOnCpu(TorchFunctionMode):
    """Inside this mode ``Tensor.to(<CUDA device>, ...)`` targets the CPU and ``Tensor.cuda()`` is identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            if "device" in kwargs:
                kwargs["device"] = _cpu_if_cuda(kwargs["device"])
            if len(args) > 1 and (isinstance(args[1], (str, torch.device, int)) and not isinstance(args[1], bool)):
                args = (args[0], _cpu_if_cuda(args[1]), *args[2:])
        return func(*args, **kwargs)


def _make_iterator(original):
    def make_processed_microbatch_iterator(*args, **kwargs):
        steps = original(*args, **kwargs)
        while True:
            with CudaMovesStayOnCpu():
                try:
                    item = next(steps)
                except StopIteration:
                    return
            yield item

    return make_processed_microbatch_iterator


PATCH = stand_in(NAME, __doc__, Target(DATA, "make_processed_microbatch_iterator", _make_iterator))
