"""``ParallelStyle``s for torch's ``parallelize_module``: our layer's heads over a tensor-parallel mesh dimension
(:class:`HeadParallel`), its sequence over a context-parallel one (:class:`ContextParallel`), alone or together on a
2-D mesh::

    mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("cp", "tp"))
    parallelize_module(model, mesh["tp"], {"blocks.*.attn": HeadParallel()})
    parallelize_module(model, mesh["cp"], {"blocks.*.attn": ContextParallel(method="ring", layout="zigzag")})

torch's plans of a dict apply a style to each module the path names and keep the module there, not what the style
returns, so both styles change the layer in place:

- :class:`HeadParallel` turns it into this rank's :class:`multihead.parallel.HeadParallelAttention` (as
  :func:`multihead.parallel.shard_heads` builds, the same object kept): its parameters become this rank's rows and
  columns, plain tensors, and its forward all-reduces the output over the mesh dimension.
- :class:`ContextParallel` sets ``layer.sequence_split``: every call then takes this rank's shard of the sequence,
  (b, n/P, embed_dim) in the style's layout, and attends over the whole sequence by ring or Ulysses attention, through
  the layer's ``Attend`` (head gates and ablations act on its heads; weights, capture and caches are refused).

Both keep the layer's own forward (``layer(x, mask=..., causal=...)`` -> (out, weights)), so a model's code is
unchanged. Where torch's plans pass DTensors, the styles take them (redistributed to the layout the layer needs, then
its local tensor) and can return them (``use_local_output=False``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from multihead._errors import bad_argument, describe
from multihead.layer import MultiHeadAttention
from multihead.parallel.heads import HeadParallelAttention, shard_heads
from multihead.parallel.sequence import SequenceSplit, check_layout, check_method

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["ContextParallel", "HeadParallel"]

_INPUTS = ("query", "key", "value")  # the layer's tensor inputs, positional or by name


def _checked_layer(module: object, style: str) -> MultiHeadAttention:
    if not isinstance(module, MultiHeadAttention):
        raise bad_argument(
            "module",
            f"a multihead.MultiHeadAttention for {style} (the plan's path must name the attention layer itself)",
            describe(module),
            'point the plan at the layer, e.g. {"blocks.*.attn": ' + style + "()}",
            kind=TypeError,
        )
    return module


def _checked_mesh(mesh: object, style: str) -> DeviceMesh:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        got = f"a mesh of shape {tuple(mesh.shape)}" if isinstance(mesh, DeviceMesh) else describe(mesh)
        raise bad_argument(
            "device_mesh",
            f"a one-dimensional DeviceMesh for {style}",
            got,
            'pass the dimension to split over, e.g. parallelize_module(model, mesh["tp"], plan)',
        )
    return mesh


def _placement(value: object, name: str, allowed: tuple[Placement, ...]) -> Placement:
    if value is None:
        return allowed[0]
    if not any(value == candidate for candidate in allowed):
        raise bad_argument(
            name,
            " or ".join(repr(candidate) for candidate in allowed),
            repr(value),
            f"pass {name}={allowed[0]!r} (the default)",
        )
    return value  # type: ignore[return-value]  # one of the allowed placements


def _broadcast_from(module: nn.Module, mesh: DeviceMesh, source: int | None) -> None:
    """Every parameter and buffer of ``module`` from rank ``source`` of ``mesh``'s group (torch's ``src_data_rank``:
    the ranks then hold one model whatever each initialised); None keeps each rank's own."""
    if source is None:
        return
    group = mesh.get_group()
    root = dist.get_global_rank(group, source)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=root, group=group)


def _inputs_changed(args: tuple, kwargs: dict, change) -> tuple[tuple, dict]:
    """``args``/``kwargs`` of the layer's forward with ``change`` applied to its tensor inputs (query, key, value);
    a DTensor anywhere else (a mask, positions) is refused: the layer serves it as no layout."""
    for name, value in kwargs.items():
        if name not in _INPUTS and isinstance(value, DTensor):
            raise bad_argument(
                name,
                "a plain tensor (only query, key and value may be DTensors)",
                f"a DTensor with placements {value.placements}",
                f"pass {name}.to_local() or {name}.full_tensor()",
                kind=TypeError,
            )
    changed_args = tuple(change(value, _INPUTS[n]) if n < 3 else value for n, value in enumerate(args))
    changed_kwargs = {name: change(value, name) if name in _INPUTS else value for name, value in kwargs.items()}
    return changed_args, changed_kwargs


