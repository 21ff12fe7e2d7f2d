"""What one attention call asks for, described for the backends: the registry asks each backend's capabilities
whether it serves it, and the cost model estimates it (both read this one description)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multihead.backends.policy import DeviceKind
from multihead.masks import BoundMask

__all__ = ["AttentionCall"]


@dataclass(frozen=True)
class AttentionCall:
    """What one call asks for: enough for a backend to say whether it can serve it."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    qk_dim: int
    v_dim: int
    dtype: torch.dtype
    device: torch.device
    mask: BoundMask
    dropout: float  # probability applied; 0.0 outside training
    weights: str  # "none", "all" or "subset"
    need_lse: bool
    requires_grad: bool
    # k and v are page pools read through a block table (k_len: the most keys a sequence holds)
    paged: bool = False
    # learned sink logits (backends.sinks): folded into the output from the LSE the backend returns, or served by a
    # backend that takes them (Capabilities.takes_sinks); ``sinks_need_grad``: the logits require a gradient
    sinks: bool = False
    sinks_need_grad: bool = False
    # the kind of device auto plans the call for; None: the current policy's kind of ``device`` (set it to ask what
    # auto would pick on another kind, e.g. a CUDA call described on a CPU-only machine)
    kind: DeviceKind | None = None
