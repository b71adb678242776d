"""NeMo-RL's context-parallel all-gather of log-probs on CPU: ``AllGatherCPTensor.backward``'s pinned CUDA index.

WHY
    With context parallelism every CP rank gathers the whole sequence's log-probs before the loss
    (``allgather_cp_sharded_tensor`` -> ``AllGatherCPTensor``, ``nemo_rl/distributed/model_utils.py:1236-1239``,
    ``:1315-1376``), so each CP rank computes the loss of the whole sequence (``LossPostProcessor``
    then divides by cp, ``train.py:574-582``). The backward all-reduces the gradient over the CP group
    and keeps this rank's two load-balancing chunks, selected with
    ``torch.tensor([cp_rank, 2*cp_size-cp_rank-1], device="cpu", pin_memory=True).cuda(non_blocking=True)``
    (``model_utils.py:1369-1371``). Pinning host memory and ``.cuda()`` both need a CUDA driver, so on a
    CPU machine the first CP backward fails (``RuntimeError: Found no NVIDIA driver on your system``).

WHAT
    The same backward, run in a torch-function mode in which a ``pin_memory=True`` of a tensor factory
    is dropped and ``Tensor.cuda()`` returns the tensor itself, for the duration of the call only. The
    all-reduce and the chunk selection are NeMo-RL's own.

HOW (a wrapper, never a copy)
    ``AllGatherCPTensor.backward`` (a plain function on the class upstream, not a staticmethod) is
    replaced by a plain function that runs it inside the mode; autograd calls it through the class.

    CPU-only: refuses to apply when ``torch.cuda.is_available()``.

TARGETS (NeMo-RL 0.6.0 @ 7ea279a; megatron-core 0.19)
    ``nemo_rl.distributed.model_utils.AllGatherCPTensor.backward``.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from megatron_pg_agg.integrations.nemo_rl.cpu._common import Target, stand_in

NAME = "nemo_rl_cp_allgather_backward"


class PinnedCudaIndexStaysOnCpu(TorchFunctionMode):
    """Inside this mode factories ignore ``pin_memory=True`` and ``Tensor.cuda()`` is identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


def _make_backward(original):
    fn = original.__func__ if isinstance(original, staticmethod) else original

    def backward(ctx, *grads):
        with PinnedCudaIndexStaysOnCpu():
            return fn(ctx, *grads)

    backward.__name__ = backward.__qualname__ = fn.__name__
    return backward


PATCH = stand_in(NAME, __doc__,
                 Target("nemo_rl.distributed.model_utils", "AllGatherCPTensor.backward", _make_backward))