def _dtensor_on(value: DTensor, mesh: DeviceMesh, name: str, style: str) -> None:
    if value.device_mesh != mesh:
        raise bad_argument(
            name,
            f"a DTensor on the mesh {style} was applied with ({mesh})",
            f"a DTensor on {value.device_mesh}",
            f"redistribute it onto that mesh, or pass {name}.to_local()",
        )


class HeadParallel(ParallelStyle):
    """Shard a :class:`multihead.MultiHeadAttention` by heads over a one-dimensional mesh, in place: Megatron-style
    tensor parallelism (q/k/v column-wise, the output row-wise, grouped-query groups kept whole).

    After ``parallelize_module(layer_or_model, mesh["tp"], HeadParallel() or {path: HeadParallel()})`` the layer is
    this rank's :class:`multihead.parallel.HeadParallelAttention`: h/P query heads, g/P key/value heads (P must
    divide both), local parameters (plain tensors: save them per rank or gather them with
    :func:`multihead.parallel.gather_head_weights`); its forward takes the full input and returns the full output.

    Args:
        input_layouts: how plain-tensor inputs lie over the mesh dimension: ``Replicate()`` (the default: every rank
            has the whole (b, n, embed_dim)) or ``Shard(1)`` (each rank a contiguous slice of the sequence, as after
            torch's ``SequenceParallel`` norms: all-gathered first). DTensor inputs carry their own placements.
        output_layouts: ``Replicate()`` (the default: the whole (b, n, out_dim) on every rank) or ``Shard(1)``
            (this rank's contiguous slice of the sequence, for sequence-parallel norms after it).
        use_local_output: return plain tensors (the default), or DTensors with ``output_layouts``.

    ``src_data_rank`` (set by ``parallelize_module``, 0 by default): the rank of the mesh dimension whose weights
    every rank shards, broadcast first (None: each rank shards its own, which must then be equal).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ):
        super().__init__()
        self.input_layout = _placement(input_layouts, "input_layouts", (Replicate(), Shard(1)))
        self.output_layout = _placement(output_layouts, "output_layouts", (Replicate(), Shard(1)))
        if not isinstance(use_local_output, bool):
            raise bad_argument(
                "use_local_output", "True or False", describe(use_local_output), "pass True", kind=TypeError
            )
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layer = _checked_layer(module, "HeadParallel")
        mesh = _checked_mesh(device_mesh, "HeadParallel")
        if isinstance(layer, HeadParallelAttention):
            raise bad_argument(
                "module",
                "a layer not sharded by heads yet",
                f"a HeadParallelAttention (heads {layer.head_offset}..) already",
                "apply HeadParallel once per layer",
            )
        _broadcast_from(layer, mesh, self.src_data_rank)
        _shard_in_place(layer, mesh)
        layer.register_forward_pre_hook(self._whole_inputs(mesh), with_kwargs=True)
        layer.register_forward_hook(self._laid_out_output(mesh))
        return layer

    def _whole_inputs(self, mesh: DeviceMesh):
        def whole(value: object, name: str) -> object:  # the whole (b, n, dim) input this rank's heads read
            if isinstance(value, DTensor):
                _dtensor_on(value, mesh, name, "HeadParallel")
                return value.redistribute(mesh, [Replicate()]).to_local()
            if isinstance(value, torch.Tensor) and self.input_layout != Replicate():
                return DTensor.from_local(value, mesh, [self.input_layout]).redistribute(mesh, [Replicate()]).to_local()
            return value

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _inputs_changed(args, kwargs, whole)

        return hook

    def _laid_out_output(self, mesh: DeviceMesh):
        def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, Any]) -> tuple[Any, Any]:
            out, weights = output  # out (b, n, out_dim), the same on every rank
            if self.output_layout == Replicate() and self.use_local_output:
                return out, weights
            laid = DTensor.from_local(out, mesh, [Replicate()]).redistribute(mesh, [self.output_layout])
            return (laid.to_local() if self.use_local_output else laid), weights

        return hook


def _shard_in_place(layer: MultiHeadAttention, mesh: DeviceMesh) -> None:
    """Make ``layer`` itself this rank's head shard: the module :func:`shard_heads` builds, moved into ``layer`` (its
    class, parameters and attributes), keeping the layer's hooks and its sequence split."""
    sharded = shard_heads(layer, mesh)
    kept = {name for name in vars(layer) if "hook" in name} | {"sequence_split"}
    layer.__class__ = HeadParallelAttention
    layer.__dict__.update({name: value for name, value in vars(sharded).items() if name not in kept})


