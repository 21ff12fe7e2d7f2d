"""transformers' attention masks as multihead's typed masks, not (b, 1, i, j) tensors.

transformers builds a model's mask through its ``AttentionMaskInterface``: a mask function evaluated at every
(query, key) pair of absolute positions ``(q_idx + q_offset, kv_idx + kv_offset)`` (causal, sliding window,
bidirectional, ...), and-ed with a 2-D padding mask. :func:`typed_mask`, registered there under "multihead" by
:mod:`multihead.integrations.transformers`, takes the same arguments as transformers' ``sdpa_mask`` and returns
the same mask as a typed :class:`multihead.masks.Mask` where it recognises the pattern with certainty:

    causal_mask_function                               causal(align)
    sliding_window_causal_mask_function(w)             window(w - 1, 0, align)
      (= and_masks(sliding_window_overlay(w), causal_mask_function), in any and_masks nesting)
    bidirectional_mask_function                        no term (full attention)
    sliding_window_bidirectional_mask_function(w)      window(w, w, align)
    the 2-D padding attention_mask                     & padding(valid): its columns kv_offset ... kv_offset + j - 1
    packed sequences: and_masks(remap_positions_for_packed_sequence(f, position_ids),
                                packed_sequence_mask_function(ids))    documents(ids) & f's band (f as above)

``align`` follows the offsets: relative position ``d = q_offset - kv_offset`` of the first query is
``j - i`` ("bottom_right", a KV cache) or 0 ("top_left", e.g. a static cache's prefill); no other d can be said
with a typed diagonal. The kernel then never builds an i x j mask, and blocked kernels skip empty blocks.

Packed sequences (position ids that restart, no attention mask) come as a band read at each token's position in
its document, and-ed with "same document": within a document, positions run on by one, so the band over positions
is the band over indices, and the pair is ``documents(ids)`` with the band. transformers turns the causal skip off
for them; so does a model that edits the tensor it asks for (Falcon adds ALiBi to it), which the arguments do not
tell apart: packed calls of those models (:data:`EDITS_THE_MASK`, by the config's ``model_type``), or with no
config, stay dense. On the host the documents are checked against the position ids (boundaries where a position
does not follow the last); ids on a device are taken as transformers builds them, from those position ids.

Everything else goes to transformers' ``sdpa_mask`` with the same arguments, giving the dense bool tensor we
used before, so the result is never wrong: ``or_masks``, chunked or blockwise attention,
custom mask functions (``use_vmap=True``), a padding mask that is not a 2-D bool tensor of the batch's rows,
offsets that are tensors (static caches under compile), other offset relations — and every call whose caller
allows no skip (``allow_is_causal_skip`` and ``allow_is_bidirectional_skip`` both False): such a model goes on
to edit the tensor (adds ALiBi, concatenates masks, slices it back to 2-D), so it gets one.

:func:`kernel_mask` turns what an attention call receives (None, such a typed mask, or a tensor that may cover
more keys than the call has) into what :func:`multihead.attention` takes as ``mask``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch

from multihead._errors import bad_argument, describe
from multihead.integrations.transformers_internals import (  # transformers' internals: imported there, checked
    AND_MASKS,
    PACKED,
    SLIDING_WINDOW,
    SLIDING_WINDOW_BIDIRECTIONAL,
    bidirectional_mask_function,
    causal_mask_function,
    eager_mask,
    sdpa_mask,
)
from multihead.masks import AttentionShape, Mask, causal, cut_parts, documents, host_readable, padding, window

__all__ = ["TransformersMask", "typed_mask", "kernel_mask", "EDITS_THE_MASK", "NEEDS_EAGER_MASK"]

# Models whose code asks create_causal_mask for a tensor (allow_is_causal_skip=False) and edits it (transformers
# 5.24): their packed calls look like any model's, so they stay dense
EDITS_THE_MASK = ("falcon", "doge", "dots3_note", "diffusion_gemma", "mistral_large4")
# Models with no sdpa path that work on the mask tensor themselves, in eager's additive form (transformers 5.24):
# DeepSeek-V4's compressed layers append their compressed keys' 0/-inf block bias to it, cast to the mask's dtype;
# GIT's text layers add it to their own scores (only its vision tower calls the attention function). They always
# get eager's float mask: a typed mask would reach the kernel with fewer keys than the call has, or fail to add,
# and a bool one would turn the appended bias around (0 -> False, masked) or add 1 to every kept score.
NEEDS_EAGER_MASK = ("deepseek_v4", "git")

# The band of relative positions r = (kv_idx + kv_offset) - (q_idx + q_offset) a mask function allows:
# -left <= r <= right, None = unbounded on that side
Band = tuple[int | None, int | None]


class TransformersMask(Mask):
    """A typed mask built for one call of transformers' mask interface: its terms, and the sizes it was built for.

    ``kv_length`` is kept because a bottom-right diagonal depends on the number of keys: a call with fewer keys
    must see the first columns of this mask (as a sliced dense mask would), not the mask re-aligned to them.
    """

    def __init__(self, parts: Sequence[Mask], *, batch: int, q_length: int, kv_length: int, device: torch.device):
        self.parts = tuple(parts)
        self.batch, self.q_length, self.kv_length, self.device = batch, q_length, kv_length, device
        # the query rows with every key masked, (b, 1, i) bool or None, per way the attention calls use this mask:
        # counted by the first call (multihead.integrations.transformers_rows), which every layer's call then reads
        self.empty_rows: dict[tuple, torch.Tensor | None] = {}

    def terms(self) -> tuple[Mask, ...]:
        return tuple(term for part in self.parts for term in part.terms())

    def _for_heads(self, start: int, count: int, total: int) -> Mask:
        # its parts (diagonals, padding, documents) hold nothing per head today, so this is the mask itself; a part
        # that ever does is cut like any mask's, the sizes kept (the row counts are kept for the uncut mask only)
        parts = cut_parts(self.parts, start, count, total)
        if parts is None:
            return self
        return TransformersMask(
            parts, batch=self.batch, q_length=self.q_length, kv_length=self.kv_length, device=self.device
        )

    # transformers' generate builds a compileable cache's mask once and hands it back to the model as its
    # attention_mask, whose mask code asks a prepared mask for its rank: this one reads as the (b, 1, i, j) mask
    # it stands for, and typed_mask passes it through as transformers passes a prepared 4-D mask through
    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(b, 1, i, j): the shape of the dense mask this stands for."""
        return (self.batch, 1, self.q_length, self.kv_length)

    @property
    def ndim(self) -> int:
        """4, the rank of the dense mask this stands for."""
        return 4

    def dense(self) -> torch.Tensor:
        """The mask as transformers' ``sdpa_mask`` would have built it: bool (b, 1, i, j), True = may attend."""
        shape = AttentionShape(self.batch, 1, self.q_length, self.kv_length, self.device)
        keep, _ = self.bind(shape).dense(torch.float32)  # boolean terms only: no bias
        full = (self.batch, 1, self.q_length, self.kv_length)
        if keep is None:
            return torch.ones(full, dtype=torch.bool, device=self.device)
        return keep.expand(full)

    def __getitem__(self, index: Any) -> torch.Tensor:
        """The dense mask (b, 1, i, j) indexed as a model indexes the tensor it stands for (Gemma 4's KV-shared layers
        keep the last query rows, ``mask[:, :, -n:, :]``; DeepSeek-V3.2's indexer reads ``mask[:, 0]``): exact, as a
        bool tensor (True = may attend) that the attention takes as any dense mask."""
        return self.dense()[index]

    def __repr__(self) -> str:
        terms = " & ".join(repr(term) for term in self.parts) or "no terms (full attention)"
        return f"TransformersMask({terms}; i={self.q_length}, j={self.kv_length})"


