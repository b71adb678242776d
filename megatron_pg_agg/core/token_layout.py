"""Input checks and layout for the aggregation API.

Two kinds of check, kept apart on purpose:
- shape, rank and dtype checks read metadata only; they always run and cost nothing;
- value checks (cu_seqlens monotone, mask values, numerator inside denominator, group sizes)
  read tensor data. They run on host (CPU) tensors, where the step planner builds the data and
  reading it is free. On an accelerator they would force a device->host sync per call, so there
  the per-microbatch path trusts the planner (``validate=None`` means "validate on CPU only").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .modes import PROMPT_MEAN, TOKEN_MEAN

GroupSizes = Union[Sequence[int], torch.Tensor, None]


@dataclass
class TokenLayout:
    """The token layout of one call, flattened to packed form.

    A padded ``[B, S]`` input is treated as B packed sequences of length S each.
    """

    shape: torch.Size
    """The shape of the caller's token tensors; outputs are reshaped back to it."""
    numerator: torch.Tensor
    """bool ``[T]``: the loss mask after filtering (n_t)."""
    denominator: torch.Tensor
    """bool ``[T]``: the original loss mask (d_t)."""
    cu_seqlens: Optional[torch.Tensor]
    """int64 ``[S+1]`` sequence boundaries in token positions; None only for token_mean."""
    group_sizes: Optional[torch.Tensor]
    """int64 ``[G]`` consecutive sequences per prompt group, on the mask's device; or None."""


def should_validate(validate: Optional[bool], *tensors: Optional[torch.Tensor]) -> bool:
    """Value checks run when asked, or by default when every tensor lives on the host."""
    if validate is not None:
        return validate
    return all(t.device.type == "cpu" for t in tensors if isinstance(t, torch.Tensor))


def check_loss(loss: torch.Tensor, arg: str = "loss") -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor; got {type(loss).__name__}")
    if not loss.is_floating_point():
        raise TypeError(
            f"{arg} must be a floating tensor (float32, bfloat16, float16, ...); got {loss.dtype}. "
            "Cast it with .float() if it holds integer losses."
        )
    if loss.dim() not in (1, 2):
        raise ValueError(
            f"{arg} must be padded [B, S] or packed [T]; got {loss.dim()} dims {tuple(loss.shape)}. "
            "Flatten extra batch dims, or pack sequences into [T] with cu_seqlens."
        )


