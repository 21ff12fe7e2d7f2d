"""A mask bound to one call's sizes (:class:`BoundMask`): its terms combined, as every kernel reads them."""

from __future__ import annotations

import math

import torch

from multihead._errors import bad_argument
from multihead.masks._base import (
    STATE_FULL,
    AttentionShape,
    BlockGrid,
    BlockState,
    BoundTerm,
    Index,
    Span,
    _on_cpu,
    _span,
)


def _merged(terms: list[BoundTerm]) -> list[BoundTerm]:
    """The terms with each one that an earlier term absorbs (:meth:`BoundTerm.merged`) folded into it, in the
    earlier one's place: causal & window(256) is one band, window(256, 0), so kernels check one band per block
    instead of several, and a single band settles may_empty_rows without looking at any pair."""
    merged: list[BoundTerm] = []
    for term in terms:
        for index, earlier in enumerate(merged):
            both = earlier.merged(term)
            if both is not None:
                merged[index] = both
                break
        else:
            merged.append(term)
    return merged


EMPTY_ROW_BLOCK = 256  # rows and keys per block BoundMask.may_empty_rows looks at
EMPTY_ROW_CHECK_ELEMENTS = 2**24  # the most (b, h, rows, keys) entries it builds at once
# the most (b, h, rows, keys) float32 entries BoundMask.additive builds at once for a half-precision bias
ADDITIVE_BLOCK_ELEMENTS = 2**24
HALF_DTYPES = (torch.float16, torch.bfloat16)