def _cells(fn: Callable) -> dict[str, Any] | None:
    """A closure's free variables by name, or None when they cannot be read."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    names = getattr(code, "co_freevars", ())
    if closure is None or len(closure) != len(names):
        return None
    try:
        return {name: cell.cell_contents for name, cell in zip(names, closure, strict=True)}
    except ValueError:  # an empty cell
        return None


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _band(fn: object, depth: int = 0) -> Band | None:
    """The band a transformers mask function allows, or None when it is not one we recognise with certainty."""
    if fn is causal_mask_function:
        return None, 0
    if fn is bidirectional_mask_function:  # q_idx >= 0: every pair, for offsets >= 0 (checked by the caller)
        return None, None
    if not callable(fn) or depth > 8:
        return None
    cells = _cells(fn)  # a closure made by one of the factories below holds the factory's arguments
    if cells is None:
        return None
    if AND_MASKS.built(fn):
        parts = cells.get(AND_MASKS.variable)
        if not isinstance(parts, tuple):
            return None
        left: int | None = None
        right: int | None = None
        for part in parts:  # the intersection of bands is a band: the tighter bound on each side
            band = _band(part, depth + 1)
            if band is None:
                return None
            if band[0] is not None:
                left = band[0] if left is None else min(left, band[0])
            if band[1] is not None:
                right = band[1] if right is None else min(right, band[1])
        return left, right
    if SLIDING_WINDOW.built(fn):
        size = cells.get(SLIDING_WINDOW.variable)  # kv_idx > q_idx - size: r >= -(size - 1)
        return (size - 1, None) if _whole(size) and size >= 1 else None
    if SLIDING_WINDOW_BIDIRECTIONAL.built(fn):
        size = cells.get(SLIDING_WINDOW_BIDIRECTIONAL.variable)  # |q_idx - kv_idx| <= size
        return (size, size) if _whole(size) and size >= 0 else None
    return None


def _packed(fn: object) -> tuple[Band, torch.Tensor, torch.Tensor] | None:
    """(band, ids, position_ids) of transformers' packed-sequence mask function, or None when ``fn`` is not one
    whose parts are all recognised (see the module docstring)."""
    if PACKED is None or not AND_MASKS.built(fn):
        return None
    parts = (_cells(fn) or {}).get(AND_MASKS.variable) if callable(fn) else None
    if not isinstance(parts, tuple):
        return None
    same_document, remapped = PACKED
    ids = positions = band = None
    for part in parts:
        cells = _cells(part) or {}
        if same_document.built(part):
            ids = cells.get(same_document.variable)
        elif remapped.built(part):
            positions, band = cells.get(remapped.variable), _band(cells.get("mask_function"))
        else:
            return None
    if not (isinstance(ids, torch.Tensor) and isinstance(positions, torch.Tensor) and band is not None):
        return None
    return band, ids, positions


def _follows_positions(ids: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether ``ids`` change exactly where ``positions`` do not run on by one (checked on the host; a device
    tensor is not read, and transformers builds the ids from the positions)."""
    if not (host_readable(ids) and host_readable(positions)) or torch.compiler.is_compiling():
        return True
    try:
        starts = torch.diff(positions, dim=-1) != 1
        changes = torch.diff(ids, dim=-1) != 0
        return bool((starts == changes).all())
    except RuntimeError:  # shapes that do not broadcast: not the pair transformers builds
        return False


