"""Record what the heads of a model compute: models built on :class:`multihead.MultiHeadAttention`,
and Hugging Face transformers models running on ``attn_implementation="multihead"``.

    with capture(model, layers=[0, 5], heads=[3]) as rec:
        model.encode("The bank was full of money.")
    rec.weights(5, 3)          # (b, i, j): layer 5, head 3

The recorder hooks each chosen layer's :class:`multihead.attend.Attend` step (forward hooks; no
flag is threaded through the model's forward). For a layer it records, the attention call is asked
for a :class:`multihead.WeightSelection` of the chosen heads and query rows, so the weights come
from the same kernel call as the output at a cost proportional to the selection; every layer not
recorded, and the output itself, run exactly as without the recorder.

The attention steps of a model are its :class:`~multihead.attend.AttentionSite` s (see
:func:`attention_sites`), grouped in parts: "self" in a one-stack model; "encoder", "decoder" and
"cross" in an encoder-decoder. A recorder records one part; layer numbers are the part's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from multihead._errors import bad_argument, describe
from multihead._indices import checked_indices
from multihead.attend import AttentionSite, find_sites
from multihead.functional import AttentionResult, WeightSelection, attention_result
from multihead.latent import LatentAttention
from multihead.layer import MultiHeadAttention
from multihead.streamed_stats import AttentionStats, StatsSettings, attention_stats

__all__ = ["capture", "Recorder", "attention_layers", "attention_sites", "part_sites"]

_SUPPORTED = (
    "a model built with multihead.MultiHeadAttention, or a transformers model loaded with "
    'attn_implementation="multihead"'
)
_HOW = (
    "build the model from multihead.MultiHeadAttention, or import multihead.integrations.transformers "
    'and load it with from_pretrained(..., attn_implementation="multihead")'
)


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise bad_argument("model", f"a torch.nn.Module: {_SUPPORTED}", describe(model), _HOW, kind=TypeError)
    return model


def attention_layers(model: nn.Module, *, latent: bool = False) -> list:
    """The model's attention layers, in order: layer index l is the l-th :class:`MultiHeadAttention` (with
    ``latent``, :class:`multihead.LatentAttention` layers count too: capture reads them, head surgery that needs a
    MultiHeadAttention's weights does not).

    A model with an ``attention_layers`` attribute (such as :class:`multihead.lab.models.Encoder`) gives
    its own order; otherwise the order of ``model.modules()``.
    """
    model = _check_model(model)
    layers = getattr(model, "attention_layers", None)
    kinds = (MultiHeadAttention, LatentAttention) if latent else (MultiHeadAttention,)
    if layers is None:
        layers = [module for module in model.modules() if isinstance(module, kinds)]
    if not layers:
        raise bad_argument("model", _SUPPORTED, f"a {type(model).__name__} with no attention layer of ours", _HOW)
    return list(layers)


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention step of ``model`` where capture and head surgery act, part by part in order.

    A transformers model on ``attn_implementation="multihead"`` gives its attention modules (through
    the finder :mod:`multihead.integrations.transformers` registers), numbered by their ``layer_idx``;
    any other model its :func:`attention_layers`, all in part "self".
    """
    model = _check_model(model)
    sites = find_sites(model)
    if sites is not None:
        return sites
    names = {id(module): name for name, module in model.named_modules()}
    layers: list[MultiHeadAttention | LatentAttention] = attention_layers(model, latent=True)
    return [
        AttentionSite(layer.attend, layer.num_heads, layer.num_kv_heads, "self", index, names.get(id(layer), ""))
        for index, layer in enumerate(layers)
    ]


def part_sites(model: nn.Module, part: str | None = None) -> tuple[str, list[AttentionSite]]:
    """The chosen part (default: the model's first) and its sites, in layer order (site l is layer l)."""
    sites = attention_sites(model)
    parts = list(dict.fromkeys(site.part for site in sites))
    if part is None:
        part = parts[0]
    elif not isinstance(part, str):
        raise bad_argument("part", f"one of {parts}", describe(part), f'pass e.g. part="{parts[0]}"', kind=TypeError)
    if part not in parts:
        raise bad_argument("part", f"one of the model's parts {parts}", repr(part), f'pass e.g. part="{parts[0]}"')
    return part, sorted((site for site in sites if site.part == part), key=lambda site: site.index)


