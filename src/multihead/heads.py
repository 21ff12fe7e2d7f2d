"""Head surgery on a :class:`multihead.MultiHeadAttention`: gates, ablations and pruning.

    layer.ablate_heads([3, 7], how="zero")      # head 3 and 7 outputs -> 0
    layer.ablate_heads([2], how="uniform")      # head 2 attends uniformly over the keys it may see
    layer.ablate_heads([5], how="mean", mean_outputs=m)   # head 5 outputs its corpus mean m (1, e)
    layer.head_gate = torch.ones(h, requires_grad=True)   # differentiable gate on every head's output
    kept = layer.prune_heads([3, 7])            # remove them: W^Q rows, W^K/W^V rows, W^O columns, sinks

Gates and ablations act on the per-head outputs (b, h, i, e) before they are concatenated and projected
by W^O: they live on the layer's attention step (:class:`multihead.attend.Attend`), so the layer's forward
knows nothing of them. A layer with no gate and no ablation runs exactly its ungated code.
Zero-ablating heads and pruning them give the same outputs (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from multihead._errors import bad_argument, describe
from multihead._indices import checked_indices
from multihead.backends.paged import PageTable
from multihead.functional import AttentionResult, attention_result
from multihead.masks import Mask, to_device


class PrunableLayer(Protocol):
    """What pruning reads and rewrites of a layer (a :class:`multihead.MultiHeadAttention`): its projections, its
    per-head sink logits (or None), its head counts and sizes, and how it drops its head surgery. Named here, so
    this module needs no layer. W^Q's rows come in one block per query head (an output gate's rows inside it)."""

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    out_proj: nn.Linear
    sinks: nn.Parameter | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int

    def restore_heads(self) -> None: ...


__all__ = [
    "ABLATIONS",
    "HeadAblation",
    "HeadSurgery",
    "ablate_outputs",
    "check_gate",
    "check_heads",
    "make_ablation",
    "prune_layer",
]

ABLATIONS = ("zero", "uniform", "mean")


@dataclass(frozen=True)
class HeadAblation:
    """Which heads are ablated and how; ``mean_outputs`` (len(heads), e) for how="mean"."""

    heads: tuple[int, ...]
    how: str
    mean_outputs: torch.Tensor | None = None


def check_heads(num_heads: int, heads: Sequence[int] | int, name: str = "heads") -> list[int]:
    """Distinct valid head indices (sorted) of a layer with ``num_heads`` heads (a negative one counts from the
    end: :func:`multihead._indices.checked_indices`)."""
    if heads is None:  # None means every head elsewhere; here, a head must be named
        raise bad_argument(name, "a list of head indices", "None", f"pass e.g. {name}=[0, 3]", kind=TypeError)
    return sorted(checked_indices(name, heads, num_heads, "head", distinct=True, ordered=False))


def make_ablation(
    num_heads: int, value_head_dim: int, heads: Sequence[int] | int, how: str, mean_outputs: torch.Tensor | None
) -> HeadAblation:
    """A checked :class:`HeadAblation` for a layer of ``num_heads`` heads with outputs of size ``value_head_dim``."""
    chosen = check_heads(num_heads, heads)
    if how not in ABLATIONS:
        raise bad_argument("how", f"one of {', '.join(ABLATIONS)}", repr(how), 'pass how="zero"')
    if how == "mean":
        expected = (len(chosen), value_head_dim)
        if not isinstance(mean_outputs, torch.Tensor) or tuple(mean_outputs.shape) != expected:
            raise bad_argument(
                "mean_outputs",
                f"a tensor of shape (len(heads), e) = {expected}",
                describe(mean_outputs),
                "average each head's outputs over a corpus (multihead.lab.inspect.importance.mean_head_outputs)",
            )
    elif mean_outputs is not None:
        raise bad_argument("mean_outputs", 'None unless how="mean"', describe(mean_outputs), "drop mean_outputs")
    return HeadAblation(tuple(chosen), how, None if mean_outputs is None else mean_outputs.detach())


def check_gate(num_heads: int, gate: object) -> torch.Tensor | None:
    """``gate`` if it is None or a (num_heads,) tensor of factors, one per head; else a clear error."""
    if gate is not None and (not isinstance(gate, torch.Tensor) or tuple(gate.shape) != (num_heads,)):
        raise bad_argument(
            "head_gate",
            f"a tensor of shape (h,) = ({num_heads},), one factor per head",
            describe(gate),
            f"set layer.head_gate = torch.ones({num_heads}, requires_grad=True), or None",
        )
    return gate


class GatedStep(Protocol):
    """What head surgery sets on a layer's attention step (a :class:`multihead.attend.Attend`, which imports this
    module): the gate and the ablation it applies to each head's output."""

    head_gate: torch.Tensor | None
    head_ablation: HeadAblation | None