class BoundMask:
    """A mask validated against one call's sizes; what kernels use.

    ``block(rows, cols)`` returns ``(keep, bias)``: a bool tensor (True = may attend)
    and a float tensor, each broadcastable to (b, h, rows, cols), or None when the
    block needs none. ``state(rows, cols)`` says whether the block can be skipped.
    ``softcap`` is the cap applied to the scaled scores before the bias (None: no cap);
    every kernel applies all three in that order, on its own blocks.
    """

    def __init__(self, terms: list[BoundTerm], shape: AttentionShape):
        caps = [t.cap for t in terms if t.cap is not None]
        if len(caps) > 1:  # Combined refuses this already; a BoundMask built by hand is checked too
            raise bad_argument(
                "mask",
                "at most one softcap(...) term",
                " and ".join(f"softcap(cap={c!r})" for c in caps),
                "keep one soft-cap: scores are capped once, with one cap",
            )
        self.softcap: float | None = caps[0] if caps else None
        # a boolean term that keeps every pair (causal with one decoding query, full-length padding)
        # changes nothing; dropping it spares kernels a dense mask
        terms = [t for t in terms if t.cap is None and (t.is_bias or not t.surely_full(0, shape.q_len, 0, shape.k_len))]
        self.terms = terms = _merged(terms)
        self.shape = shape
        self.keep_terms = [t for t in terms if not t.is_bias]
        self.bias_terms = [t for t in terms if t.is_bias]
        # (i, j, block_q, block_k) -> the shares of pairs in live blocks and in blocks masked score by score:
        # backends.costs keeps them here, as the estimates and the kernel of the one call this mask is bound to
        # ask for them alike
        self.block_fractions: dict[tuple[int, int, int, int], tuple[float, float]] = {}
        # a kernel's plan of this call (the spans backend's row groups), keyed by the kernel and its settings: made
        # once, for auto's estimate and the kernel alike
        self.kernel_plans: dict[tuple, object] = {}
        self._row_key_spans_read: tuple[tuple[torch.Tensor, torch.Tensor] | None] | None = None  # read once

    @classmethod
    def none(cls, shape: AttentionShape) -> BoundMask:
        return cls([], shape)

    @property
    def is_empty(self) -> bool:
        """Whether the mask changes nothing: no term and no soft-cap."""
        return not self.terms and self.softcap is None

    @property
    def has_bias(self) -> bool:
        return bool(self.bias_terms)

    def signature(self) -> tuple:
        """The mask's structure without its data, hashable: each term's kind and numbers (a band's sides and
        alignment offset, a tensor's shape and dtype) and the soft-cap. What auto's measured choices are kept for
        (``multihead.backends.policy.autotune``)."""
        return tuple(term.signature() for term in self.terms), self.softcap

    @property
    def bias_requires_grad(self) -> bool:
        return any(t.requires_grad for t in self.bias_terms)

    @property
    def is_plain_causal(self) -> bool:
        """Exactly a top-left-aligned causal mask, nothing else (SDPA's is_causal=True)."""
        return self.softcap is None and len(self.terms) == 1 and self.terms[0].is_plain_causal

    @property
    def is_lower_right_causal(self) -> bool:
        """Exactly a bottom-right-aligned causal mask with i <= j, nothing else (torch's ``causal_lower_right``)."""
        return self.softcap is None and len(self.terms) == 1 and self.terms[0].is_lower_right_causal

    @property
    def shift_invariant(self) -> bool:
        """Whether every block moved along the diagonal (its rows and keys shifted alike) is the same block: every
        term a band (:attr:`BoundTerm.shift_invariant`), no soft-cap. A kernel may build such a block's mask once
        per shape and offset."""
        return self.softcap is None and all(term.shift_invariant for term in self.terms)

    def row_key_spans(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where the mask keeps, for every query row, one run of consecutive keys with no bias or soft-cap, the same
        in every batch row and head: (lo, hi), two (i,) int64 CPU tensors, row r keeping keys lo[r] .. hi[r] - 1
        (none where hi[r] <= lo[r]); its keep terms' runs intersected. None where some term cannot say (see
        :meth:`BoundTerm.row_key_spans`). Read on the host, made once."""
        if self._row_key_spans_read is None:  # held in a 1-tuple: None is an answer, read once like the others
            self._row_key_spans_read = (self._row_key_spans(),)
        return self._row_key_spans_read[0]

    def _row_key_spans(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.bias_terms or self.softcap is not None or torch.compiler.is_compiling():
            return None
        q_len, k_len = self.shape.q_len, self.shape.k_len
        lo, hi = torch.zeros(q_len, dtype=torch.long), torch.full((q_len,), k_len, dtype=torch.long)
        for term in self.keep_terms:
            spans = term.row_key_spans()
            if spans is None:
                return None
            lo, hi = torch.maximum(lo, spans[0]), torch.minimum(hi, spans[1])
        return lo, hi

    def may_empty_rows(self) -> bool:
        """Whether some query row may have every key masked, answered on the host without waiting for a device.

        Exact wherever the values are known on the host (sizes, bands, lengths given as ints, CPU tensors), and
        without an i x j tensor (see :meth:`_some_row_empty`); True (assume the worst) where a term's values
        live only on a device, or cannot be read at all (meta or fake tensors, torch.compile's tracing).
        """
        if any(t.may_empty_rows() for t in self.terms):
            return True
        # a finite bias (ALiBi, a bias without -inf) masks no pair: only the other terms can empty a row, together
        masking = [t for t in self.terms if not t.is_bias or t.may_hold_minus_inf]
        if len(masking) < 2:
            return False
        if torch.compiler.is_compiling():
            return True  # symbolic sizes: comparing them would pin the lengths (kernels then guard every row)
        if all(t.key_bounds(0) is not None for t in masking):
            return self._bands_empty_a_row(masking)  # the common case, settled by arithmetic on ints
        # the rest is looked at on the CPU, from values known there: a CUDA tensor's are not read (a device sync)
        host = [t.host_term() for t in masking]
        if any(t is None for t in host):
            return True  # no values to look at: assume the worst (kernels then guard every row)
        return BoundMask([t for t in host if t is not None], _on_cpu(self.shape))._some_row_empty()

    def _bands_empty_a_row(self, terms: list[BoundTerm]) -> bool:
        """Whether terms whose keys per row are known by arithmetic (:meth:`BoundTerm.key_bounds`: diagonal bands,
        key lengths given on the host) leave some query row no key, without a tensor.

        Row p may see keys max(lower bounds) ... min(upper bounds), the bounds being each band's p + offset - left
        and p + offset + right, 0, and j - 1 and min(lengths) - 1 (the shortest row is the worst). A maximum of
        lines is convex in p and a minimum of lines concave, so their difference is largest at the first or the
        last row: the row is empty where lo > hi, and checking those two rows settles every row.
        """
        for row in {0, self.shape.q_len - 1}:
            bounds = [term.key_bounds(row) for term in terms]
            lo = max([0, *(b[0] for b in bounds if b is not None)])
            hi = min([self.shape.k_len - 1, *(b[1] for b in bounds if b is not None)])
            if lo > hi:
                return True
        return False

    def _some_row_empty(self) -> bool:
        """Whether terms that each leave every row a key jointly leave some row none, a block of rows at a time.

        A row block with a key block its keep terms keep whole (FULL) is settled by block states alone, unless a
        bias's -inf entries may mask inside it; otherwise only the span of its non-EMPTY key blocks is evaluated
        (keys outside it are masked for every row of the block). At most :data:`EMPTY_ROW_CHECK_ELEMENTS`
        entries are built at once: a kernel asks this on every call, and a dense (b, h, i, j) check at
        i = j = 16384 with 16 ALiBi heads took 17 GiB.
        """
        q_len, k_len = self.shape.q_len, self.shape.k_len
        full_settles = not any(t.may_hold_minus_inf for t in self.bias_terms)
        batch, heads, _ = self.dense_extent()  # a block holds batch x heads (rows, keys) planes
        rows_at_once = max(1, min(EMPTY_ROW_BLOCK, EMPTY_ROW_CHECK_ELEMENTS // (batch * heads * k_len)))
        for row_start in range(0, q_len, rows_at_once):
            rows = range(row_start, min(row_start + rows_at_once, q_len))
            live: list[range] = []
            for col_start in range(0, k_len, EMPTY_ROW_BLOCK):
                cols = range(col_start, min(col_start + EMPTY_ROW_BLOCK, k_len))
                state = self.state(rows, cols)
                if state is BlockState.FULL and full_settles:
                    break
                if state is not BlockState.EMPTY:
                    live.append(cols)
            else:  # no key block kept whole: look at the pairs
                if not live:
                    return True
                keep, _ = self.block(slice(rows.start, rows.stop), slice(live[0].start, live[-1].stop))
                if keep is not None and bool((~keep.any(-1)).any()):
                    return True
        return False

    def dense_extent(self) -> tuple[int, int, int]:
        """(b or 1, h or 1, i or 1) of the (.., j) tensor this mask's terms broadcast to, densely or a block at a
        time: a batch dim for padding, a head dim for ALiBi, a row dim for anything but padding, and a tensor
        term's own (b or 1, h or 1, i or 1)."""
        spans = [term.spans() for term in self.terms]
        batch, heads, rows = (any(spanned[axis] for spanned in spans) for axis in range(3))
        return self.shape.batch if batch else 1, self.shape.heads if heads else 1, self.shape.q_len if rows else 1

    def block_states(self, block_q: int, block_k: int | None = None) -> torch.Tensor:
        """Every block_q x block_k tile's state at once (block_k: block_q by default): (ceil(i / block_q),
        ceil(j / block_k)) int8 on the mask's device, STATE_EMPTY / STATE_PARTIAL / STATE_FULL as :meth:`state`
        would say tile by tile (for a dense keep tensor exact where :meth:`state` says partial), from whole-tensor
        operations on the device: no host loop over tiles and no read of a device tensor. The keep terms combine
        by their minimum (any empty: empty; all full: full); bias terms do not enter (their -inf entries are the
        caller's to account for)."""
        grid = BlockGrid(block_q, block_k or block_q, self.shape.q_len, self.shape.k_len, self.shape.device)
        states = grid.filled(STATE_FULL)
        for term in self.keep_terms:
            states = torch.minimum(states, term.block_states(grid))
        return states

    def on_host(self) -> BoundMask:
        """This mask's keep terms on the CPU, from the values known on the host (:meth:`BoundTerm.host_term`); a
        term whose values live only on a device stands as one that keeps every tile partial. Its
        :meth:`block_states` can be read without waiting for any device (auto's estimates)."""
        unknown = BoundTerm()  # every tile partial
        return BoundMask([t.host_term() or unknown for t in self.keep_terms], _on_cpu(self.shape))

    def state(self, rows: Span, cols: Span) -> BlockState:
        states = [t.state(rows, cols) for t in self.keep_terms]
        if BlockState.EMPTY in states:
            return BlockState.EMPTY
        if all(s is BlockState.FULL for s in states):
            return BlockState.FULL
        return BlockState.PARTIAL

    def block(
        self,
        rows: Index,
        cols: Index,
        heads: torch.Tensor | None = None,
        *,
        dtype: torch.dtype | None = None,
        minus_inf_as_keep: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Evaluate for query positions ``rows`` and key positions ``cols`` (slices or index tensors).

        ``minus_inf_as_keep``: a dense bias's -inf entries come back as keep=False with bias 0, so that
        kernels masking with masked_fill mask those pairs even where a score overflowed to +inf. A
        consumer that puts -inf back into one additive mask anyway (SDPA) passes False.
        """
        row_span = _span(rows, self.shape.q_len) if isinstance(rows, slice) else None
        col_span = _span(cols, self.shape.k_len) if isinstance(cols, slice) else None
        keep = None
        for term in self.keep_terms:
            if row_span is not None and col_span is not None and term.surely_full(*row_span, *col_span):
                continue
            part = term.evaluate(rows, cols, heads)
            keep = part if keep is None else keep & part
        total = None
        for term in self.bias_terms:
            part = term.evaluate_in(rows, cols, heads, dtype)
            if term.may_hold_minus_inf and minus_inf_as_keep:
                # -inf in a bias means "masked": as a keep term it masks the pair even where the score
                # overflowed to +inf (inf + -inf would be NaN, and a fully masked row NaN, not 0)
                masked = part == -math.inf
                keep = masked.logical_not() if keep is None else keep & masked.logical_not()
                part = part.masked_fill(masked, 0.0)
            total = part if total is None else total + part
        return keep, total

    def dense(
        self, dtype: torch.dtype, *, minus_inf_as_keep: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.block(slice(None), slice(None), dtype=dtype, minus_inf_as_keep=minus_inf_as_keep)

    def additive(self, dtype: torch.dtype, extra_key: torch.Tensor | None = None) -> torch.Tensor | None:
        """The whole mask as one tensor for a kernel that adds it to the scores (SDPA's ``attn_mask``), shaped
        (b or 1, h or 1, i or 1, j): the bool keep-mask (True = may attend) where no term adds a bias, else the
        bias in ``dtype`` with -inf wherever a keep term masks. The -inf is written in place into a bias built
        for this call (ALiBi, a sum of terms), so the peak is one bias rather than two (a causal & ALiBi bias
        at i = j = 16384 with 16 heads is 8 GiB in bfloat16); a caller's bias tensor is copied, never written.

        ``extra_key``: (b or 1, h or 1, i or 1, 1) scores of one more key, appended as column j (a learned sink's
        logit); the result is then float, (.., j + 1). A half-precision bias (or extra key) is built in float32
        and each row moved by its largest finite entry before it is rounded (:meth:`_additive_by_rows`)."""
        half_bias = dtype in HALF_DTYPES and (bool(self.bias_terms) or extra_key is not None)
        if extra_key is not None or (half_bias and not self.bias_requires_grad):
            return self._additive_by_rows(dtype, extra_key, relative=half_bias)
        keep, bias = self.dense(dtype, minus_inf_as_keep=False)  # -inf stays in the one additive mask
        if bias is None or keep is None:
            return keep if bias is None else bias
        given = self.bias_terms[0].callers_tensor() if len(self.bias_terms) == 1 else None
        callers = given is not None and bias.dtype == given.dtype
        if callers or torch.broadcast_shapes(bias.shape, keep.shape) != bias.shape:
            return bias.masked_fill(keep.logical_not(), -math.inf)
        return bias.masked_fill_(keep.logical_not(), -math.inf)

    def _additive_by_rows(self, dtype: torch.dtype, extra_key: torch.Tensor | None, *, relative: bool) -> torch.Tensor:
        """:meth:`additive` as float32 blocks of rows, each then rounded into the ``dtype`` result. ``relative``:
        each row less its largest finite entry, which a softmax does not see. A bias of a few hundred (ALiBi far
        from every key: more queries than keys) has a spacing of 2 in bfloat16, where the differences between a
        row's keys vanish; moved to its nearest key, the entries that weigh keep their precision, and those far
        below it weigh nothing (exp(-M) against an error of M / 256)."""
        shape = self.shape
        batch, heads, rows = self.dense_extent()
        columns = shape.k_len
        if extra_key is not None:
            batch, heads, rows = (max(a, n) for a, n in zip((batch, heads, rows), extra_key.shape[:3], strict=True))
            columns += 1
        result = torch.empty((batch, heads, rows, columns), dtype=dtype, device=shape.device)
        step = max(1, ADDITIVE_BLOCK_ELEMENTS // (batch * heads * columns))
        work = torch.promote_types(dtype, torch.float32)
        callers = len(self.bias_terms) == 1 and self.bias_terms[0].callers_tensor() is not None
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            row_slice = slice(start, stop) if rows > 1 else slice(None)
            keep, bias = self.block(row_slice, slice(None), dtype=work, minus_inf_as_keep=False)
            # one float32 block of rows, written in place: a bias built for this block whole is written itself
            # (no second block), a caller's bias is read, never written
            block_shape = (batch, heads, stop - start, columns)
            if bias is not None and not callers and tuple(bias.shape) == block_shape and bias.dtype == work:
                scores = keys = bias
            else:
                scores = torch.zeros(block_shape, dtype=work, device=shape.device)
                keys = scores[..., : shape.k_len]
                if bias is not None:
                    keys.copy_(bias.expand(keys.shape))
            if keep is not None:
                keys.masked_fill_(keep.logical_not(), -math.inf)
            if extra_key is not None:
                extra = extra_key[:, :, row_slice] if extra_key.shape[2] > 1 else extra_key
                scores[..., shape.k_len :] = extra
            if relative:
                top = scores.amax(dim=-1, keepdim=True)
                scores.sub_(top.masked_fill_(top.isinf(), 0.0))
            result[:, :, start:stop] = scores
        return result

    def kinds(self) -> list[str]:
        """The kinds of its terms, e.g. ``["diagonal", "alibi", "softcap"]`` (a soft-cap last)."""
        kinds = [t.kind for t in self.terms]
        return kinds + (["softcap"] if self.softcap is not None else [])

    def __repr__(self) -> str:
        cap = "" if self.softcap is None else f", softcap={self.softcap!r}"
        return f"BoundMask(kinds={self.kinds()}{cap})"
