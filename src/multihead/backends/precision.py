"""The kernels' precision: the dtype their blocks compute in, and autocast at their door (whether it is on, the
inputs cast as torch's SDPA casts its own, and kernels run with it off: they choose their own block precision)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["compute_dtype", "autocast_device", "autocast_inputs", "autocast_off"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks are computed in float32 for half types (fp32 accumulation, as FlashAttention does)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# torch.autocast's own check, one C call, for the common case of no autocast anywhere (private: may be absent)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_device(device: torch.device) -> str | None:
    """The device's type if torch.autocast is on for it, else None (also for devices without autocast: meta)."""
    if _any_autocast is not None and not _any_autocast():
        return None
    kind = device.type
    return kind if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind) else None


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under ``torch.autocast``, the inputs cast to the autocast dtype, as torch's SDPA casts its own.

    Attention is a matrix-product op, so it runs in the lower precision like SDPA and the reference do
    (every backend then returns one dtype). float64 is left alone, as autocast leaves it. The cast is
    differentiable and happens outside the kernels' autograd Functions, so gradients reach the caller's
    tensors in their own dtype.
    """
    device = autocast_device(tensors[0].device)
    if device is None:
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t if t.dtype in (dtype, torch.float64) else t.to(dtype) for t in tensors)


def autocast_off(method: Callable) -> Callable:
    """Run a kernel with autocast disabled on its tensors' device.

    The kernels choose their own dtypes (float32 blocks for half inputs); an active autocast would
    re-cast their products to half while in-place accumulators stay float32 ("Input dtypes must be the
    same"). Backward needs it too: the engine runs it under whatever autocast the caller has active.
    """

    @functools.wraps(method)
    def run(*args, **kwargs):
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        device = None if tensor is None else autocast_device(tensor.device)
        if device is None:
            return method(*args, **kwargs)
        with torch.autocast(device, enabled=False):
            return method(*args, **kwargs)

    return run