def _packed_documents(
    packed: tuple[Band, torch.Tensor, torch.Tensor],
    config: object,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    device: torch.device | str,
) -> Mask | None:
    """``documents(ids)`` (ids broadcast to (b, j)) for a packed-sequence call, or None when it must stay dense:
    no config or a model that edits the mask, offsets, i != j, or ids (1 or b, j) that do not follow the
    position ids (see the module docstring)."""
    _, ids, positions = packed
    if (
        config is None
        or getattr(config, "model_type", None) in EDITS_THE_MASK
        or (q_offset, kv_offset) != (0, 0)
        or q_length != kv_length
        or ids.ndim != 2
        or ids.shape[1] != kv_length
        or ids.shape[0] not in (1, batch_size)
        or not _follows_positions(ids, positions)
    ):
        return None
    return documents(ids.expand(batch_size, kv_length).to(device))


def _band_terms(band: Band, q_length: int, kv_length: int, q_offset: int, kv_offset: int) -> list[Mask] | None:
    """The band as a typed diagonal ([] for full attention), or None when no typed diagonal says it: an offset
    relation other than bottom-right or top-left alignment, or an empty band."""
    if band == (None, None):
        return []
    # aligned query position p = q_idx + d: the band keeps keys p - left ... p + right
    distance = q_offset - kv_offset
    if distance == kv_length - q_length:
        align = "bottom_right"
    elif distance == 0:
        align = "top_left"
    else:
        return None
    left, right = band
    if (left is not None and left < 0) or (right is not None and right < 0):
        return None  # an empty band: rare enough to leave to the dense path
    return [causal(align) if band == (None, 0) else window(left, right, align=align)]


def _padding_terms(
    attention_mask: object, batch_size: int, kv_length: int, kv_offset: int, device: torch.device | str
) -> list[Mask] | None:
    """The 2-D (b, n) bool padding mask as ``padding(valid)`` over the call's j keys ([] when there is none or
    every key is real), or None when it is not such a mask and must go to the dense path."""
    if attention_mask is None:
        return []
    if (
        not isinstance(attention_mask, torch.Tensor)
        or attention_mask.ndim != 2
        or attention_mask.dtype != torch.bool
        or attention_mask.shape[0] != batch_size
    ):
        return None
    # the columns sdpa_mask reads: padded with False up to kv_offset + j, then from kv_offset on
    short = kv_offset + kv_length - attention_mask.shape[1]
    padded = torch.nn.functional.pad(attention_mask, (0, short)) if short > 0 else attention_mask
    valid = padded[:, kv_offset : kv_offset + kv_length].to(device)  # (b, j)
    readable = valid.device.type != "meta" and not torch.compiler.is_compiling()
    if readable and bool(valid.all()):  # one sync per mask built, as sdpa_mask's own skip check
        return []
    return [padding(valid)]


