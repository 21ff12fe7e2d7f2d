"""Typed attention masks.

A mask says which keys each query may attend to, and optionally adds a bias to
the scores. Typed masks remove the polarity question and never build an
``i x j`` tensor unless a backend asks for one: a kernel evaluates them one
block at a time, and skips blocks they rule out entirely.

    causal()                 j <= i (+ offset for unequal lengths, see below)
    window(left, right)      sliding window around the (aligned) diagonal
    padding(lengths)         key j is real for batch row b when j < lengths[b]
    padding(valid)           ... or from a (b, j) boolean of real tokens
    documents(ids)           packed documents: a query sees only keys of its own document (ids: (b, j), or
                             cu_seqlens=FlashAttention's boundaries for one packed row)
    alibi(slopes)            additive -slope[b, h] * |i - j| (Press et al., 2022); slopes (h,) or (b, h)
    bias(tensor)             any additive float tensor broadcastable to (b, h, i, j)
    allowed(tensor)          any boolean tensor broadcastable to (b, h, i, j), True = may attend
    selected(indices)        sparse-index attention: each query sees only the keys (or key blocks) picked for it
    softcap(cap)             logit soft-capping: score -> cap * tanh(score / cap), before the bias
    custom(mask_mod, score_mod, block_mod)
                             your own, as functions of (b, h, q_idx, kv_idx): FlexAttention's model, on every backend

Masks combine with ``&``: keys must be allowed by every boolean term, and the
bias terms add up. A plain tensor is accepted wherever a mask is: boolean means
True = may attend, floating means additive. Per (query, key) pair the kernels compute

    s = (q . k) * scale;  s = cap * tanh(s / cap) (with a soft-cap);  s = s + bias;  masked -> -inf

Alignment when the query length i differs from the key length j
----------------------------------------------------------------
``"bottom_right"`` (the default) aligns the last query with the last key, which
is what a KV cache needs: query ``i`` sits at key position ``i + (j - i_len)``.
``"top_left"`` aligns the first query with the first key. For i = 3, j = 5
(``x`` = may attend)::

    bottom_right          top_left
    x x x . .             x . . . .
    x x x x .             x x . . .
    x x x x x             x x x . .

With i > j, bottom-right alignment leaves the first ``i - j`` rows with no key
at all; such fully masked rows give output 0 on every backend.
"""

# One module per kind of term, each holding what the user builds and its bound term (its rule and block states): a
# new kind is a new module. BoundMask combines bound terms through their attributes alone, never by their class.
# Past __all__'s user-facing names, the ones kernels and integrations bind masks with are imported here too.
# The sequence split (multihead.parallel) alone reads terms by class: it shards the tensors of padding, documents
# and ALiBi terms by the ranks' global positions, which no bound term knows.
from multihead.masks._alibi import (  # noqa: F401
    AlibiMask,
    alibi,
    alibi_slopes,
    aligned_alibi,
    checked_slope_tensor,
    slope_table,
)
from multihead.masks._base import (  # noqa: F401
    STATE_EMPTY,
    STATE_FULL,
    STATE_PARTIAL,
    AttentionShape,
    BlockGrid,
    BlockState,
    BoundTerm,
    Index,
    device_scalar,
    host_readable,
    is_fake,
    to_device,
)
from multihead.masks._binding import bind_mask  # noqa: F401
from multihead.masks._bound_mask import BoundMask
from multihead.masks._custom import custom
from multihead.masks._diagonal import band_intersection, causal, window  # noqa: F401
from multihead.masks._documents import (  # noqa: F401
    DocumentsMask,
    document_positions,
    documents,
    key_range_positions,
    key_ranges,
    ragged_documents,
    ragged_rows,
)
from multihead.masks._mask import Combined, Mask, all_of, allowed, as_mask, bias, cut_parts  # noqa: F401
from multihead.masks._padding import PaddingMask, padding  # noqa: F401
from multihead.masks._selected import selected
from multihead.masks._softcap import softcap

__all__ = [
    "Mask",
    "all_of",
    "BoundMask",
    "BlockState",
    "causal",
    "window",
    "padding",
    "documents",
    "document_positions",
    "alibi",
    "alibi_slopes",
    "bias",
    "allowed",
    "softcap",
    "selected",
    "as_mask",
    "custom",
]
