"""A dispatch-mode trace of every aten op that flags host syncs and data-dependent shapes (the
hot-path rule: no ``.item()``, ``nonzero``, boolean-mask indexing, ``repeat_interleave`` without
``output_size``)."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

FORBIDDEN = {"_local_scalar_dense", "nonzero", "masked_select", "item", "nonzero_static"}


class OpTrace(TorchDispatchMode):
    """Records every aten op; flags syncs and data-dependent shapes."""

    def __init__(self):
        super().__init__()
        self.ops, self.violations = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        self.ops.append(name)
        if name in FORBIDDEN:
            self.violations.append(name)
        if name == "repeat_interleave" and kwargs.get("output_size") is None and (
            len(args) < 3 or args[-1] is None
        ):
            self.violations.append("repeat_interleave without output_size")
        if name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.violations.append(f"{name} with a boolean mask")
        return func(*args, **(kwargs or {}))