def typed_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **kwargs,
) -> Mask | torch.Tensor | None:
    """transformers' ``sdpa_mask`` signature; the mask as a :class:`TransformersMask` where it can say it exactly.

    Sizes: batch b = ``batch_size``, queries i = ``q_length``, keys j = ``kv_length``; ``attention_mask`` the 2-D
    (b, n) bool padding mask of every position so far, True = real token (shorter than kv_offset + j: padded
    with False, as ``sdpa_mask`` does), or a :class:`TransformersMask` already prepared for the step (generate
    builds one for a static cache), returned as it is. Returns a :class:`TransformersMask` (typed terms, bound
    to the call's sizes by the kernel); None for full attention without padding when
    ``allow_is_bidirectional_skip`` (what ``sdpa_mask`` returns there); otherwise, for what is not recognised,
    ``sdpa_mask``'s own result with the same arguments: a (b, 1, i, j) bool tensor or None (see the module
    docstring for what goes which way); for the models of :data:`NEEDS_EAGER_MASK`, ``eager_mask``'s (b, 1, i, j)
    additive float mask.
    """

    # what sdpa_mask and eager_mask both take
    common: dict[str, Any] = {
        "batch_size": batch_size,
        "q_length": q_length,
        "kv_length": kv_length,
        "q_offset": q_offset,
        "kv_offset": kv_offset,
        "mask_function": mask_function,
        "attention_mask": attention_mask,
        "allow_is_bidirectional_skip": allow_is_bidirectional_skip,
        "use_vmap": use_vmap,
        "device": device,
        **kwargs,
    }

    def dense() -> torch.Tensor | None:
        return sdpa_mask(local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **common)

    if isinstance(attention_mask, TransformersMask):
        return attention_mask  # already prepared (by generate, for a static cache): as transformers returns a 4-D one
    if getattr(kwargs.get("config"), "model_type", None) in NEEDS_EAGER_MASK:
        return eager_mask(**common)
    sizes = (batch_size, q_length, kv_length, q_offset, kv_offset)
    if not all(_whole(size) for size in sizes) or q_offset < 0 or kv_offset < 0:
        return dense()  # tensor or symbolic offsets (static caches, tracing), or positions before the first
    parts: list[Mask] = []
    packed = _packed(mask_function)
    if packed is not None:  # transformers turns the skip off for packed sequences: see the module docstring
        same_document = _packed_documents(
            packed, kwargs.get("config"), batch_size, q_length, kv_length, q_offset, kv_offset, device
        )
        if same_document is None:
            return dense()
        band = packed[0]
        parts.append(same_document)
    elif not (allow_is_causal_skip or allow_is_bidirectional_skip):
        return dense()  # the caller wants a tensor to work on
    else:
        recognised = _band(mask_function)
        if recognised is None:
            return dense()
        band = recognised
    band_terms = _band_terms(band, q_length, kv_length, q_offset, kv_offset)
    if band_terms is None:
        return dense()
    parts += band_terms
    padding_terms = _padding_terms(attention_mask, batch_size, kv_length, kv_offset, device)
    if padding_terms is None:
        return dense()
    parts += padding_terms
    if not parts and allow_is_bidirectional_skip:
        return None
    return TransformersMask(
        parts, batch=batch_size, q_length=q_length, kv_length=kv_length, device=torch.device(device)
    )


def kernel_mask(attention_mask: Mask | torch.Tensor | None, key_length: int) -> Mask | torch.Tensor | None:
    """What an attention call received as ``attention_mask`` as :func:`multihead.attention`'s ``mask``.

    attention_mask: None; a typed mask (a :class:`TransformersMask` built for ``kv_length`` keys, or any other
    :class:`multihead.masks.Mask`); or a bool (True = may attend) or additive float tensor (b, 1 or h, i, >= j).
    key_length: j, the number of keys of the call. A tensor keeps its first j columns; a TransformersMask built
    for exactly j keys goes as it is, one built for another number of keys as its dense tensor's first j columns
    (a bottom-right diagonal depends on the key count, so re-binding it would move it).
    """
    if attention_mask is None:
        return None
    if isinstance(attention_mask, TransformersMask):
        if attention_mask.kv_length == key_length:
            return attention_mask
        return attention_mask.dense()[..., :key_length]
    if isinstance(attention_mask, Mask):
        return attention_mask
    if isinstance(attention_mask, torch.Tensor):
        return attention_mask[..., :key_length]
    raise bad_argument(
        "attention_mask",
        "None, a multihead.masks mask, or a (b, 1 or h, i, j) bool or float tensor",
        describe(attention_mask),
        'build the mask with the model\'s own mask functions (attn_implementation="multihead" registers them)',
        kind=TypeError,
    )