class HeadSurgery:
    """The head gate and ablations of a layer whose ``attend`` (its :class:`multihead.attend.Attend`) applies them to
    each head's output: for :class:`multihead.MultiHeadAttention` and :class:`multihead.LatentAttention`, which
    have ``num_heads`` query heads and ``value_head_dim`` features per head's output."""

    attend: GatedStep
    num_heads: int
    value_head_dim: int

    @property
    def head_gate(self) -> torch.Tensor | None:
        """(h,) factors on each head's output (may need a gradient), or None; see :mod:`multihead.heads`."""
        return self.attend.head_gate

    @head_gate.setter
    def head_gate(self, value: torch.Tensor | None) -> None:
        self.attend.head_gate = check_gate(self.num_heads, value)

    @property
    def head_ablation(self) -> HeadAblation | None:
        """The heads ablated by :meth:`ablate_heads` and how, or None."""
        return self.attend.head_ablation

    def ablate_heads(
        self, heads: Sequence[int] | int, how: str = "zero", mean_outputs: torch.Tensor | None = None
    ) -> None:
        """Ablate ``heads`` until :meth:`restore_heads`: how="zero" zeroes their outputs, "uniform" makes
        them attend uniformly over the keys they may see, "mean" outputs ``mean_outputs`` (len(heads), e)."""
        self.attend.head_ablation = make_ablation(self.num_heads, self.value_head_dim, heads, how, mean_outputs)

    def restore_heads(self) -> None:
        """Undo :meth:`ablate_heads` and remove ``head_gate``."""
        self.attend.head_ablation = None
        self.attend.head_gate = None


def ablate_outputs(
    out: torch.Tensor,
    ablation: HeadAblation,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: Mask | torch.Tensor | None,
    causal: bool,
    backend: str,
    pages: PageTable | None = None,
    kernel: Callable[..., AttentionResult] | None = None,
) -> torch.Tensor:
    """The per-head outputs ``out`` (b, h, i, e) with ``ablation.heads`` replaced as ``ablation.how`` says.

    q (b, h, i, d), k (b, g, j, d), v (b, g, j, e), mask, causal and pages are the attention call's own (in a
    paged call, k and v are page pools): "uniform" attends again from all-zero queries, with the call's own
    ``kernel`` when it has one (the sequence split across ranks: the keys are on every rank).
    """
    num_heads = out.shape[1]
    # the indices go to the device without waiting for it (a Python list as an index is a blocking copy)
    heads = to_device(torch.as_tensor(list(ablation.heads), dtype=torch.long), out.device)
    ablated = torch.zeros(num_heads, dtype=torch.bool, device=out.device)
    ablated[heads] = True
    if ablation.how == "zero":
        replacement = torch.zeros((), dtype=out.dtype, device=out.device)
    elif ablation.how == "uniform":
        # all-zero queries score every allowed key the same: softmax is uniform over the keys the
        # mask allows (an additive bias such as ALiBi still applies)
        run = attention_result if kernel is None else kernel
        replacement = run(torch.zeros_like(q), k, v, mask=mask, causal=causal, backend=backend, pages=pages).output
    else:
        assert ablation.mean_outputs is not None  # make_ablation requires them for how="mean"
        replacement = torch.zeros(num_heads, out.shape[-1], dtype=out.dtype, device=out.device)
        replacement[heads] = ablation.mean_outputs.to(out.dtype)  # (len(heads), e) rows
        replacement = replacement[None, :, None, :]  # (1, h, 1, e)
    return torch.where(ablated[None, :, None, None], replacement, out)


def prune_layer(layer: PrunableLayer, heads: Sequence[int] | int) -> list[int]:
    """Remove ``heads`` from ``layer`` in place; returns the indices (before pruning) of the heads kept.

    Rows of W^Q (and its bias: a head's query rows and its output gate's, one block per head), columns of W^O and
    the head's sink logit go with each head. Under grouped-query attention
    a key/value head goes when all its query heads go; every group kept must keep the same number
    of query heads, so h % g == 0 still holds.
    """
    removed = set(check_heads(layer.num_heads, heads))
    kept = [n for n in range(layer.num_heads) if n not in removed]
    if not kept:
        raise bad_argument(
            "heads",
            f"fewer than all {layer.num_heads} heads of the layer",
            sorted(removed),
            "keep at least one head in every layer (ablate the whole layer's output instead)",
        )
    h, g, d, e = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.value_head_dim
    per_group = h // g
    groups: dict[int, list[int]] = {}
    for n in kept:
        groups.setdefault(n // per_group, []).append(n)
    sizes = {len(members) for members in groups.values()}
    if len(sizes) != 1:
        detail = ", ".join(f"kv head {group}: {len(members)}" for group, members in sorted(groups.items()))
        raise bad_argument(
            "heads",
            f"the same number of query heads removed from every key/value group kept (groups of {per_group})",
            f"query heads left per group {detail}",
            "remove whole groups, or as many heads from each group",
        )
    kept_groups = sorted(groups)

    def rows(linear: nn.Linear, blocks: list[int], size: int) -> None:
        index = torch.cat([torch.arange(b * size, (b + 1) * size) for b in blocks]).to(linear.weight.device)
        linear.weight = nn.Parameter(linear.weight.detach()[index].clone())
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.detach()[index].clone())
        linear.out_features = len(index)

    rows(layer.q_proj, kept, layer.q_proj.out_features // h)  # per head: d query rows (then any gate rows)
    rows(layer.k_proj, kept_groups, d)
    rows(layer.v_proj, kept_groups, e)
    columns = torch.cat([torch.arange(n * e, (n + 1) * e) for n in kept]).to(layer.out_proj.weight.device)
    layer.out_proj.weight = nn.Parameter(layer.out_proj.weight.detach()[:, columns].clone())
    layer.out_proj.in_features = len(columns)
    if layer.sinks is not None:  # (h,) -> (len(kept),)
        index = torch.tensor(kept, device=layer.sinks.device)
        layer.sinks = nn.Parameter(layer.sinks.detach()[index].clone())
    layer.num_heads, layer.num_kv_heads = len(kept), len(kept_groups)
    layer.restore_heads()
    return kept
