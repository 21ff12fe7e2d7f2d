"""A drop-in for ``torch.nn.MultiheadAttention`` (and its functional form), and weight converters.

``multihead.compat.MultiheadAttention`` has torch's constructor, forward signature,
parameter names (so a torch ``state_dict`` loads unchanged) and semantics:
sequence-first by default, boolean masks with True = *masked out*, float masks
added, ``(N * num_heads, L, S)`` 3-D masks, ``add_bias_kv``, ``add_zero_attn``,
weights averaged over heads by default. It computes with multihead's kernels.
``multi_head_attention_forward`` is ``torch.nn.functional.multi_head_attention_forward``
on the same core (``static_k`` / ``static_v`` included).

This module is the one place torch's mask polarity is converted to ours
(True = may attend); nothing past the validation at the top of a call sees torch's
convention. Every argument is checked there, once, before anything is computed.

Errors keep torch's exception types as well as ours: a shape torch refuses with an
AssertionError (or a RuntimeError) raises :class:`ShapeError`, which is a ValueError,
an AssertionError and a RuntimeError at once, and carries torch's own wording after
ours (``... Fix: ... (torch: expected `key` and `value` to be 3-D but found ...)``),
so code and tests written against torch keep working.

Intended differences from torch (docs/compat.md lists them all, with the reasons):
a query whose keys are all masked gets output 0 and weights 0 where torch returns NaN;
``is_causal`` is only a hint, so ``attn_mask`` is always honoured; torch's fused fast
paths are never taken (a no-op forward pre-hook keeps ``nn.TransformerEncoderLayer``'s
away); nested tensors (jagged or strided) are supported on every path, with weights
returned padded; TorchScript is refused with a clear error (use ``torch.compile`` or
``torch.export``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from multihead._errors import (
    ArgumentTypeError,
    ArgumentValueError,
    InputError,
    bad_argument,
    checked_flag,
    checked_probability,
    describe,
    floating_dtype,
    positive_int,
    usable_device,
)
from multihead._inputs import like_parameters, matching, tensor_argument
from multihead._limits import check_fits
from multihead.functional import attention_result, autocast_on
from multihead.layer import MultiHeadAttention
from multihead.masks import Mask, as_mask

__all__ = [
    "MultiheadAttention",
    "multi_head_attention_forward",
    "from_torch",
    "to_torch",
    "replace",
    "CompatValueError",
    "ShapeError",
    "DtypeError",
    "NotScriptableError",
]


# --------------------------------------------------------------------------- errors


class CompatValueError(ArgumentValueError, AssertionError, RuntimeError):
    """A bad argument that torch refuses with an AssertionError or a RuntimeError.

    Catchable as ValueError (multihead's convention), as AssertionError and RuntimeError (what
    code written against torch catches) and as :class:`multihead._errors.InputError`.
    """


class ShapeError(CompatValueError):
    """A tensor argument whose number of dims or sizes do not fit the call."""


class DtypeError(ArgumentTypeError, AssertionError, RuntimeError):
    """A tensor argument of the wrong dtype: a TypeError, and the AssertionError / RuntimeError torch raises."""


class NotScriptableError(InputError, RuntimeError):
    """``torch.jit.script`` of a module holding the drop-in: TorchScript cannot compile multihead's kernels."""


def _error(kind: type[Exception], name: str, expected: str, got: object, fix: str, torch_says: str | None = None):
    """bad_argument(...) of ``kind``, with torch's message for the same condition appended when it has one."""
    return bad_argument(name, expected, got, fix if torch_says is None else f"{fix} (torch: {torch_says})", kind=kind)


def _text(value: object) -> str:
    """describe(), also for nested tensors (a strided nested tensor has no .shape)."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return f"a nested tensor (layout {value.layout}, {value.dim()}-D, dtype {value.dtype})"
    return describe(value)


def _shape(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}"


# --------------------------------------------------------------------------- the core


@dataclass
class _Params:
    """Projection weights in the layout the core uses, with the names the caller knows them by."""

    w_q: torch.Tensor  # (E, E)
    w_k: torch.Tensor  # (E, kdim)
    w_v: torch.Tensor  # (E, vdim)
    b_q: torch.Tensor | None  # (E,)
    b_k: torch.Tensor | None
    b_v: torch.Tensor | None
    bias_k: torch.Tensor | None  # (1, 1, E)
    bias_v: torch.Tensor | None
    out_w: torch.Tensor  # (E, E)
    out_b: torch.Tensor | None  # (E,)
    named: list[tuple[str, torch.Tensor]]  # every tensor above that is set, under the caller's name

    @property
    def embed_dim(self) -> int:
        return self.w_q.shape[0]


def _keep_or_bias(mask: torch.Tensor) -> torch.Tensor:
    """Torch's mask (bool True = masked out, or float added) as ours (bool True = may attend, or float added)."""
    return mask.logical_not() if mask.dtype == torch.bool else mask


def _combine(masks: list[torch.Tensor]) -> Mask | None:
    """Several keep/bias tensors as one mask (multihead.masks combines bool and float terms with &)."""
    combined = None
    for m in masks:
        combined = as_mask(m) if combined is None else combined & m
    return combined


