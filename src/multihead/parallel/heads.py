"""Heads across ranks: a :class:`multihead.MultiHeadAttention` split head-wise over a torch.distributed group.

Megatron-style tensor parallelism (Shoeybi et al., 2019) applied to one attention layer, P ranks::

    x (b, n, embed_dim), the same on every rank
      -> copy_to_heads: identity forward, ALL-REDUCE of the input gradient in backward
      -> W^Q, W^K, W^V column-parallel: rank r holds the rows of its h/P query heads and g/P key/value heads
      -> attention over the rank's own heads (any backend, local tensors)        (b, h/P, n, e)
      -> W^O row-parallel: the rank's h/P * e input columns, partial sums         (b, n, out_dim)
      -> reduce_from_heads: ALL-REDUCE forward, identity backward; then the W^O bias, once
    out (b, n, out_dim), the same on every rank

Rank r holds query heads ``r*h/P .. (r+1)*h/P - 1`` and key/value heads ``r*g/P .. (r+1)*g/P - 1``: with
grouped-query attention, query head m reads key/value head m // (h/g), so each rank's query heads read exactly its
own key/value heads and no rank needs another's keys. The rows are picked from W^Q, W^K and W^V separately (the
layer keeps them as three matrices and stacks them per call for its fused self-attention matmul), so the sharded
layer's fused stack is each rank's own [Q rows; K rows; V rows] - never a contiguous slice of the full stack,
which would hand rank 0 all the queries.

One forward is one all-reduce of (b, n, out_dim); its backward one all-reduce per input tensor that needs a
gradient (one for self-attention). Weight gradients need no communication: each rank's rows and columns get the
single-process layer's gradient for them, and the W^O bias (replicated) gets the full gradient on every rank.

Why not PyTorch's tensor-parallel API (DeviceMesh, DTensor, ``parallelize_module``)? It would shard the four
``nn.Linear`` as ColwiseParallel/RowwiseParallel, but (1) the fused Q/K/V matmul of self-attention stacks the
three weights per call, outside any module it could shard, so the stack of DTensor shards would need its own
layout rules; (2) our attention kernels (SDPA on CPU, the tiled and reference backends) take plain tensors,
not DTensors, so the layer would convert to local tensors around the kernel anyway; and (3) the head count, KV
cache, rotary and capture all read ``num_heads``/``num_kv_heads`` of the module, which ``parallelize_module`` does
not rewrite. A sharded layer that is an ordinary layer with h/P heads plus two small autograd functions keeps
every one of those working unchanged, on local tensors.

The collectives are ``torch.distributed._functional_collectives.all_reduce`` (traced by ``CommDebugMode`` and
``torch.compile``) inside our own autograd functions. ``torch.distributed.nn.functional.all_reduce`` is not used:
its backward all-reduces the gradient again, which multiplies a replicated output's gradient by P.

Key/value heads are not replicated: P must divide both h and g (multi-query attention, g = 1, therefore cannot be
sharded over P > 1 ranks; :func:`check_head_split` names the valid P). Replicating key/value heads across ranks is
future work.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from multihead._errors import bad_argument, describe
from multihead.cache import KVCache
from multihead.layer import MultiHeadAttention
from multihead.masks import Mask, as_mask
from multihead.paged import PagedBatch
from multihead.parallel._group import resolve_group
from multihead.parallel.split import check_head_split  # shared with `multihead cost --tp`

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["HeadParallelAttention", "check_head_split", "gather_head_weights", "shard_heads"]


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group`` (a new tensor; the functional collective, waited on)."""
    world = group if group is not None else dist.group.WORLD
    assert world is not None  # the default group exists: shard_heads checked dist.is_initialized()
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", world))