def _as_bool_mask(mask, arg: str, validate: bool) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor; got {type(mask).__name__}")
    if mask.dim() not in (1, 2):
        raise ValueError(
            f"{arg} must be padded [B, S] or packed [T]; got {mask.dim()} dims {tuple(mask.shape)}"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise TypeError(f"{arg} must be bool or 0/1 integer/float; got {mask.dtype}")
    if validate and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{arg} must hold only 0 and 1 (or be bool); found other values")
    return mask != 0


def _check_cu_seqlens(cu: torch.Tensor, num_tokens: int, validate: bool) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D int32/int64 tensor; got {type(cu).__name__}")
    if cu.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D [S+1]; got shape {tuple(cu.shape)}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64; got {cu.dtype}")
    if cu.numel() < 1:
        raise ValueError("cu_seqlens must hold at least one boundary ([0] for an empty step)")
    if validate:
        host = cu.tolist()  # host tensor: free; never reached on an accelerator by default
        if host[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0; got cu_seqlens[0]={host[0]}")
        for i in range(1, len(host)):
            if host[i] < host[i - 1]:
                raise ValueError(
                    f"cu_seqlens must be non-decreasing; cu_seqlens[{i}]={host[i]} < "
                    f"cu_seqlens[{i - 1}]={host[i - 1]}"
                )
        if host[-1] != num_tokens:
            raise ValueError(
                f"cu_seqlens must end at the number of packed tokens T={num_tokens}; "
                f"got cu_seqlens[-1]={host[-1]}"
            )
    return cu.long()


def _check_group_sizes(group_sizes, num_seqs: int, device, validate: bool) -> torch.Tensor:
    if isinstance(group_sizes, torch.Tensor):
        if group_sizes.dim() != 1:
            raise ValueError(f"group_sizes must be 1-D; got shape {tuple(group_sizes.shape)}")
        if group_sizes.dtype.is_floating_point or group_sizes.dtype == torch.bool:
            raise TypeError(f"group_sizes must hold integers; got {group_sizes.dtype}")
        sizes = group_sizes
        host = group_sizes.tolist() if validate else None
    elif isinstance(group_sizes, (list, tuple)):
        host = list(group_sizes)
        for i, g in enumerate(host):
            if isinstance(g, bool) or not isinstance(g, int):
                raise TypeError(f"group_sizes[{i}] must be an int; got {type(g).__name__}")
        sizes = torch.tensor(host, dtype=torch.long)
        validate = True  # host values: checking them is free wherever the masks live
    else:
        raise TypeError(
            "group_sizes must be a list/tuple of positive ints or a 1-D integer tensor; "
            f"got {type(group_sizes).__name__}"
        )
    if validate:
        for i, g in enumerate(host):
            if g <= 0:
                raise ValueError(
                    f"group_sizes must be positive (a group holds at least one sequence); "
                    f"group_sizes[{i}]={g}"
                )
        if sum(host) != num_seqs:
            raise ValueError(
                f"group_sizes must sum to the number of sequences ({num_seqs}); "
                f"they sum to {sum(host)}"
            )
    return sizes.to(device=device, dtype=torch.long, non_blocking=True)


def build_layout(
    loss_mask: torch.Tensor,
    *,
    mode: str,
    cu_seqlens: Optional[torch.Tensor],
    group_sizes: GroupSizes,
    denominator_mask: Optional[torch.Tensor],
    validate: Optional[bool],
    loss: Optional[torch.Tensor] = None,
) -> TokenLayout:
    """Check every argument (see the module docstring for which checks run where)."""

    do_values = should_validate(validate, loss_mask, denominator_mask, cu_seqlens, group_sizes)
    n = _as_bool_mask(loss_mask, "loss_mask", do_values)
    d = n if denominator_mask is None else _as_bool_mask(denominator_mask, "denominator_mask", do_values)
    if d.shape != n.shape:
        raise ValueError(
            f"denominator_mask shape {tuple(d.shape)} must equal loss_mask shape {tuple(n.shape)}"
        )
    if loss is not None and loss.shape != n.shape:
        raise ValueError(f"loss shape {tuple(loss.shape)} must equal loss_mask shape {tuple(n.shape)}")
    if d.device != n.device:
        raise ValueError(f"denominator_mask is on {d.device} but loss_mask is on {n.device}")
    if do_values and denominator_mask is not None and bool((n & ~d).any()):
        first = int((n & ~d).flatten().int().argmax())
        raise ValueError(
            "loss_mask (numerator) is true where denominator_mask is false (first at flat "
            f"index {first}): filtered tokens may leave the numerator, never join it"
        )
    shape = n.shape
    if n.numel() >= 2**31:
        raise ValueError(
            f"one call holds {n.numel()} tokens; counts are int32, so split the step into parts "
            "of fewer than 2**31 tokens (the token form combines parts exactly)"
        )
    if n.dim() == 2:
        if cu_seqlens is not None:
            raise ValueError(
                "cu_seqlens is for packed [T] input; with padded [B, S] input each row is a "
                "sequence: drop cu_seqlens or pack the batch"
            )
        rows, width = n.shape
        cu = torch.arange(rows + 1, device=n.device, dtype=torch.long) * width
    elif cu_seqlens is None:
        if mode != TOKEN_MEAN or group_sizes is not None:
            raise ValueError(
                f"packed [T] input with mode={mode!r} needs cu_seqlens [S+1] (int32/int64 "
                "sequence boundaries) so sequences can be told apart"
            )
        cu = None
    else:
        cu = _check_cu_seqlens(cu_seqlens, n.numel(), do_values)
        if cu.device != n.device:
            cu = cu.to(n.device, non_blocking=True)
    groups = None
    if group_sizes is not None:
        groups = _check_group_sizes(group_sizes, cu.numel() - 1, n.device, do_values)
    elif mode == PROMPT_MEAN:
        raise ValueError(
            "mode='prompt_mean' needs group_sizes: the number of consecutive sequences in each "
            "prompt group, e.g. group_sizes=[8, 8, 5]"
        )
    return TokenLayout(shape, n.reshape(-1), d.reshape(-1), cu, groups)