def _pad_key(masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """One more key column that every query may attend (bias_k, or the zero key)."""
    return [F.pad(m, (0, 1), value=True if m.dtype == torch.bool else 0.0) for m in masks]


@dataclass
class _Call:
    """What the validation found: the sizes of the call in torch's terms."""

    batched: bool
    batch: int  # N (1 when unbatched)
    target_len: int  # L
    source_len: int  # S, the keys the masks cover (static_k's length when given)


def _check_arguments(
    query, key, value, key_padding_mask, attn_mask, need_weights, average_attn_weights, is_causal
) -> None:
    """Types, flags and numbers of dims: the checks that hold for dense and nested inputs alike."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        tensor_argument(name, t)
    for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if m is not None and not isinstance(m, torch.Tensor):
            raise bad_argument(
                name, "None or a tensor", describe(m), f"pass {name} as a bool or float tensor", kind=TypeError
            )
    for name, flag in (
        ("need_weights", need_weights),
        ("average_attn_weights", average_attn_weights),
        ("is_causal", is_causal),
    ):
        checked_flag(name, flag)
    dims = query.dim()
    if dims not in (2, 3):
        raise _error(
            ShapeError,
            "query",
            "an unbatched 2-D (L, E) or batched 3-D tensor ((L, N, E), or (N, L, E) with batch_first=True)",
            _text(query),
            "add or remove axes",
            f"query should be unbatched 2D or batched 3D tensor but received {dims}-D query tensor",
        )
    word = "batched (3-D)" if dims == 3 else "unbatched (2-D)"
    if key.dim() != dims or value.dim() != dims:
        raise _error(
            ShapeError,
            "key" if key.dim() != dims else "value",
            f"{dims}-D key and value, like the {word} query",
            f"key {_text(key)} and value {_text(value)}",
            "give query, key and value the same number of dims",
            f"For {word} `query`, expected `key` and `value` to be {dims}-D but found {key.dim()}-D and "
            f"{value.dim()}-D tensors respectively",
        )
    if key_padding_mask is not None and key_padding_mask.dim() != dims - 1:
        raise _error(
            ShapeError,
            "key_padding_mask",
            f"a {dims - 1}-D mask {'(N, S)' if dims == 3 else '(S,)'} for the {word} query",
            _text(key_padding_mask),
            "one True/False (or float) per key" + (" and batch element" if dims == 3 else ""),
            f"For {word} `query`, expected `key_padding_mask` to be `None` or {dims - 1}-D but found "
            f"{key_padding_mask.dim()}-D tensor instead",
        )
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise _error(
            ShapeError,
            "attn_mask",
            "a 2-D (L, S) or 3-D (N * num_heads, L, S) mask",
            _text(attn_mask),
            "pass one row per query and one column per key",
            f"For {word} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found {attn_mask.dim()}-D "
            "tensor instead",
        )
    if is_causal and attn_mask is None:
        # torch treats is_causal as a hint about attn_mask and refuses it alone
        raise _error(
            CompatValueError,
            "attn_mask",
            "a causal attn_mask when is_causal=True (is_causal is a hint about attn_mask)",
            None,
            "pass attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(L)",
            "Need attn_mask if specifying the is_causal hint.",
        )


def _check_sizes(
    query,
    key,
    value,
    params: _Params,
    num_heads: int,
    batch_first: bool,
    key_padding_mask,
    attn_mask,
    static_k,
    static_v,
    need_weights: bool,
    add_zero_attn: bool,
) -> _Call:
    """Sizes, dtypes and devices of dense inputs, in the caller's layout. Returns the call's sizes."""
    batched = query.dim() == 3
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.is_nested:
            raise _error(
                CompatValueError,
                name,
                "a dense tensor like the others (or all three nested)",
                _text(t),
                "pass query, key and value all nested or all dense",
            )
    seq_axis, batch_axis = (1, 0) if batch_first else (0, 1)
    target_len = query.shape[seq_axis] if batched else query.shape[0]
    batch = query.shape[batch_axis] if batched else 1
    _check_features(query, key, value, params, batched, batch_first, batch)
    key_len = key.shape[seq_axis] if batched else key.shape[0]
    value_len = value.shape[seq_axis] if batched else value.shape[0]
    _check_static(params, num_heads, batch, static_k, static_v)
    source_len = _checked_source_len(key, value, static_k, static_v, key_len, value_len)
    _check_mask_shapes(key_padding_mask, attn_mask, batched, batch, num_heads, target_len, source_len)
    _check_dtypes(query, key, value, params, key_padding_mask, attn_mask, static_k, static_v)
    _check_allocations(query, params, num_heads, batch, target_len, source_len, need_weights, add_zero_attn)
    return _Call(batched, batch, target_len, source_len)


def _check_features(query, key, value, params: _Params, batched: bool, batch_first: bool, batch: int) -> None:
    """The feature sizes of query (E = embed_dim), key (kdim) and value (vdim), and their batch sizes (N)."""
    embed_dim, kdim, vdim = params.embed_dim, params.w_k.shape[1], params.w_v.shape[1]
    layout = ("(N, L, E)" if batch_first else "(L, N, E)") if batched else "(L, E)"
    batch_axis = 0 if batch_first else 1
    if query.shape[-1] != embed_dim:
        raise _error(
            ShapeError,
            "query",
            f"{layout} with E = embed_dim = {embed_dim}",
            _shape(query),
            "check batch_first and the feature size",
            f"was expecting embedding dimension of {embed_dim}, but got {query.shape[-1]}",
        )
    for name, t, features, what in (("key", key, kdim, "kdim"), ("value", value, vdim, "vdim")):
        if t.shape[-1] != features:
            raise _error(
                ShapeError, name, f"last dim {what} = {features}", _shape(t), "check batch_first and kdim/vdim"
            )
        if batched and t.shape[batch_axis] != batch:
            raise _error(
                ShapeError,
                name,
                f"batch size N = {batch} (from query) on dim {batch_axis}",
                _shape(t),
                "give query, key and value the same batch size; check batch_first",
            )


def _check_static(params: _Params, num_heads: int, batch: int, static_k, static_v) -> None:
    """static_k / static_v: None or (N * num_heads, S, head_dim) tensors, and never beside bias_k / bias_v."""
    h = num_heads
    for name, static in (("static_k", static_k), ("static_v", static_v)):
        if static is None:
            continue
        if not isinstance(static, torch.Tensor):
            raise bad_argument(
                name, "None or a tensor (N * num_heads, S, head_dim)", describe(static), "pass a tensor", kind=TypeError
            )
        head_dim = params.embed_dim // h
        if static.dim() != 3 or static.shape[0] != batch * h or static.shape[2] != head_dim:
            says = (
                f"expecting {name}.size(0) of {batch * h}, but got {static.shape[0]}"
                if static.dim() == 3 and static.shape[0] != batch * h
                else f"expecting {name}.size(2) of {head_dim}, but got {static.shape[-1]}"
                if static.dim() == 3
                else None
            )
            raise _error(
                ShapeError,
                name,
                f"(N * num_heads, S, head_dim) = ({batch * h}, S, {head_dim})",
                _text(static),
                "give one row per batch element and head, in torch's (N * num_heads) order",
                says,
            )
    if params.bias_k is not None and (static_k is not None or static_v is not None):
        name = "static_k" if static_k is not None else "static_v"
        raise _error(
            CompatValueError,
            name,
            "None when bias_k / bias_v are added (add_bias_kv)",
            "a tensor",
            "project the static keys with the bias appended yourself, or drop bias_k and bias_v",
            f"bias cannot be added to static {'key' if name == 'static_k' else 'value'}.",
        )


def _checked_source_len(key, value, static_k, static_v, key_len: int, value_len: int) -> int:
    """S, the number of keys (static_k's when given), once the values are checked to have as many."""
    source_len = static_k.shape[1] if static_k is not None else key_len
    values_len = static_v.shape[1] if static_v is not None else value_len
    if values_len != source_len:
        name = "static_v" if static_v is not None else "value"
        origin = "static_k" if static_k is not None else "key"
        raise _error(
            ShapeError,
            name,
            f"length S = {source_len} (from {origin})",
            values_len,
            "give keys and values the same length",
            f"key shape {tuple(key.shape)} does not match value shape {tuple(value.shape)}"
            if static_k is None and static_v is None
            else None,
        )
    return source_len


def _check_mask_shapes(
    key_padding_mask, attn_mask, batched: bool, batch: int, num_heads: int, target_len: int, source_len: int
) -> None:
    """key_padding_mask (N, S) or (S,); attn_mask (L, S), or (N * num_heads, L, S) ((num_heads, L, S) unbatched)."""
    h = num_heads
    if key_padding_mask is not None:
        expected = (batch, source_len) if batched else (source_len,)
        if tuple(key_padding_mask.shape) != expected:
            raise _error(
                ShapeError,
                "key_padding_mask",
                f"shape {'(N, S)' if batched else '(S,)'} = {expected}",
                _shape(key_padding_mask),
                "one entry per key" + (" and batch element" if batched else ""),
                f"expecting key_padding_mask shape of {expected}, but got {key_padding_mask.shape}",
            )
    if attn_mask is not None:
        flat = (target_len, source_len)
        per_head = (batch * h, target_len, source_len) if batched else (h, target_len, source_len)
        if tuple(attn_mask.shape) not in (flat, per_head):
            heads = "N * num_heads" if batched else "num_heads"
            if not batched and attn_mask.dim() == 3:
                says = f"Expected `attn_mask` shape to be {per_head} but got {attn_mask.shape}"
            else:
                want = flat if attn_mask.dim() == 2 else per_head
                says = f"The shape of the {attn_mask.dim()}D attn_mask is {attn_mask.shape}, but should be {want}."
            raise _error(
                ShapeError,
                "attn_mask",
                f"shape (L, S) = {flat} or ({heads}, L, S) = {per_head}",
                _shape(attn_mask),
                "build the mask for these lengths",
                says,
            )


def _check_allocations(
    query,
    params: _Params,
    num_heads: int,
    batch: int,
    target_len: int,
    source_len: int,
    need_weights: bool,
    add_zero_attn: bool,
) -> None:
    """Refuse, before anything is allocated, a call whose projections (N, L, E), (N, S', E) or weights
    (N, h, L, S') cannot fit (S' = S plus bias_k's key and the zero key)."""
    embed_dim = params.embed_dim
    # what the call will allocate: projections, and the (N, h, L, S') weights when asked for
    keys = source_len + int(params.bias_k is not None) + int(add_zero_attn)
    fix = "split the batch or the sequences into chunks that fit"
    check_fits("query", (batch, target_len, embed_dim), query.dtype, query.device, fix, what="its projection")
    check_fits("key", (batch, keys, embed_dim), query.dtype, query.device, fix, what="its projection")
    if need_weights:
        check_fits(
            "need_weights",
            (batch, num_heads, target_len, keys),
            query.dtype,
            query.device,
            "pass need_weights=False (the output does not need them), or " + fix,
            what="the attention weights",
        )


# Biases that torch adds to the (L, N, E) product of a batched call or appends as a key (torch.cat), where type
# promotion keeps the weights' dtype when theirs is lower: torch runs a double module with a half in_proj_bias (its
# test_multihead_attn_fast_path_query_and_bias_have_different_dtypes) or half bias_k / bias_v, and so do we, with its
# numbers. Its out_proj adds its bias through addmm, which refuses another dtype, as we do
PROMOTED_BIASES = frozenset({"in_proj_bias", "bias_k", "bias_v"})


def _check_dtypes(query, key, value, params: _Params, key_padding_mask, attn_mask, static_k, static_v) -> None:
    autocast = autocast_on(query.device)
    like_parameters("query", query, params.out_w, "the parameters", autocast=autocast, dtype_kind=DtypeError)
    weights_dtype = params.out_w.dtype
    for name, p in params.named:
        promoted = (
            name in PROMOTED_BIASES
            and p.is_floating_point()
            and torch.promote_types(p.dtype, weights_dtype) == weights_dtype
        )
        matching(
            name,
            p,
            params.out_w,
            "out_proj.weight",
            fix="give the module one dtype and device with .to(...)",
            dtype_kind=DtypeError,
            check_dtype=not promoted,
        )
    for name, t in (("key", key), ("value", value), ("static_k", static_k), ("static_v", static_v)):
        if t is None:
            continue
        matching(name, t, query, "the query", fix=f"convert with {name}.to(query)", dtype_kind=DtypeError)
    for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if m is None:
            continue
        if m.dtype != torch.bool and not m.is_floating_point():
            raise _error(
                DtypeError,
                name,
                "a bool (True = masked out) or floating (added) tensor",
                m.dtype,
                "convert with .bool() or .float()",
                f"only bool and floating types of {name} are supported",
            )
        matching(name, m, query, "the query", fix=f"move {name} to the query's device", check_dtype=False)


class _Options(TypedDict):
    """The module's options for :func:`_attend`, passed on as keywords."""

    num_heads: int
    add_zero_attn: bool
    dropout: float
    training: bool
    batch_first: bool
    need_weights: bool
    average_attn_weights: bool
    is_causal: bool


def _attend(
    query,
    key,
    value,
    params: _Params,
    *,
    num_heads: int,
    add_zero_attn: bool,
    dropout: float,
    training: bool,
    batch_first: bool,
    key_padding_mask,
    need_weights: bool,
    attn_mask,
    average_attn_weights: bool,
    is_causal: bool,
    static_k=None,
    static_v=None,
    dropout_name: str = "dropout",
):
    """The whole forward on dense inputs: validate everything, then project, attend and project out."""
    _check_arguments(query, key, value, key_padding_mask, attn_mask, need_weights, average_attn_weights, is_causal)
    call = _check_sizes(
        query,
        key,
        value,
        params,
        num_heads,
        batch_first,
        key_padding_mask,
        attn_mask,
        static_k,
        static_v,
        need_weights,
        add_zero_attn,
    )
    checked_probability(dropout_name, dropout)
    checked_flag("training", training)
    # ---- nothing is computed above this line; nothing is checked below it
    if not call.batched:  # (L, E) -> (L, 1, E), torch's unbatched convention
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)  # (S,) -> (1, S)
    elif batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # (N, L, E) -> (L, N, E)
    n, h, L, S = call.batch, num_heads, call.target_len, call.source_len
    E = params.embed_dim
    d = E // h
    masks = []  # ours: bool True = may attend, or float added; each broadcastable to (N, h, L, S)
    if attn_mask is not None:
        ours = _keep_or_bias(attn_mask)
        masks.append(ours if ours.dim() == 2 else ours.view(n, h, L, S))  # torch's (N * h) order is n-major
    if key_padding_mask is not None:
        masks.append(_keep_or_bias(key_padding_mask)[:, None, None, :])  # (N, 1, 1, S)

    q = F.linear(query, params.w_q, params.b_q)  # (L, N, E)
    q = q.view(L, n, h, d).permute(1, 2, 0, 3)  # (N, h, L, d)
    heads = []
    for static, x, w, b, extra in (
        (static_k, key, params.w_k, params.b_k, params.bias_k),
        (static_v, value, params.w_v, params.b_v, params.bias_v),
    ):
        if static is not None:
            heads.append(static.view(n, h, S, d))  # (N * h, S, d) -> (N, h, S, d)
            continue
        x = F.linear(x, w, b)  # (S, N, E)
        if extra is not None:  # one learned key/value appended to every sequence
            x = torch.cat([x, extra.expand(1, n, E)])  # (S + 1, N, E)
        heads.append(x.view(x.shape[0], n, h, d).permute(1, 2, 0, 3))  # (N, h, S', d)
    k, v = heads
    if params.bias_k is not None:
        masks = _pad_key(masks)
    if add_zero_attn:  # one all-zero key/value appended per head
        k = torch.cat([k, k.new_zeros(n, h, 1, d)], dim=2)
        v = torch.cat([v, v.new_zeros(n, h, 1, d)], dim=2)
        masks = _pad_key(masks)

    if q.numel() == 0 or k.shape[2] == 0:
        # N, L or the number of keys is 0: the weights are empty and every output row is a sum over no keys (0);
        # plain matmuls say exactly that (and keep the inputs in the graph), where the kernels need keys
        weights = q @ k.transpose(-2, -1)  # (N, h, L, S'): no elements
        out = weights @ v  # (N, h, L, d): zeros, or empty
        weights = weights if need_weights else None
    else:
        result = attention_result(
            q, k, v, mask=_combine(masks), dropout=dropout, training=training, return_weights=need_weights
        )
        out, weights = result.output, result.weights  # weights None unless need_weights
    out = out.permute(2, 0, 1, 3).reshape(L, n, E)  # (L, N, E): heads concatenated
    out = F.linear(out, params.out_w, params.out_b)
    if call.batched and batch_first:
        out = out.transpose(0, 1)  # (N, L, E)
    if weights is not None and average_attn_weights:
        weights = weights.mean(dim=1)  # (N, L, S')
    if not call.batched:
        out = out.squeeze(1)  # (L, E)
        weights = None if weights is None else weights.squeeze(0)  # (L, S') or (h, L, S')
    return out, weights


def _lengths(t: torch.Tensor) -> torch.Tensor:
    """Per-sequence lengths (N,) of a nested tensor (N, *, features), jagged or strided."""
    if t.layout == torch.strided:
        return torch.tensor([x.shape[0] for x in t.unbind()], dtype=torch.long, device=t.device)
    # a jagged nested tensor (torch's NestedTensor subclass) has lengths() and offsets(); the Tensor stubs lack them
    lengths = t.lengths()  # type: ignore[attr-defined]
    return t.offsets().diff() if lengths is None else lengths  # type: ignore[attr-defined]


def _nested_like(layout: torch.layout, padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(N, L_max, E) back to a nested (N, *, E) of ``layout``, row n keeping its first lengths[n] positions."""
    if layout == torch.strided:
        return torch.nested.as_nested_tensor(
            [padded[n, :length] for n, length in enumerate(lengths.tolist())], layout=torch.strided
        )
    real = torch.arange(padded.shape[1], device=lengths.device) < lengths[:, None]  # (N, L_max)
    return torch.nested.nested_tensor_from_jagged(padded[real], F.pad(lengths.cumsum(0), (1, 0)))


def _keep_torch_fast_paths_away(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook that changes nothing: torch.nn.TransformerEncoderLayer takes its fused fast path
    (torch's own kernel, with this module's weights, never calling its forward) only when no submodule has
    hooks, so its presence keeps the drop-in's forward, and multihead's kernels, in charge."""
    return None


# --------------------------------------------------------------------------- the module


class MultiheadAttention(nn.Module):
    """torch.nn.MultiheadAttention's interface on multihead's kernels (see the module docstring).

    Shapes (torch's): query (L, N, E), key (S, N, kdim), value (S, N, vdim), or (N, L, E) ... with
    ``batch_first=True``, or unbatched (L, E) ...; key_padding_mask (N, S); attn_mask (L, S) or
    (N * num_heads, L, S). Returns (attn_output, attn_weights): (L, N, E) and (N, L, S), or
    (N, num_heads, L, S) with ``average_attn_weights=False``, or None with ``need_weights=False``.
    With ``batch_first=True``, query, key and value may be nested tensors (N, *, features), jagged or
    strided: the output is nested like the query, the weights come back padded (N, L_max, S_max).

    Example:
        >>> import multihead.compat as compat
        >>> mha = compat.MultiheadAttention(16, 4)
        >>> mha.load_state_dict(torch.nn.MultiheadAttention(16, 4).state_dict())
        <All keys matched successfully>
        >>> out, weights = mha(torch.randn(5, 2, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16))
        >>> out.shape, weights.shape
        (torch.Size([5, 2, 16]), torch.Size([2, 5, 7]))
    """

    bias_k: nn.Parameter | None  # (1, 1, E) with add_bias_kv, else None (as torch's module)
    bias_v: nn.Parameter | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        embed_dim, num_heads = positive_int("embed_dim", embed_dim), positive_int("num_heads", num_heads)
        kdim = embed_dim if kdim is None else positive_int("kdim", kdim)
        vdim = embed_dim if vdim is None else positive_int("vdim", vdim)
        if embed_dim % num_heads != 0:
            raise _error(
                ShapeError,
                "num_heads",
                f"a divisor of embed_dim = {embed_dim}",
                num_heads,
                "pick num_heads that divides embed_dim",
                "embed_dim must be divisible by num_heads",
            )
        dropout = checked_probability("dropout", dropout)
        for name, flag in (
            ("bias", bias),
            ("add_bias_kv", add_bias_kv),
            ("add_zero_attn", add_zero_attn),
            ("batch_first", batch_first),
        ):
            checked_flag(name, flag)
        device, dtype = usable_device("device", device), floating_dtype("dtype", dtype)
        largest = max((embed_dim, "embed_dim"), (kdim, "kdim"), (vdim, "vdim"), key=lambda pair: pair[0])[1]
        check_fits(
            largest,
            (embed_dim, 2 * embed_dim + kdim + vdim),
            dtype or torch.get_default_dtype(),
            device,
            f"pass a smaller {largest}",
            what="the projection weights",
        )
        self.embed_dim = embed_dim
        self.kdim, self.vdim = kdim, vdim
        self._qkv_same_embed_dim = kdim == embed_dim and vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, device=device, dtype=dtype))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, device=device, dtype=dtype))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, kdim, device=device, dtype=dtype))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, vdim, device=device, dtype=dtype))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, device=device, dtype=dtype))
        else:
            self.register_parameter("in_proj_bias", None)
        # torch's class for out_proj: dynamic quantization leaves it alone, as it does torch's module's
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, device=device, dtype=dtype))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, device=device, dtype=dtype))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()
        self.register_forward_pre_hook(_keep_torch_fast_paths_away)

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform in-projection(s), zero biases, Xavier-normal bias_k/bias_v."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for weight in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        for extra in (self.bias_k, self.bias_v):  # both set (add_bias_kv) or both None
            if extra is not None:
                nn.init.xavier_normal_(extra)

    def __prepare_scriptable__(self):
        """Called by ``torch.jit.script`` (also on submodules): refuse with the reason and the alternatives."""
        raise bad_argument(
            "torch.jit.script",
            "a module TorchScript can compile",
            "multihead.compat.MultiheadAttention, whose forward runs multihead's Python kernels (typed masks, "
            "backend dispatch) that TorchScript cannot compile",
            "use torch.compile(module) or torch.export.export(module, args) instead; or, for TorchScript, load this "
            "module's state_dict into torch.nn.MultiheadAttention (which returns NaN where every key of a row is "
            "masked)",
            kind=NotScriptableError,
        )

    def projection_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W^Q (E, E), W^K (E, kdim), W^V (E, vdim), whichever layout stores them."""
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)  # (3E, E) -> 3 x (E, E)
            return w_q, w_k, w_v
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def projection_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """b^Q, b^K, b^V (E,) each, or Nones."""
        if self.in_proj_bias is None:
            return None, None, None
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)  # (3E,) -> 3 x (E,)
        return b_q, b_k, b_v

    def _params(self) -> _Params:
        names: tuple[str, ...] = (
            ("in_proj_weight",) if self._qkv_same_embed_dim else ("q_proj_weight", "k_proj_weight", "v_proj_weight")
        )
        names += ("in_proj_bias", "bias_k", "bias_v")
        named = [(name, getattr(self, name)) for name in names if getattr(self, name) is not None]
        named += [
            (f"out_proj.{name}", p)
            for name, p in (("weight", self.out_proj.weight), ("bias", self.out_proj.bias))
            if p is not None
        ]
        return _Params(
            *self.projection_weights(),
            *self.projection_biases(),
            self.bias_k,
            self.bias_v,
            self.out_proj.weight,
            self.out_proj.bias,
            named,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """torch.nn.MultiheadAttention.forward, same arguments and results (see the class docstring)."""
        options = _Options(
            num_heads=self.num_heads,
            add_zero_attn=self.add_zero_attn,
            dropout=self.dropout,
            training=self.training,
            batch_first=self.batch_first,
            need_weights=need_weights,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
        )
        if all(isinstance(t, torch.Tensor) for t in (query, key, value)) and query.is_nested and query.dim() == 3:
            return self._nested_forward(query, key, value, key_padding_mask, attn_mask, options)
        return _attend(
            query, key, value, self._params(), key_padding_mask=key_padding_mask, attn_mask=attn_mask, **options
        )

    def _nested_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        options: _Options,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Nested (N, *, features) inputs, jagged or strided: padded to dense with the keys past each length
        masked, then the output nested again like the query."""
        _check_arguments(
            query,
            key,
            value,
            key_padding_mask,
            attn_mask,
            options["need_weights"],
            options["average_attn_weights"],
            options["is_causal"],
        )
        for name, t in (("query", query), ("key", key), ("value", value)):
            ragged_on_seq = t.layout == torch.strided or getattr(t, "_ragged_idx", None) == 1
            if not (t.is_nested and t.layout == query.layout and ragged_on_seq):
                raise _error(
                    CompatValueError,
                    name,
                    f"a nested tensor (N, *, features) of the query's layout ({query.layout})",
                    _text(t),
                    "build all three with torch.nested.nested_tensor(list, layout=torch.jagged)",
                )
            if t.size(0) != query.size(0):
                raise _error(
                    ShapeError,
                    name,
                    f"N = {query.size(0)} sequences (from query)",
                    t.size(0),
                    "give query, key and value the same number of sequences",
                )
        if not self.batch_first:
            raise _error(
                CompatValueError,
                "query",
                "batch_first=True for nested tensors (N, *, E)",
                _text(query),
                "build the module with batch_first=True",
            )
        for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if m is not None:
                raise _error(
                    CompatValueError,
                    name,
                    "None with nested inputs (their lengths say which keys exist)",
                    _text(m),
                    f"drop {name}, or pad the inputs to dense tensors and pass {name}",
                )
        key_len, value_len = _lengths(key), _lengths(value)
        if not torch.equal(key_len, value_len):
            raise _error(
                ShapeError,
                "value",
                f"the key's length in every sequence ({key_len.tolist()})",
                value_len.tolist(),
                "give key and value the same lengths",
            )
        query_len = _lengths(query)
        # (N, L_max, E), (N, S_max, kdim), (N, S_max, vdim)
        padded_q, padded_k, padded_v = (t.to_padded_tensor(0.0) for t in (query, key, value))
        padding = torch.arange(padded_k.shape[1], device=key_len.device) >= key_len[:, None]  # (N, S_max)
        out, weights = _attend(
            padded_q, padded_k, padded_v, self._params(), key_padding_mask=padding, attn_mask=None, **options
        )
        if weights is not None:  # padded (N, L_max, S') or (N, h, L_max, S'); 0 on queries past each length
            real = torch.arange(out.shape[1], device=query_len.device) < query_len[:, None]  # (N, L_max)
            weights = weights.masked_fill(~(real[:, :, None] if weights.dim() == 3 else real[:, None, :, None]), 0.0)
        return _nested_like(query.layout, out, query_len), weights


