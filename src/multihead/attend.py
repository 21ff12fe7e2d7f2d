"""The attention step of a layer as its own module: the seam where inspection and head surgery act.

:class:`Attend` sits between the projections and the concatenation of the heads. It has no parameters;
it holds the step's dropout and backend, and the head surgery of :mod:`multihead.heads` (a gate and an
ablation on the per-head outputs). Forward hooks on it see the per-head tensors, which is how
:func:`multihead.inspect.capture` records a layer without anything threaded through the layer's forward.
"""

from __future__ import annotations

import torch
from torch import nn

from multihead.functional import AttentionResult, WeightSelection, attention
from multihead.heads import HeadAblation, ablate_outputs, check_gate
from multihead.masks import Mask


class Attend(nn.Module):
    """``multihead.attention`` over projected heads, then the layer's head gate and ablation, if any.

    Inputs q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) after projection and rotary; output
    (b, h, i, e) before the heads are concatenated (an :class:`AttentionResult` when weights are asked
    for). The weights returned are the kernel's: a gate or ablation changes outputs, not weights.
    """

    def __init__(self, dropout: float, backend: str):
        super().__init__()
        self.dropout, self.backend = dropout, backend
        # Head surgery: None on the plain path, which then runs exactly the ungated code.
        self.head_gate: torch.Tensor | None = None  # (h,) factors on each head's output, may need a gradient
        self.head_ablation: HeadAblation | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Mask | torch.Tensor | None = None,
        causal: bool = False,
        return_weights: bool | WeightSelection = False,
    ) -> torch.Tensor | AttentionResult:
        """Attention with this step's dropout (in training mode) and backend, then its head surgery."""
        result = attention(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            dropout=self.dropout,
            training=self.training,
            backend=self.backend,
            return_weights=return_weights,
        )
        if self.head_gate is None and self.head_ablation is None:
            return result
        out = result.output if isinstance(result, AttentionResult) else result
        if self.head_ablation is not None:
            out = ablate_outputs(out, self.head_ablation, q, k, v, mask=mask, causal=causal, backend=self.backend)
        gate = check_gate(q.shape[1], self.head_gate)  # checked again here: the tensor may have been resized
        if gate is not None:
            out = out * gate.to(out.dtype)[None, :, None, None]
        return result._replace(output=out) if isinstance(result, AttentionResult) else out