class ContextParallel(ParallelStyle):
    """Split a :class:`multihead.MultiHeadAttention`'s sequence over a one-dimensional mesh, in place: ring or
    Ulysses attention over the ranks, with the causal load balance of the zigzag layout.

    After ``parallelize_module(layer_or_model, mesh["cp"], ContextParallel(...))`` every call of the layer takes this
    rank's shard of the sequence, x (b, n/P, embed_dim), and returns its shard of the output (b, n/P, out_dim),
    equal to those positions of the whole layer's output on the whole sequence. Masks are typed masks on global
    positions (:func:`multihead.parallel.ring_attention` lists those served); rotary positions are the shard's
    global ones. Self-attention only; no weights, capture, KV cache or attention dropout in training (refused). The
    weights are replicated over the mesh dimension: sum or average their gradients over it as data parallelism does
    (FSDP2 or DDP over it, or an all-reduce). ``layer.sequence_split = None`` puts the layer back on one rank.

    Args:
        method: "ring" (any head count; memory flat in P) or "ulysses" (all-to-all; P must divide h).
        layout: "zigzag" (the default: rank r holds chunks r and 2P - 1 - r of 2P, as torch's context parallel
            balances causal work; shard with :func:`multihead.parallel.zigzag_shard`) or "contiguous" (rank r holds
            [r n/P, (r + 1) n/P): ``torch.chunk(x, P, dim=1)[r]``, a DTensor's ``Shard(1)``).
        use_local_output: return a plain tensor (the default), or a DTensor ``Shard(1)`` (contiguous layout only: a
            DTensor's shards are contiguous).

    DTensor inputs are taken in the contiguous layout only (redistributed to ``Shard(1)``, then local).
    """

    def __init__(self, *, method: str = "ring", layout: str = "zigzag", use_local_output: bool = True):
        super().__init__()
        check_method(method)
        check_layout(layout)
        if not isinstance(use_local_output, bool):
            raise bad_argument(
                "use_local_output", "True or False", describe(use_local_output), "pass True", kind=TypeError
            )
        if not use_local_output and layout != "contiguous":
            raise bad_argument(
                "use_local_output",
                'True with layout="zigzag" (a DTensor\'s Shard(1) holds contiguous positions)',
                False,
                'use layout="contiguous" for DTensor outputs, or keep use_local_output=True',
            )
        self.method, self.layout, self.use_local_output = method, layout, use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layer = _checked_layer(module, "ContextParallel")
        mesh = _checked_mesh(device_mesh, "ContextParallel")
        if layer.sequence_split is not None:
            raise bad_argument(
                "module",
                "a layer whose sequence is not split yet",
                "a layer with a sequence split already",
                "apply ContextParallel once per layer",
            )
        _broadcast_from(layer, mesh, self.src_data_rank)
        layer.sequence_split = SequenceSplit(mesh, self.method, self.layout)
        layer.register_forward_pre_hook(self._local_inputs(mesh), with_kwargs=True)
        if not self.use_local_output:
            layer.register_forward_hook(self._sharded_output(mesh))
        return layer

    def _local_inputs(self, mesh: DeviceMesh):
        def local(value: object, name: str) -> object:
            if not isinstance(value, DTensor):
                return value
            _dtensor_on(value, mesh, name, "ContextParallel")
            if self.layout != "contiguous":
                raise bad_argument(
                    name,
                    "a plain tensor: this rank's zigzag shard (layout=\"zigzag\"; a DTensor's Shard(1) is contiguous)",
                    f"a DTensor with placements {value.placements}",
                    'shard with multihead.parallel.zigzag_shard, or use ContextParallel(layout="contiguous")',
                    kind=TypeError,
                )
            return value.redistribute(mesh, [Shard(1)]).to_local()

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _inputs_changed(args, kwargs, local)

        return hook

    def _sharded_output(self, mesh: DeviceMesh):
        def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, Any]) -> tuple[Any, Any]:
            out, weights = output  # (b, n/P, out_dim): this rank's contiguous positions
            return DTensor.from_local(out, mesh, [Shard(1)]), weights

        return hook
