"""The attention step of a layer as its own module: the seam where inspection and head surgery act.

:class:`Attend` sits between the projections and the concatenation of the heads. It has no parameters;
it holds the step's dropout and backend, and the head surgery of :mod:`multihead.heads` (a gate and an
ablation on the per-head outputs). Forward hooks on it see the per-head tensors, which is how
:func:`multihead.lab.inspect.capture` records a layer without anything threaded through the layer's forward.

An :class:`AttentionSite` names one such step in a model: its :class:`Attend`, its head counts, and
where it sits (the part of the model and the layer index). Our own layers are sites; another
library's modules become sites through a finder an integration registers
(:func:`register_site_finder`), so the readers find every model's attention steps the same way
without importing any integration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import nn

from multihead.backends.paged import PageTable
from multihead.functional import AttentionResult, WeightSelection, attention_result
from multihead.heads import HeadAblation, ablate_outputs, check_gate
from multihead.masks import Mask

# What a step owned by another library may apply to the kernel's result: (result, the weights asked for) -> result
Finish: TypeAlias = Callable[[AttentionResult, bool | WeightSelection], AttentionResult]

# A kernel run in place of multihead.attention_result for a call, with its arguments: the sequence split across ranks
# (multihead.parallel.sequence.SequenceSplit), which refuses those it cannot serve
Kernel: TypeAlias = Callable[..., AttentionResult]


class Attend(nn.Module):
    """``multihead.attention`` over projected heads, then the layer's head gate and ablation, if any.

    Inputs q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) after projection and rotary (in a paged call, k and v
    are the cache's page pools and ``pages`` its table); returns an :class:`AttentionResult` whose output is
    (b, h, i, e), before the heads are concatenated, with the weights and log-sum-exp asked for. The weights are
    the kernel's: a gate or ablation changes outputs, not weights. Every attention a layer runs (no cache, a
    contiguous, window or paged cache; prefill or decode) is a call of this module.
    """

    def __init__(self, dropout: float = 0.0, backend: str = "auto"):
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
        scale: float | None = None,
        dropout: float | None = None,
        training: bool | None = None,
        return_weights: bool | WeightSelection = False,
        return_lse: bool = False,
        pages: PageTable | None = None,
        sinks: torch.Tensor | None = None,
        finish: Finish | None = None,
        kernel: Kernel | None = None,
    ) -> AttentionResult:
        """Attention with this step's dropout (in training mode) and backend, then its head surgery.

        ``scale`` (default 1/sqrt(d)), ``dropout`` and ``training`` (default: this module's) are for a
        step owned by another library's module, which passes its own on every call. ``sinks`` (h,): the layer's
        learned sink logits (:func:`multihead.attention`'s); the weights returned are those applied, over the keys.
        ``finish(result, return_weights)``: applied to the kernel's result before the head surgery, so that the
        gate, the ablation and forward hooks (capture) see what it returns; ``return_weights`` is what this call
        asks for (a pre-hook may have changed it). For a step owned by another library whose attention differs
        from the kernel's on some rows: the transformers integration gives rows with every key masked eager's
        uniform weights there, where the kernel gives 0 (:mod:`multihead.integrations.transformers_rows`).
        ``kernel``: run in place of :func:`multihead.attention_result`, with the same arguments, by this call and by
        the "uniform" ablation's second call: the sequence split across ranks, whose heads are then gated and
        ablated here like any other call's.
        """
        run = attention_result if kernel is None else kernel
        result = run(
            q,
            k,
            v,
            mask=mask,
            causal=causal,
            scale=scale,
            dropout=self.dropout if dropout is None else dropout,
            training=self.training if training is None else training,
            backend=self.backend,
            pages=pages,
            sinks=sinks,
            return_weights=return_weights,
            return_lse=return_lse,
        )
        if finish is not None:
            result = finish(result, return_weights)
        if self.head_gate is None and self.head_ablation is None:
            return result
        out = result.output
        if self.head_ablation is not None:
            ablation = self.head_ablation
            out = ablate_outputs(
                out, ablation, q, k, v, mask=mask, causal=causal, backend=self.backend, pages=pages, kernel=kernel
            )
        gate = check_gate(q.shape[1], self.head_gate)  # checked again here: the tensor may have been resized
        if gate is not None:
            out = out * gate.to(out.dtype)[None, :, None, None]
        return result._replace(output=out)


@dataclass(frozen=True)
class AttentionSite:
    """One attention step of a model: where :func:`multihead.lab.inspect.capture` and head surgery act.

    ``attend``: the step; ``num_heads`` h and ``num_kv_heads`` g (h % g == 0) of its calls;
    ``part``: "self" for the self-attention of a one-stack model, "encoder", "decoder" and "cross"
    (decoder-to-encoder attention) for an encoder-decoder; ``index``: the layer number within the
    part (the model's own numbering where it has one); ``name``: the module's path in the model.
    """

    attend: Attend
    num_heads: int
    num_kv_heads: int
    part: str
    index: int
    name: str


# A finder returns a model's sites, or None when the model is not of its kind.
SiteFinder = Callable[[nn.Module], "list[AttentionSite] | None"]
_FINDERS: list[SiteFinder] = []


def register_site_finder(finder: SiteFinder) -> None:
    """Let :func:`find_sites` ask ``finder`` (an integration calls this when imported; idempotent)."""
    if finder not in _FINDERS:
        _FINDERS.append(finder)


def find_sites(model: nn.Module) -> list[AttentionSite] | None:
    """The sites a registered finder knows in ``model`` (the first that answers), or None."""
    for finder in _FINDERS:
        sites = finder(model)
        if sites is not None:
            return sites
    return None