@dataclass
class _LayerRecord:
    """What one layer recorded, one list entry per forward call."""

    heads: list[int]
    weights: list[torch.Tensor] = field(default_factory=list)  # (b, len(heads), i', j)
    q: list[torch.Tensor] = field(default_factory=list)  # (b, len(heads), i, d)
    k: list[torch.Tensor] = field(default_factory=list)  # (b, len(heads), j, d): each head's key head
    v: list[torch.Tensor] = field(default_factory=list)  # (b, len(heads), j, e)
    outputs: list[torch.Tensor] = field(default_factory=list)  # (b, len(heads), i, e)
    stats: list[AttentionStats] = field(default_factory=list)  # the heads' streamed statistics


class Recorder:
    """Records per-head attention of chosen layers while active (use :func:`capture`).

    Layer numbers are the layer indices of the recorded ``part`` (see :func:`attention_sites`);
    head numbers are the layer's query heads. Every accessor takes ``call`` (default -1: the latest forward pass).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        part: str | None = None,
        layers: Sequence[int] | int | None = None,
        heads: Sequence[int] | int | None = None,
        queries: Sequence[int] | slice | None = None,
        weights: bool = True,
        qkv: bool = False,
        outputs: bool = False,
        stats: bool | StatsSettings = False,
        sites: Sequence[AttentionSite] | None = None,
    ):
        # a caller that resolved the part already (an inspection records many layers of one part) passes its sites:
        # the model's modules are walked once per inspection, not once per recorder
        self.part, sites = part_sites(model, part) if sites is None else (str(part), list(sites))
        self.layers = checked_indices("layers", layers, len(sites), "layer")
        if queries is not None and not isinstance(queries, slice):
            if isinstance(queries, int) or not all(isinstance(x, int) for x in queries):
                raise bad_argument(
                    "queries",
                    "a slice or a list of query positions",
                    describe(queries),
                    "pass e.g. queries=[2] or queries=slice(0, 4)",
                    kind=TypeError,
                )
            queries = list(queries)
        for name, flag in (("weights", weights), ("qkv", qkv), ("outputs", outputs)):
            if not isinstance(flag, bool):
                raise bad_argument(name, "True or False", describe(flag), f"pass {name}=True", kind=TypeError)
        if not isinstance(stats, (bool, StatsSettings)):
            raise bad_argument(
                "stats", "True, False or a StatsSettings", describe(stats), "pass stats=True", kind=TypeError
            )
        self.queries = queries
        self.record_weights, self.record_qkv, self.record_outputs = weights, qkv, outputs
        self.stats_settings = StatsSettings() if stats is True else (stats or None)
        self._sites = {index: sites[index] for index in self.layers}
        self._records: dict[int, _LayerRecord] = {}
        for index, site in self._sites.items():
            self._records[index] = _LayerRecord(checked_indices("heads", heads, site.num_heads, "head"))
        self._handles: list = []

    # -------------------------------------------------------------------- hooks

    def __enter__(self) -> Recorder:
        if self._handles:
            raise RuntimeError("this recorder is already active; use a new capture(...) for a nested block")
        for index, site in self._sites.items():
            record = self._records[index]
            pending: list[bool] = []  # per call in flight: did we ask the kernel for the weights?
            self._handles.append(site.attend.register_forward_pre_hook(self._before(record, pending), with_kwargs=True))
            self._handles.append(site.attend.register_forward_hook(self._after(record, pending), with_kwargs=True))
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _selection(self, record: _LayerRecord) -> WeightSelection:
        return WeightSelection(heads=record.heads, queries=self.queries)

    def _before(self, record: _LayerRecord, pending: list[bool]):
        def hook(module, args, kwargs):
            asked = kwargs.get("return_weights", False)
            inject = self.record_weights and asked is False
            pending.append(inject)
            if inject:  # the same kernel call returns the selected weights beside the output
                return args, {**kwargs, "return_weights": self._selection(record)}
            return None

        return hook

    def _after(self, record: _LayerRecord, pending: list[bool]):
        def hook(module, args, kwargs, result: AttentionResult):
            injected = pending.pop()
            q, k, v = args[:3]  # (b, h, i, d), (b, g, j, d), (b, g, j, e); a paged call's page pools
            call = {name: kwargs.get(name) for name in ("mask", "scale", "pages", "sinks")}
            call["causal"] = kwargs.get("causal", False)
            output = result.output  # (b, h, i, e)
            heads = record.heads
            # the key/value head each recorded query head reads in this call (a layer may make calls with other
            # groupings: LatentAttention's absorbed path is one key head for every query head)
            kv_heads = [head // (q.shape[1] // k.shape[1]) for head in heads]
            if self.record_weights:
                if injected:
                    weights = result.weights
                elif kwargs.get("return_weights") is True:  # the caller asked for every weight: slice ours
                    assert result.weights is not None  # asked for
                    weights = result.weights[:, heads]
                    weights = weights if self.queries is None else weights[:, :, self.queries]
                else:  # the caller asked for a selection of its own: one more call for ours
                    selection = self._selection(record)
                    again = attention_result(q, k, v, **call, backend=module.backend, return_weights=selection)
                    finish = kwargs.get("finish")  # the step's own change to the kernel's result (Attend.forward)
                    weights = (again if finish is None else finish(again, selection)).weights
                assert weights is not None  # asked for
                record.weights.append(weights.detach())
            if call["pages"] is not None and (self.record_qkv or self.stats_settings is not None):
                # what is recorded of a paged call's keys is its dense equivalent: each sequence's keys in order
                k, v, call["mask"] = call["pages"].dense(k, v, call["causal"])
                call["causal"], call["pages"] = False, None
            if self.record_qkv:
                record.q.append(q[:, heads].detach())
                record.k.append(k[:, kv_heads].detach())
                record.v.append(v[:, kv_heads].detach())
            if self.record_outputs:
                record.outputs.append(output[:, heads].detach())
            if self.stats_settings is not None:  # a second pass over the layer's blocks, O(i + j) memory per head
                rows = self.queries
                if isinstance(rows, slice):
                    rows = list(range(q.shape[-2])[rows])
                found = attention_stats(  # forward only: no graph, whatever q, k and v need
                    q,
                    k,
                    v,
                    mask=call["mask"],
                    causal=call["causal"],
                    scale=call["scale"],
                    sinks=call["sinks"],
                    heads=heads,
                    rows=rows,
                    **self.stats_settings.options(),
                )
                record.stats.append(found)
            if injected:  # hand the layer what it asked for: no weights
                return result._replace(weights=None)
            return None

        return hook

    # -------------------------------------------------------------------- access

    def clear(self) -> None:
        """Forget every recorded call (keeps recording if active)."""
        for record in self._records.values():
            for store in (record.weights, record.q, record.k, record.v, record.outputs, record.stats):
                store.clear()

    def calls(self, layer: int) -> int:
        """How many forward passes of ``layer`` were recorded."""
        record = self._record(layer)
        return max(len(store) for store in (record.weights, record.q, record.outputs, record.stats))

    def heads(self, layer: int) -> list[int]:
        """The query heads recorded for ``layer``."""
        return list(self._record(layer).heads)

    def _record(self, layer: int) -> _LayerRecord:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise bad_argument(
                "layer", "a layer index (int)", describe(layer), "pass e.g. rec.weights(0, 3)", kind=TypeError
            )
        if layer not in self._records:
            raise bad_argument(
                "layer",
                f"one of the recorded layers {self.layers}",
                layer,
                "pass capture(model, layers=[...]) including it",
            )
        return self._records[layer]

    def _get(self, kind: str, enabled: bool, flag: str, layer: int, head: int | None, call: int) -> torch.Tensor:
        record = self._record(layer)
        tensor = self._call(record, kind, enabled, flag, call)
        if head is None:
            return tensor
        if head not in record.heads:
            raise bad_argument(
                "head",
                f"one of the recorded heads {record.heads}",
                head,
                "pass capture(model, heads=[...]) including it",
            )
        return tensor[:, record.heads.index(head)]

    def _call(self, record: _LayerRecord, kind: str, enabled: bool, flag: str, call: int):
        """What ``record`` stored of ``kind`` on forward pass ``call``; errors naming ``flag`` or ``call``."""
        if not enabled:
            raise bad_argument(flag, "True to record " + kind, False, f"use capture(model, {flag}=True)")
        store = getattr(record, kind)
        if not store:
            raise bad_argument(
                "call",
                "a recorded forward pass",
                "none recorded yet",
                "run the model inside the `with capture(...)` block first",
            )
        if not -len(store) <= call < len(store):
            raise bad_argument(
                "call",
                f"an index into the {len(store)} recorded passes",
                call,
                f"pass call in -{len(store)}..{len(store) - 1}",
            )
        return store[call]

    def weights(self, layer: int, head: int | None = None, *, call: int = -1) -> torch.Tensor:
        """Attention weights of ``layer``: (b, i', j) for one head, (b, heads, i', j) for head=None.

        i' is the number of recorded query rows (all i unless ``queries`` was given).
        """
        return self._get("weights", self.record_weights, "weights", layer, head, call)

    def q(self, layer: int, head: int | None = None, *, call: int = -1) -> torch.Tensor:
        """Queries after projection (and rotary): (b, i, d) for one head, (b, heads, i, d) for all."""
        return self._get("q", self.record_qkv, "qkv", layer, head, call)

    def k(self, layer: int, head: int | None = None, *, call: int = -1) -> torch.Tensor:
        """Keys the head reads (its key/value head under GQA): (b, j, d) or (b, heads, j, d)."""
        return self._get("k", self.record_qkv, "qkv", layer, head, call)

    def v(self, layer: int, head: int | None = None, *, call: int = -1) -> torch.Tensor:
        """Values the head reads: (b, j, e) or (b, heads, j, e)."""
        return self._get("v", self.record_qkv, "qkv", layer, head, call)

    def outputs(self, layer: int, head: int | None = None, *, call: int = -1) -> torch.Tensor:
        """Per-head attention outputs before concatenation and W^O: (b, i, e) or (b, heads, i, e)."""
        return self._get("outputs", self.record_outputs, "outputs", layer, head, call)

    def stats(self, layer: int, *, call: int = -1) -> AttentionStats:
        """The recorded heads' streamed statistics of ``layer`` (:func:`multihead.attention_stats`: its ``heads``
        are the recorded heads, its ``rows`` the recorded query rows)."""
        return self._call(self._record(layer), "stats", self.stats_settings is not None, "stats", call)


def capture(
    model: nn.Module,
    *,
    part: str | None = None,
    layers: Sequence[int] | int | None = None,
    heads: Sequence[int] | int | None = None,
    queries: Sequence[int] | slice | None = None,
    weights: bool = True,
    qkv: bool = False,
    outputs: bool = False,
    stats: bool | StatsSettings = False,
) -> Recorder:
    """A context manager that records per-head attention from every forward pass inside it.

    Args:
        model: any module built with :class:`multihead.MultiHeadAttention` (or one such layer), or a
            transformers model loaded with ``attn_implementation="multihead"``.
        part: which attention to record: "self" (one-stack models), or "encoder", "decoder" or "cross"
            for an encoder-decoder (default: the model's first part; see :func:`attention_sites`).
        layers: layer indices within the part to record (default all).
        heads: query heads to record in each of those layers (default all).
        queries: query positions (a list or slice) whose weight rows to keep (default all).
        weights: record attention weights (b, heads, i', j).
        qkv: record each head's q (b, heads, i, d), k (b, heads, j, d), v (b, heads, j, e).
        outputs: record each head's output (b, heads, i, e), before W^O.
        stats: record each head's streamed statistics (:func:`multihead.attention_stats`, read with
            :meth:`Recorder.stats`): True for the defaults, or a :class:`multihead.streamed_stats.StatsSettings`.
            They take O(i + j) memory per head, so long inputs can be read with ``weights=False``; the layer
            runs its kernel once more for the log-sum-exp, then one pass over its blocks.

    Example:
        >>> model, tokenizer = multihead.lab.models.load_minilm()
        >>> with multihead.lab.inspect.capture(model, layers=[2], heads=[0, 5]) as rec:
        ...     _ = model.encode("The bank was full of money.")
        >>> rec.weights(2, 5).shape            # (b, i, j): 9 word pieces with [CLS] and [SEP]
        torch.Size([1, 9, 9])
    """
    return Recorder(
        model,
        part=part,
        layers=layers,
        heads=heads,
        queries=queries,
        weights=weights,
        qkv=qkv,
        outputs=outputs,
        stats=stats,
    )