def _weight_argument(name: str, t: object, rows: int, cols: int | None, embed_dim: int) -> torch.Tensor:
    """A (rows, cols) tensor (any cols when None) of an embed_dim-wide module."""
    if not isinstance(t, torch.Tensor):
        raise bad_argument(
            name,
            f"a tensor ({rows}, {'in_features' if cols is None else cols})",
            describe(t),
            f"pass {name}"
            + (
                " (use_separate_proj_weight=True needs q/k/v_proj_weight)"
                if name.endswith("_proj_weight") and name != "out_proj_weight"
                else ""
            ),
            kind=TypeError,
        )
    if t.dim() != 2 or t.shape[0] != rows or (cols is not None and t.shape[1] != cols):
        raise _error(
            ShapeError,
            name,
            f"shape ({rows}, {'in_features' if cols is None else cols})",
            _shape(t),
            f"pass the {name} of an embed_dim = {embed_dim} module",
        )
    return t


def _vector_argument(name: str, t: object, shape: tuple[int, ...], embed_dim: int) -> torch.Tensor | None:
    """None, or a tensor of exactly ``shape`` (a bias of an embed_dim-wide module)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise bad_argument(name, f"None or a tensor {shape}", describe(t), f"pass {name}", kind=TypeError)
    if tuple(t.shape) != shape:
        raise _error(
            ShapeError, name, f"shape {shape}", _shape(t), f"pass the {name} of an embed_dim = {embed_dim} module"
        )
    return t


def _functional_params(
    embed_dim: int,
    use_separate_proj_weight: bool,
    in_proj_weight,
    q_proj_weight,
    k_proj_weight,
    v_proj_weight,
    in_proj_bias,
    bias_k,
    bias_v,
    out_proj_weight,
    out_proj_bias,
) -> _Params:
    """The weights given to :func:`multi_head_attention_forward`, checked in torch's argument order, as _Params.

    in_proj_weight (3E, E), or q_proj_weight (E, E), k_proj_weight (E, kdim), v_proj_weight (E, vdim);
    in_proj_bias (3E,); bias_k, bias_v (1, 1, E); out_proj_weight (E, E), out_proj_bias (E,).
    """
    if use_separate_proj_weight:
        w_q = _weight_argument("q_proj_weight", q_proj_weight, embed_dim, embed_dim, embed_dim)
        w_k = _weight_argument("k_proj_weight", k_proj_weight, embed_dim, None, embed_dim)
        w_v = _weight_argument("v_proj_weight", v_proj_weight, embed_dim, None, embed_dim)
        named = [("q_proj_weight", w_q), ("k_proj_weight", w_k), ("v_proj_weight", w_v)]
    else:
        packed = _weight_argument("in_proj_weight", in_proj_weight, 3 * embed_dim, embed_dim, embed_dim)
        w_q, w_k, w_v = packed.chunk(3)
        named = [("in_proj_weight", packed)]
    in_bias = _vector_argument("in_proj_bias", in_proj_bias, (3 * embed_dim,), embed_dim)
    if (bias_k is None) != (bias_v is None):
        name = "bias_v" if bias_v is None else "bias_k"
        raise _error(
            CompatValueError,
            name,
            "a tensor (1, 1, E) like the other of bias_k / bias_v",
            None,
            "pass both bias_k and bias_v, or neither",
            f"{'bias_k' if name == 'bias_v' else 'bias_v'} is set but {name} is None",
        )
    extra_k = _vector_argument("bias_k", bias_k, (1, 1, embed_dim), embed_dim)
    extra_v = _vector_argument("bias_v", bias_v, (1, 1, embed_dim), embed_dim)
    out_w = _weight_argument("out_proj_weight", out_proj_weight, embed_dim, embed_dim, embed_dim)
    out_b = _vector_argument("out_proj_bias", out_proj_bias, (embed_dim,), embed_dim)
    named += [
        (name, t)
        for name, t in (
            ("in_proj_bias", in_bias),
            ("bias_k", extra_k),
            ("bias_v", extra_v),
            ("out_proj_weight", out_w),
            ("out_proj_bias", out_b),
        )
        if t is not None
    ]
    b_q, b_k, b_v = (None, None, None) if in_bias is None else in_bias.chunk(3)
    return _Params(w_q, w_k, w_v, b_q, b_k, b_v, extra_k, extra_v, out_w, out_b, named)


def multi_head_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: torch.Tensor | None,
    in_proj_bias: torch.Tensor | None,
    bias_k: torch.Tensor | None,
    bias_v: torch.Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
    training: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: torch.Tensor | None = None,
    k_proj_weight: torch.Tensor | None = None,
    v_proj_weight: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
    static_v: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``torch.nn.functional.multi_head_attention_forward`` on multihead's kernels: same arguments, same results.

    Sequence-first: query (L, N, E), key (S, N, kdim), value (S, N, vdim), or unbatched (L, E), (S, kdim),
    (S, vdim). Weights: in_proj_weight (3E, E), or with ``use_separate_proj_weight`` q_proj_weight (E, E),
    k_proj_weight (E, kdim), v_proj_weight (E, vdim); in_proj_bias (3E,); bias_k, bias_v (1, 1, E);
    out_proj_weight (E, E), out_proj_bias (E,). ``static_k`` / ``static_v`` (N * num_heads, S, E / num_heads)
    replace the projected keys / values. Returns (attn_output (L, N, E), attn_weights (N, L, S) or
    (N, num_heads, L, S) or None), as the module does.
    """
    embed_dim = positive_int("embed_dim_to_check", embed_dim_to_check)
    num_heads = positive_int("num_heads", num_heads)
    if embed_dim % num_heads != 0:
        raise _error(
            ShapeError,
            "num_heads",
            f"a divisor of embed_dim_to_check = {embed_dim}",
            num_heads,
            "pick num_heads that divides the embedding size",
            f"embed_dim {embed_dim} not divisible by num_heads {num_heads}",
        )
    checked_flag("use_separate_proj_weight", use_separate_proj_weight)
    checked_flag("add_zero_attn", add_zero_attn)
    params = _functional_params(
        embed_dim,
        use_separate_proj_weight,
        in_proj_weight,
        q_proj_weight,
        k_proj_weight,
        v_proj_weight,
        in_proj_bias,
        bias_k,
        bias_v,
        out_proj_weight,
        out_proj_bias,
    )
    return _attend(
        query,
        key,
        value,
        params,
        num_heads=num_heads,
        add_zero_attn=add_zero_attn,
        dropout=dropout_p,
        training=training,
        batch_first=False,
        key_padding_mask=key_padding_mask,
        need_weights=need_weights,
        attn_mask=attn_mask,
        average_attn_weights=average_attn_weights,
        is_causal=is_causal,
        static_k=static_k,
        static_v=static_v,
        dropout_name="dropout_p",
    )