class _CopyToHeads(torch.autograd.Function):
    """Identity forward; the input gradient summed over the ranks in backward (each rank's heads add theirs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromHeads(torch.autograd.Function):
    """Sum over the ranks forward; identity backward (the summed output, hence its gradient, is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _RowParallelLinear(nn.Linear):
    """W^O of one rank: its (out_dim, h/P * e) input columns, the partial products summed over the group, then the
    full bias (replicated, added once after the sum)."""

    def __init__(self, linear: nn.Linear, columns: slice, group: dist.ProcessGroup | None):
        weight = linear.weight
        super().__init__(
            columns.stop - columns.start,
            linear.out_features,
            bias=linear.bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        self.group = group
        with torch.no_grad():
            self.weight.copy_(weight[:, columns])
            if linear.bias is not None:
                self.bias.copy_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, i, h/P * e) -> (b, i, out_dim)
        out = _ReduceFromHeads.apply(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class HeadParallelAttention(MultiHeadAttention):
    """One rank's part of a head-parallel :class:`multihead.MultiHeadAttention` (build it with :func:`shard_heads`).

    It is a layer with h/P query heads and g/P key/value heads (``num_heads``, ``num_kv_heads`` are the local
    counts; ``global_num_heads``, ``global_num_kv_heads`` the layer's), whose W^O is row-parallel and whose inputs
    all-reduce their gradient. ``forward`` is the layer's: query (b, i, embed_dim), key (b, j, kdim), value
    (b, j, vdim), the same on every rank; it returns the full output (b, i, out_dim) on every rank. What is
    per-head is rank-local:

    - ``need_weights=True`` returns this rank's heads, (b, h/P, i, j) (gather them with
      :func:`gather_head_weights`); with ``average_weights=True`` the average over all h heads, (b, i, j), at the
      cost of one more all-reduce.
    - ``new_cache`` gives a :class:`KVCache` of this rank's g/P key/value heads, (b, g/P, max_len, d).
    - :func:`multihead.lab.inspect.capture` on this layer records its local heads, numbered 0 .. h/P - 1; local head
      m is global head ``head_offset + m``.
    - ``mask`` is given for the layer's h heads, the same on every rank, and each rank applies its own heads' part
      of it (:meth:`multihead.masks.Mask.for_heads`): ALiBi slopes (h,) or (b, h), a tensor's head axis of size
      h ((b or 1, h, i, j), in ``bias``/``allowed`` or plain), ``selected``'s indexer heads; a ``custom``
      function gets global head indices. A head axis of size h/P (a mask built for the local heads) is a
      ValueError, never applied to the wrong heads; one of size 1 is shared by every head.
    """

    global_num_heads: int
    global_num_kv_heads: int
    head_offset: int
    kv_head_offset: int
    group: dist.ProcessGroup | None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: Mask | torch.Tensor | None = None,
        causal: bool = False,
        need_weights: bool = False,
        average_weights: bool = False,
        cache: KVCache | PagedBatch | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`MultiHeadAttention.forward` over this rank's heads: (b, i, out_dim) summed over the group."""
        if mask is not None:  # the whole layer's mask: this rank's heads' part of it, renumbered from 0
            mask = as_mask(mask).for_heads(self.head_offset, self.num_heads, self.global_num_heads)
        # each input's gradient is summed over the ranks in backward (non-tensors go on to the layer's checks)
        if isinstance(query, torch.Tensor):
            query = _CopyToHeads.apply(query, self.group)
        if isinstance(key, torch.Tensor):
            key = _CopyToHeads.apply(key, self.group)
        if isinstance(value, torch.Tensor):
            value = _CopyToHeads.apply(value, self.group)
        out, weights = super().forward(
            query,
            key,
            value,
            mask=mask,
            causal=causal,
            need_weights=need_weights,
            average_weights=False,
            cache=cache,
            positions=positions,
        )
        if weights is not None and average_weights:  # (b, h/P, i, j) -> (b, i, j): the mean over all h heads
            weights = _ReduceFromHeads.apply(weights.sum(dim=1), self.group) / self.global_num_heads
        return out, weights

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, heads {self.head_offset}..{self.head_offset + self.num_heads - 1} "
            f"of {self.global_num_heads}"
        )


def shard_heads(
    layer: MultiHeadAttention, group: dist.ProcessGroup | DeviceMesh | None = None
) -> HeadParallelAttention:
    """This rank's head-parallel part of ``layer``: a new module; ``layer`` itself is never changed.

    Call it on every rank of ``group`` (default: the default group) with the same ``layer`` (same seed or the same
    state dict). Rank r of P keeps query heads r*h/P .. (r+1)*h/P - 1 (with their output-gate rows and sink
    logits), the key/value heads they read, the matching W^O columns, the whole W^O bias and the q/k norms' weights
    (one per layer). No communication happens here.

    Args:
        layer: a :class:`multihead.MultiHeadAttention` (not already sharded; no head gate or ablation: restore
            them, or prune heads, first).
        group: the ranks sharing the heads: a process group, a one-dimensional ``DeviceMesh`` (e.g. ``mesh["tp"]``
            of a 2-D mesh) or None for the default group; P = its size must divide h and g (see
            :func:`check_head_split`).

    Returns:
        :class:`HeadParallelAttention`; ``sharded(x)`` takes (b, n, embed_dim) and returns (b, n, out_dim) on every
        rank, equal to ``layer(x)``.

    Example (on each rank, after ``torch.distributed.init_process_group``)::

        torch.manual_seed(0)
        layer = multihead.MultiHeadAttention(64, 8, num_kv_heads=4)
        sharded = shard_heads(layer)                   # 8/P query heads, 4/P kv heads here
        out, _ = sharded(x, causal=True)               # (b, n, 64), the same on every rank
    """
    if not isinstance(layer, MultiHeadAttention):
        raise bad_argument(
            "layer",
            "a multihead.MultiHeadAttention",
            describe(layer),
            "pass the layer to shard",
            kind=TypeError,
        )
    if isinstance(layer, HeadParallelAttention):
        raise bad_argument(
            "layer",
            "a whole layer",
            "a HeadParallelAttention (already sharded)",
            "shard the original layer",
        )
    if layer.head_gate is not None or layer.head_ablation is not None:
        raise bad_argument(
            "layer",
            "a layer without head gate or ablation",
            "a layer with head surgery applied",
            "call layer.restore_heads() first, or prune_heads to remove heads for good",
        )
    group = resolve_group(group, "shard_heads")
    world_size, rank = _group_size(group), dist.get_rank(group)
    h, g, d, e = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.value_head_dim
    check_head_split(h, g, world_size)

    hp, gp = h // world_size, g // world_size
    config = layer.config()
    # the rotary embedding is copied below (rotary_dim with it: the layer's own property reads it from there)
    config.update(num_heads=hp, num_kv_heads=gp, head_dim=d, value_head_dim=e, rotary=False, rotary_dim=None)
    weight = layer.out_proj.weight
    sharded = HeadParallelAttention(**config, device=weight.device, dtype=weight.dtype)
    sharded.train(layer.training)
    if layer.rotary is not None:  # the same base and tables (its buffers are not parameters: shared is fine)
        sharded.rotary = copy.deepcopy(layer.rotary)
    per_head = layer.q_proj.out_features // h  # d query rows, and its output gate's rows where it has one
    q_rows = slice(rank * hp * per_head, (rank + 1) * hp * per_head)
    k_rows = slice(rank * gp * d, (rank + 1) * gp * d)
    v_rows = slice(rank * gp * e, (rank + 1) * gp * e)
    with torch.no_grad():
        for target, source, rows in (
            (sharded.q_proj, layer.q_proj, q_rows),
            (sharded.k_proj, layer.k_proj, k_rows),
            (sharded.v_proj, layer.v_proj, v_rows),
        ):
            target.weight.copy_(source.weight[rows])  # (heads on this rank * size, in_features)
            if source.bias is not None:
                target.bias.copy_(source.bias[rows])
        for norm, whole in ((sharded.q_norm, layer.q_norm), (sharded.k_norm, layer.k_norm)):
            if norm is not None and whole is not None:
                norm.weight.copy_(whole.weight)  # (d,): one norm for every head
        if sharded.sinks is not None and layer.sinks is not None:
            sharded.sinks.copy_(layer.sinks[rank * hp : (rank + 1) * hp])  # this rank's heads' sink logits
    sharded.out_proj = _RowParallelLinear(layer.out_proj, slice(rank * hp * e, (rank + 1) * hp * e), group)
    sharded.global_num_heads, sharded.global_num_kv_heads = h, g
    sharded.head_offset, sharded.kv_head_offset = rank * hp, rank * gp
    sharded.group = group
    return sharded


def gather_head_weights(
    weights: torch.Tensor, group: dist.ProcessGroup | DeviceMesh | None = None, *, dim: int = 1
) -> torch.Tensor:
    """Every rank's heads of a per-head tensor, in global head order, on every rank (one all-gather).

    ``weights``: this rank's heads along ``dim``, e.g. the (b, h/P, i, j) weights of
    ``sharded(x, need_weights=True)``, or a stack of :func:`multihead.lab.inspect.capture`'s per-head
    ``rec.weights(0, m)`` for m in 0 .. h/P - 1 (``torch.stack(..., dim=1)``). Returns (b, h, i, j): the
    same tensor a single-process layer gives. The same size on every rank; not differentiable (for inspection).
    """
    if not isinstance(weights, torch.Tensor):
        raise bad_argument("weights", "a tensor (b, h/P, i, j)", describe(weights), "pass a tensor", kind=TypeError)
    if not -weights.ndim <= dim < weights.ndim:
        raise bad_argument(
            "dim",
            f"a head axis of the {weights.ndim}-dim weights",
            dim,
            "pass dim=1 for (b, h/P, i, j) weights",
        )
    resolved = resolve_group(group, "gather_head_weights")
    parts = [torch.empty_like(weights) for _ in range(_group_size(resolved))]
    dist.all_gather(parts, weights.detach().contiguous(), group=resolved)
    return torch.cat(parts, dim=dim)