# --------------------------------------------------------------------------- converters


def from_torch(module: nn.Module) -> MultiHeadAttention:
    """A :class:`multihead.MultiHeadAttention` (batch first) with the weights of a torch-layout module
    (``torch.nn.MultiheadAttention`` or this module's :class:`MultiheadAttention`); see the layer's ``from_torch``."""
    return MultiHeadAttention.from_torch(module)


def to_torch(layer: MultiHeadAttention) -> nn.MultiheadAttention:
    """A ``torch.nn.MultiheadAttention(batch_first=True)`` with a layer's weights; see the layer's ``to_torch``."""
    if not isinstance(layer, MultiHeadAttention):
        raise bad_argument(
            "layer",
            "a multihead.MultiHeadAttention",
            describe(layer),
            "pass the layer to convert (a compat.MultiheadAttention already has torch's "
            "state_dict: load it into torch.nn.MultiheadAttention)",
            kind=TypeError,
        )
    return layer.to_torch()


def replace(model: nn.Module) -> dict[str, nn.MultiheadAttention]:
    """Swap every ``torch.nn.MultiheadAttention`` inside ``model`` for :class:`MultiheadAttention`, in place.

    Each drop-in takes the torch module's options (embed_dim, num_heads, dropout, bias, add_bias_kv,
    add_zero_attn, kdim, vdim, batch_first), its training mode, and its very parameters (the same
    ``nn.Parameter`` objects and ``out_proj``, so an optimizer built before keeps working and nothing is
    copied). A module registered under several names is replaced by one drop-in everywhere. Hooks
    registered on a torch module stay with it and do not move to the drop-in.

    Returns {qualified name: the torch module replaced}, in the order of ``model.named_modules()``; put one
    back with ``model.get_submodule(parent).<attr> = module``. Everything is checked before anything is
    swapped: a call that raises leaves ``model`` as it was.

        >>> from multihead import compat
        >>> layer = torch.nn.TransformerEncoderLayer(16, 4, batch_first=True)
        >>> encoder = torch.nn.TransformerEncoder(layer, num_layers=2)
        >>> list(compat.replace(encoder))
        ['layers.0.self_attn', 'layers.1.self_attn']
    """
    if not isinstance(model, nn.Module):
        raise bad_argument("model", "a torch.nn.Module", describe(model), "pass the model to convert", kind=TypeError)
    if isinstance(model, torch.jit.ScriptModule):
        raise NotScriptableError(
            "model: expected an eager torch.nn.Module, got a TorchScript module. Fix: replace the attention in the "
            "eager model (before torch.jit.script), or keep the scripted model on torch's attention"
        )
    if isinstance(model, nn.MultiheadAttention):
        raise bad_argument(
            "model",
            "a model that holds torch.nn.MultiheadAttention modules",
            "a torch.nn.MultiheadAttention itself (a module cannot replace itself in place)",
            "build multihead.compat.MultiheadAttention with the same options and load_state_dict(module.state_dict())",
        )
    found: list[tuple[str, nn.MultiheadAttention]] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if type(module) is nn.MultiheadAttention:
            found.append((name, module))
        elif isinstance(module, nn.MultiheadAttention):
            raise bad_argument(
                "model",
                "torch.nn.MultiheadAttention modules (not subclasses, whose forward or weights may differ)",
                f"{name}: a {type(module).__module__}.{type(module).__qualname__}",
                "convert that class yourself, or replace the plain torch.nn.MultiheadAttention modules one by one",
            )
    drop_ins: dict[int, MultiheadAttention] = {}
    for _, module in found:  # build every drop-in before swapping any
        if id(module) not in drop_ins:
            drop_ins[id(module)] = _drop_in_for(module)
    for name, module in found:
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attribute, drop_ins[id(module)])
    return dict(found)


def _drop_in_for(module: nn.MultiheadAttention) -> MultiheadAttention:
    """A drop-in with ``module``'s options, training mode and parameters (shared, not copied)."""
    weight = module.out_proj.weight
    with torch.device("meta"):  # its own parameters are replaced at once: allocate nothing for them
        drop_in = MultiheadAttention(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn,
            kdim=module.kdim,
            vdim=module.vdim,
            batch_first=module.batch_first,
            dtype=weight.dtype,
        )
    for name in list(drop_in._parameters):
        setattr(drop_in, name, getattr(module, name))
    drop_in.out_proj = module.out_proj
    return drop_in.train(module.training)
