"""FlashAttention's API where multihead claims its layout (issue 47, row 20): ALiBi slopes of shape (b, h) on every
backend, ALiBi in varlen for documents of unequal sides (aligned bottom-right within each, FlashAttention's
-slope * |i + seqlen_k - seqlen_q - j|), and ``attention_with_kvcache``, ``flash_attn_with_kvcache``'s call: the new
keys written into the caller's cache in place, then attention over it, against a float64 reference that does the
same by hand (each row's prefix and new keys concatenated, attended with the typed masks)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import multihead
from multihead import attention, attention_result, attention_varlen, attention_varlen_result, masks
from multihead.masks import AttentionShape, bind_mask
from multihead.paged import attention_with_kvcache
from support import (
    assert_forward_backward_within_rule,
    assert_within_rule,
    is_input_error,
    make_qkv,
    randn,
    textbook_lowp,
    tiny_blocks,
)
from test_varlen import alone, document, packed

BACKENDS = ["reference", "sdpa", "tiled", "materialized", "flex"]
WITH_BACKWARD = ["reference", "sdpa", "tiled", "materialized"]  # flex has no CPU backward (torch 2.13)
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def row_slopes(b: int, h: int, seed: int = 4, device="cpu") -> torch.Tensor:
    """(b, h) slopes, every row its own (FlashAttention's test draws them so: rand * 0.3)."""
    return (torch.rand(b, h, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.3).to(device)


def flash_bias(slopes: torch.Tensor, i: int, j: int) -> torch.Tensor:
    """FlashAttention's ALiBi, written from its docstring: -slope * |t + j - i - c| for query t and key c, (b, h, i, j)
    for (b, h) slopes."""
    t = torch.arange(i, dtype=torch.float64)[:, None]
    c = torch.arange(j, dtype=torch.float64)[None, :]
    return -slopes.double()[:, :, None, None] * (t + j - i - c).abs()


# --------------------------------------------------------------------------- (a) ALiBi slopes (b, h)


@pytest.mark.portable
@pytest.mark.parametrize("lengths", [(5, 7), (7, 5)], ids=["i<j", "i>j"])
def test_per_row_slopes_give_flash_attentions_bias(lengths, device):
    i, j = lengths
    slopes = row_slopes(2, 3, device=device)
    keep, bias = bind_mask(masks.alibi(slopes), False, AttentionShape(2, 3, i, j, device)).dense(torch.float64)
    assert keep is None and bias.shape == (2, 3, i, j)
    torch.testing.assert_close(bias.cpu(), flash_bias(slopes.cpu(), i, j), rtol=0, atol=1e-15)
    # each row's slopes are its own: row 1 alone with (h,) slopes gives row 1's bias
    row = bind_mask(masks.alibi(slopes[1]), False, AttentionShape(1, 3, i, j, device)).dense(torch.float64)[1]
    torch.testing.assert_close(bias[1:], row, rtol=0, atol=0)


@pytest.mark.portable
@pytest.mark.parametrize("lengths", [(5, 7), (7, 5)], ids=["i<j", "i>j"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("combined", [False, True], ids=["alone", "causal-padding"])
@pytest.mark.parametrize("backend", ["sdpa", "tiled", "materialized"])
def test_every_backend_serves_per_row_slopes(backend, combined, dtype, lengths, small_blocks, device):
    i, j = lengths
    q, k, v = make_qkv(b=2, h=6, g=3, i=i, j=j, d=4, e=3, device=device)
    mask = masks.alibi(row_slopes(2, 6, device=device))
    if combined:
        mask = mask & masks.causal() & masks.padding(torch.tensor([j, 3], device=device))
    dout = randn(2, 6, i, 3, seed=7, device=device)
    assert_forward_backward_within_rule(backend, q, k, v, mask, dout, dtype, f"{backend}/{dtype}")


@pytest.mark.portable
def test_the_reference_with_per_row_slopes_is_each_row_alone(device):
    q, k, v = make_qkv(b=2, h=4, g=2, i=5, j=7, device=device)
    slopes = row_slopes(2, 4, device=device)
    both = attention_result(q, k, v, mask=masks.alibi(slopes), causal=True, backend="reference", return_lse=True)
    for b in range(2):
        one = attention_result(
            q[b : b + 1], k[b : b + 1], v[b : b + 1], mask=masks.alibi(slopes[b]), causal=True, return_lse=True
        )
        torch.testing.assert_close(both.output[b : b + 1], one.output, rtol=0, atol=1e-13)
        torch.testing.assert_close(both.lse[b : b + 1], one.lse, rtol=0, atol=1e-13)


def test_flex_serves_per_row_slopes_forward():
    q, k, v = make_qkv(b=2, h=4, g=2, i=5, j=7, dtype=torch.float32)
    mask = masks.alibi(row_slopes(2, 4).float()) & masks.causal()
    expected = attention(q, k, v, mask=mask, backend="reference")
    torch.testing.assert_close(attention(q, k, v, mask=mask, backend="flex"), expected, rtol=0, atol=2e-6)


def test_auto_serves_per_row_slopes_on_every_backend_that_serves_alibi():
    from support import auto_candidates

    q, k, v = make_qkv(b=2, h=4, g=2, i=5, j=7)
    per_row, shared = masks.alibi(row_slopes(2, 4)), masks.alibi(masks.alibi_slopes(4).double())
    assert auto_candidates(q, k, v, mask=per_row) == auto_candidates(q, k, v, mask=shared)
    explanation = multihead.explain(q, k, v, mask=per_row)
    assert explanation.chosen is not None and not any("alibi" in " ".join(r) for r in explanation.rejected.values())


@pytest.mark.parametrize("backend", ["reference", "tiled", "materialized", "sdpa"])
def test_gradcheck_with_per_row_slopes(backend):
    q, k, v = make_qkv(b=2, h=4, g=2, i=3, j=5, d=3, e=2, requires_grad=True)
    slopes = row_slopes(2, 4)
    with tiny_blocks():
        assert torch.autograd.gradcheck(
            lambda q, k, v: attention(q, k, v, mask=masks.alibi(slopes), causal=True, backend=backend), (q, k, v)
        )


def test_learned_per_row_slopes_get_their_gradient():
    q, k, v = make_qkv(b=2, h=3, g=3, i=3, j=4, d=3, e=2)
    slopes = row_slopes(2, 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda s: attention(q, k, v, mask=masks.alibi(s), backend="reference"), (slopes,))


def test_per_row_slopes_built_a_few_heads_at_a_time_and_for_some_heads(monkeypatch):
    slopes = row_slopes(3, 5)
    shape = AttentionShape(3, 5, 4, 6, torch.device("cpu"))
    bound = bind_mask(masks.alibi(slopes), False, shape)
    expected = flash_bias(slopes, 4, 6)
    monkeypatch.setattr(masks._alibi, "ALIBI_CHUNK_ELEMENTS", 2 * 3 * 4 * 6)  # two heads a chunk: the last short
    torch.testing.assert_close(bound.dense(torch.float64)[1], expected, rtol=0, atol=1e-15)
    heads = torch.tensor([4, 1])
    part = bound.block(slice(1, 3), slice(2, 5), heads, dtype=torch.float32)[1]
    torch.testing.assert_close(part, expected[:, [4, 1], 1:3, 2:5].float(), rtol=0, atol=1e-7)


def test_weights_of_some_heads_with_per_row_slopes():
    q, k, v = make_qkv(b=2, h=4, g=2, i=5, j=7)
    mask = masks.alibi(row_slopes(2, 4))
    full = attention_result(q, k, v, mask=mask, return_weights=True).weights
    chosen = multihead.WeightSelection(heads=[3, 0], queries=[4, 1])
    some = attention_result(q, k, v, mask=mask, return_weights=chosen, backend="tiled").weights
    torch.testing.assert_close(some, full[:, [3, 0]][:, :, [4, 1]], rtol=0, atol=1e-13)


@pytest.mark.parametrize(
    "slopes, kind, fragment",
    [
        (torch.ones(1, 6), ValueError, "got (1, 6). Fix: give one row per batch row (2 of them)"),
        (torch.ones(3, 6), ValueError, "or (b, h) = (2, 6) one per batch row and head, got (3, 6)"),
        (torch.ones(2, 4), ValueError, "got (2, 4). Fix: give one column per query head: 6"),
        (torch.ones(2, 6, 1), ValueError, "alibi(slopes): expected a float tensor of slopes, (h,) one per query"),
        (torch.ones(2, 6, dtype=torch.int64), TypeError, "alibi(slopes): expected a float tensor of slopes"),
    ],
    ids=["one-row-for-two", "three-rows-for-two", "wrong-heads", "3-d", "integers"],
)
def test_bad_slopes_are_named(slopes, kind, fragment):
    q, k, v = make_qkv(b=2, h=6, g=3)
    with pytest.raises(kind) as raised:
        attention(q, k, v, mask=masks.alibi(slopes))
    assert is_input_error(raised.value, kind) and fragment in str(raised.value), str(raised.value)


# --------------------------------------------------------------------------- (b) ALiBi in varlen, unequal sides


def varlen_by_hand(q, k, v, cu_q, cu_k, slopes, causal):
    """FlashAttention's varlen with ALiBi written out per document in float64: scores * scale - slope * |t + n_k
    - n_q - c|, causal bottom-right; returns out (total_q, h, e) and lse (h, total_q)."""
    h, e = q.shape[1], v.shape[2]
    out, lse = q.new_zeros(q.shape[0], h, e), q.new_full((h, q.shape[0]), -math.inf)
    for n in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        n_q, n_k = rows.stop - rows.start, keys.stop - keys.start
        if not n_q or not n_k:
            continue
        kk = k[keys].repeat_interleave(h // k.shape[1], dim=1)  # (n_k, h, d)
        vv = v[keys].repeat_interleave(h // v.shape[1], dim=1)
        scores = torch.einsum("thd,chd->htc", q[rows], kk) / math.sqrt(q.shape[2])  # (h, n_q, n_k)
        slope = (slopes if slopes.ndim == 1 else slopes[n]).double()[:, None, None]
        t, c = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        scores = scores - slope * (t + n_k - n_q - c).abs()
        if causal:
            scores = scores.masked_fill(c > t + n_k - n_q, -math.inf)
        best = scores.amax(-1, keepdim=True)
        best = torch.where(best.isinf(), torch.zeros_like(best), best)  # a row with no key: all -inf
        weights = (scores - best).exp()
        total = weights.sum(-1, keepdim=True)
        alive = total > 0
        out[rows] = (torch.where(alive, weights / total.clamp(min=1e-300), 0.0) @ vv.transpose(0, 1)).transpose(0, 1)
        lse[:, rows] = torch.where(alive, total.clamp(min=1e-300).log() + best, -math.inf)[..., 0]
    return out, lse


@pytest.mark.portable
@pytest.mark.parametrize("per_document", [False, True], ids=["(h,)", "(documents, h)"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_varlen_alibi_is_flash_attentions_bias_for_unequal_sides(causal, per_document, device):
    # fewer queries than keys (a cached prefix), more (causal rows before the first key see nothing), one token
    query_lengths, key_lengths = [2, 5, 1, 3], [6, 3, 1, 3]
    (q, k, v), cu_q, cu_k = packed(query_lengths, key_lengths, device=device)
    slopes = row_slopes(4, 4, device=device) if per_document else masks.alibi_slopes(4).to(device)
    result = attention_varlen_result(q, k, v, cu_q, cu_k, 5, 6, causal=causal, alibi_slopes=slopes, return_lse=True)
    out, lse = varlen_by_hand(q.cpu(), k.cpu(), v.cpu(), cu_q, cu_k, slopes.cpu(), causal)
    torch.testing.assert_close(result.output.cpu(), out, rtol=0, atol=1e-12)
    torch.testing.assert_close(result.lse.cpu(), lse, rtol=0, atol=1e-12)


BANDS = {"none": (False, None), "causal": (True, None), "window": (False, (2, 1)), "causal window": (True, (3, None))}


@pytest.mark.portable
@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_alibi_document_equals_it_alone_on_every_backend(backend, band, device):
    query_lengths, key_lengths = [3, 5, 0, 4, 1], [6, 5, 2, 3, 1]
    dtype = torch.float32 if backend == "flex" else torch.float64
    (q, k, v), cu_q, cu_k = packed(query_lengths, key_lengths, dtype=dtype, device=device)
    slopes = row_slopes(5, 4, device=device).to(dtype)
    backward = backend in WITH_BACKWARD or device.type != "cpu"
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    causal, window = BANDS[band]
    if backend == "flex" and device.type == "cpu":  # each row's own position is read by query position: refused
        with pytest.raises(ValueError, match="reads a tensor by query position, on CPU"):
            attention_varlen(
                q, k, v, cu_q, cu_k, 5, 6, causal=causal, window=window, alibi_slopes=slopes, backend=backend
            )
        return
    out = attention_varlen(
        *leaves, cu_q, cu_k, 5, 6, causal=causal, window=window, alibi_slopes=slopes, backend=backend
    )
    dout = randn(*out.shape, seed=3, device=device).to(out)
    if backward:
        out.backward(dout)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-12
    for n in range(len(query_lengths)):
        if not query_lengths[n]:
            continue
        rows, keys = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        pieces = [t.detach().clone().double().requires_grad_(True) for t in document((q, k, v), cu_q, cu_k, n)]
        parts = ([masks.causal()] if causal else []) + ([masks.window(*window)] if window else [])
        expected = alone(*pieces, masks.all_of(masks.alibi(slopes[n].double()), *parts))
        torch.testing.assert_close(out[rows].double(), expected, atol=tolerance, rtol=0)
        if backward:
            expected.backward(dout[rows].double())
            for leaf, piece, part in zip(leaves, pieces, (rows, keys, keys), strict=True):
                torch.testing.assert_close(leaf.grad[part].double(), piece.grad, atol=tolerance, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "tiled", "materialized"])
def test_varlen_alibi_gradcheck(backend):
    (q, k, v), cu_q, cu_k = packed([2, 3], [4, 2], h=2, g=1, d=3, e=2)
    slopes = row_slopes(2, 2)
    with tiny_blocks():
        assert torch.autograd.gradcheck(
            lambda q, k, v: attention_varlen(
                q, k, v, cu_q, cu_k, 3, 4, causal=True, alibi_slopes=slopes, backend=backend
            ),
            tuple(t.requires_grad_() for t in (q, k, v)),
        )


def test_varlen_alibi_reads_no_boundary_on_the_host():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.randn(12, 4, 8), torch.randn(13, 2, 8), torch.randn(13, 2, 8)
        cu_q, cu_k = torch.randint(0, 3, (5,)).cumsum(0), torch.randint(0, 3, (5,)).cumsum(0)
        out = attention_varlen(q, k, v, cu_q, cu_k, 12, 13, causal=True, alibi_slopes=torch.rand(4, 4), backend="tiled")
        assert out.shape == (12, 4, 8)


# --------------------------------------------------------------------------- (c) attention_with_kvcache


def rotate_by_hand(x, cos, sin, positions, interleaved):
    """x (n, heads, d) of one row turned pair by pair at ``positions`` (n,), in float64."""
    out = x.clone()
    for m in range(cos.shape[1]):
        a, b = (2 * m, 2 * m + 1) if interleaved else (m, m + cos.shape[1])
        c, s = cos[positions, m][:, None].double(), sin[positions, m][:, None].double()
        out[:, :, a] = x[:, :, a] * c - x[:, :, b] * s
        out[:, :, b] = x[:, :, b] * c + x[:, :, a] * s
    return out


def kvcache_by_hand(case, cache_k, cache_v, *, lowp=False):
    """What attention_with_kvcache must give, in float64 (or, ``lowp``, the textbook in the inputs' dtype): per
    row, q and the new k turned, the row's cache prefix leftpad .. seqlens - 1 and the new keys concatenated, and
    attention over them with the typed masks (bottom-right alignment: the row's last query at its last key).
    ``cache_k``, ``cache_v``: the contiguous caches (b_cache, L, g, .) before the call. Returns out (b, s, h, e),
    lse (b, h, s) and the caches as the call must leave them."""
    q, k, v = case["q"], case["k"], case["v"]
    b, s, h, _ = q.shape
    work = q.dtype if lowp else torch.float64
    out, lse = [], []
    after_k, after_v = cache_k.clone(), cache_v.clone()
    for row in range(b):
        r = row if case["batch_idx"] is None else int(case["batch_idx"][row])
        length, first = int(case["seqlens"][row]), int(case["leftpad"][row]) if case["leftpad"] is not None else 0
        qr, kr = q[row].to(work), None if k is None else k[row].to(work)
        if case["cos"] is not None:
            new = torch.arange(length, length + k.shape[1])
            turned = torch.arange(length, length + s) if case["causal"] or case["window"] != (-1, -1) else None
            at = turned if turned is not None else torch.full((s,), length)
            qr = rotate_by_hand(q[row].double(), case["cos"], case["sin"], at, case["interleaved"]).to(work)
            kr = rotate_by_hand(k[row].double(), case["cos"], case["sin"], new, case["interleaved"]).to(work)
        keys, values = cache_k[r, first:length].to(work), cache_v[r, first:length].to(work)
        if k is not None:
            keys, values = torch.cat([keys, kr]), torch.cat([values, v[row].to(work)])
            after_k[r, length : length + k.shape[1]] = kr.to(cache_k.dtype)
            after_v[r, length : length + k.shape[1]] = v[row]
        parts = []
        if case["causal"]:
            parts.append(masks.causal())
        left, right = (None if side == -1 else side for side in case["window"])
        if (left, right) != (None, None):
            parts.append(masks.window(left, 0 if case["causal"] else right))
        if case["slopes"] is not None:
            slopes = case["slopes"] if case["slopes"].ndim == 1 else case["slopes"][row]
            parts.append(masks.alibi(slopes.to(torch.float32 if lowp else torch.float64)))
        if case["softcap"]:
            parts.append(masks.softcap(case["softcap"]))
        mask = masks.all_of(*parts) if parts else None
        args = [t.transpose(0, 1)[None] for t in (qr, keys, values)]  # (1, h|g, n, .)
        scale = case["scale"]
        if keys.shape[0] == 0:
            out.append(q.new_zeros(1, h, s, v.shape[-1] if v is not None else cache_v.shape[-1]).to(work))
            lse.append(torch.full((1, h, s), -math.inf, dtype=torch.float64))
        elif lowp:
            row_out, _, row_lse = textbook_lowp(*args, mask=mask, scale=scale)
            out.append(row_out)
            lse.append(row_lse)
        else:
            result = attention_result(*args, mask=mask, scale=scale, backend="reference", return_lse=True)
            out.append(result.output)
            lse.append(result.lse)
    return torch.cat(out).transpose(1, 2), torch.cat(lse), after_k, after_v


def make_case(
    *,
    s=3,
    new=2,
    length=40,
    b=2,
    h=6,
    g=3,
    d=16,
    e=12,
    causal=True,
    window=(-1, -1),
    slopes=False,
    leftpad=False,
    batch_idx=False,
    rotary=0,
    interleaved=True,
    softcap=0.0,
    scale=None,
    seqlens=None,
    dtype=torch.float64,
    seed=0,
):
    """One call's inputs, FlashAttention's test's way: a random cache, each row its own length (room for the new
    keys), left pads below it, a permutation of cache rows; ``rotary`` the rotated share of d."""
    gen = torch.Generator().manual_seed(seed)
    rows_of_cache = 2 * b if batch_idx else b

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    top = length - max(new, s if (causal or window != (-1, -1)) and rotary else 0)
    if seqlens is None:
        seqlens = torch.randint(0 if new else 1, top + 1, (b,), generator=gen)
    rotary_dim = int(rotary * d) // 2 * 2
    angle = torch.rand(length, rotary_dim // 2, generator=gen, dtype=torch.float64) * 2 * math.pi
    return {
        "q": draw(b, s, h, d),
        "k": draw(b, new, g, d) if new else None,
        "v": draw(b, new, g, e) if new else None,
        "cache_k": draw(rows_of_cache, length, g, d),
        "cache_v": draw(rows_of_cache, length, g, e),
        "seqlens": seqlens.to(torch.int32),
        "leftpad": (
            torch.stack([torch.randint(0, max(1, int(n)), (), generator=gen) for n in seqlens]).to(torch.int32)
            if leftpad
            else None
        ),
        "batch_idx": torch.randperm(rows_of_cache, generator=gen)[:b].to(torch.int32) if batch_idx else None,
        "slopes": (torch.rand(b, h, generator=gen, dtype=torch.float64) * 0.3) if slopes else None,
        "cos": angle.cos().to(dtype) if rotary_dim else None,
        "sin": angle.sin().to(dtype) if rotary_dim else None,
        "causal": causal,
        "window": window,
        "interleaved": interleaved,
        "softcap": softcap,
        "scale": scale,
    }


def paged_pools(cache: torch.Tensor, page: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous cache (b, L, g, x) as FlashAttention's paged test lays it out: pages of ``page`` keys in a pool
    at random places, (P, page, g, x), and the block table (b, L / page) int32 saying where each row's are."""
    b, length = cache.shape[:2]
    per_row = length // page
    order = torch.randperm(b * per_row, generator=torch.Generator().manual_seed(seed))
    pool = torch.empty(b * per_row, page, *cache.shape[2:], dtype=cache.dtype)
    pool[order] = cache.reshape(b * per_row, page, *cache.shape[2:])
    return pool, order.view(b, per_row).to(torch.int32)


def call_with(case, k_cache, v_cache, *, block_table=None, backend="auto", return_lse=True, device="cpu"):
    moved = {name: None if t is None else t.to(device) for name, t in case.items() if isinstance(t, torch.Tensor)}
    return attention_with_kvcache(
        case["q"].to(device),
        k_cache,
        v_cache,
        None if case["k"] is None else case["k"].to(device),
        None if case["v"] is None else case["v"].to(device),
        rotary_cos=moved.get("cos"),
        rotary_sin=moved.get("sin"),
        cache_seqlens=moved["seqlens"],
        cache_batch_idx=moved.get("batch_idx"),
        cache_leftpad=moved.get("leftpad"),
        block_table=None if block_table is None else block_table.to(device),
        softmax_scale=case["scale"],
        causal=case["causal"],
        window_size=case["window"],
        softcap=case["softcap"],
        rotary_interleaved=case["interleaved"],
        alibi_slopes=moved.get("slopes"),
        return_softmax_lse=return_lse,
        backend=backend,
    )


def check_against_hand(case, *, paged_page=None, backend="auto", device="cpu", atol=1e-12, lse=True):
    """The call (contiguous, or paged with pages of ``paged_page``) against :func:`kvcache_by_hand`: output, LSE
    and the whole cache after it (only the new keys' slots changed)."""
    out_ref, lse_ref, after_k, after_v = kvcache_by_hand(case, case["cache_k"], case["cache_v"])
    if paged_page is None:
        k_cache, v_cache = case["cache_k"].clone().to(device), case["cache_v"].clone().to(device)
        out = call_with(case, k_cache, v_cache, backend=backend, device=device, return_lse=lse)
    else:
        (k_pool, table), (v_pool, _) = (
            paged_pools(case["cache_k"], paged_page),
            paged_pools(case["cache_v"], paged_page),
        )
        k_cache, v_cache = k_pool.to(device), v_pool.to(device)
        out = call_with(case, k_cache, v_cache, block_table=table, backend=backend, device=device, return_lse=lse)
        k_cache, v_cache = (pool.cpu()[table.long()].flatten(1, 2) for pool in (k_cache, v_cache))  # back to (b, L)
    assert torch.equal(k_cache.cpu(), after_k) and torch.equal(v_cache.cpu(), after_v)
    if lse:
        out, lse_out = out
        dead = lse_ref == -math.inf
        assert torch.equal(lse_out.cpu() == -math.inf, dead)
        torch.testing.assert_close(lse_out.cpu()[~dead].double(), lse_ref[~dead].double(), rtol=0, atol=atol)
    assert out.shape == (case["q"].shape[0], case["q"].shape[1], case["q"].shape[2], case["cache_v"].shape[-1])
    torch.testing.assert_close(out.cpu().double(), out_ref.double(), rtol=0, atol=atol)


# FlashAttention's test_flash_attn_kvcache grid, cut to what a CPU runs in float64: its (seqlen_q, seqlen_k) pairs
# (1, 128), (3, 339)-like and (64, 256)-like, seqlen_new 1, s_q or between, each row its own cache length; with and
# without causal, a window, ALiBi, left pads, a cache row permutation, rotary (interleaved or not), GQA and MQA
REGRESSION = [
    dict(s=1, new=1, length=128, g=6),
    dict(s=3, new=3, length=96, g=3, rotary=0.5, interleaved=False),
    dict(s=3, new=2, length=96, g=1, rotary=1.0, interleaved=True, leftpad=True),
    dict(s=16, new=9, length=80, g=3, window=(5, 3), slopes=True),
    dict(s=16, new=16, length=80, g=6, causal=False, rotary=0.5),
    dict(s=16, new=4, length=80, g=1, causal=False, window=(7, 2), batch_idx=True, slopes=True),
    dict(s=5, new=0, length=40, g=3, slopes=True, leftpad=True),
    dict(s=5, new=5, length=40, g=3, causal=True, window=(3, -1), softcap=2.5, rotary=1.0, batch_idx=True),
    dict(s=7, new=3, length=40, g=3, causal=False, softcap=4.0, leftpad=True, scale=0.3),
]


@pytest.mark.portable
@pytest.mark.parametrize("options", REGRESSION, ids=[f"case{n}" for n in range(len(REGRESSION))])
def test_kvcache_call_equals_the_call_done_by_hand(options, device):
    check_against_hand(make_case(**options, seed=len(str(options))), device=device)


PAGED = [
    dict(s=1, new=1, length=64, g=3),  # decode: paged backend in place
    dict(s=4, new=4, length=64, g=1, rotary=0.5, window=(6, -1)),  # causal and a left window: in place
    dict(s=4, new=3, length=64, g=3, causal=False),  # no band: in place
    dict(s=4, new=3, length=64, g=3, causal=False, window=(2, 0)),  # right 0 without causal: in place as causal
    dict(s=4, new=2, length=64, g=3, slopes=True, softcap=3.0),  # ALiBi and a soft-cap: the pages gathered
    dict(s=4, new=2, length=64, g=6, causal=False, window=(3, 2), leftpad=True),  # both sides, left pads: gathered
]


@pytest.mark.portable
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("options", PAGED, ids=[f"case{n}" for n in range(len(PAGED))])
def test_kvcache_call_over_a_paged_cache_equals_the_call_done_by_hand(options, page, device):
    check_against_hand(make_case(**options, seed=page), paged_page=page, device=device)


def test_a_paged_call_the_table_says_runs_the_paged_backend_in_place():
    from multihead.backends import paged as paged_backend

    case = make_case(s=1, new=1, length=64, g=3)
    (k_pool, table), (v_pool, _) = paged_pools(case["cache_k"], 16), paged_pools(case["cache_v"], 16)
    calls = []
    kernel = paged_backend._paged_kernel

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_backend, "_paged_kernel", counted)
        call_with(case, k_pool, v_pool, block_table=table)
        assert calls == [1]
        calls.clear()
        call_with(make_case(s=1, new=1, length=64, g=3, slopes=True), k_pool.clone(), v_pool.clone(), block_table=table)
        assert calls == []  # ALiBi: the table cannot say it, the pages are gathered for another backend


@pytest.mark.portable
@pytest.mark.parametrize("slopes", [False, True], ids=["", "alibi"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_call_on_every_backend(backend, slopes, device):
    dtype = torch.float32 if backend == "flex" else torch.float64
    softcap = 0.0 if backend == "sdpa" else 3.0  # SDPA takes no score transform: auto gives soft-caps elsewhere
    case = make_case(s=4, new=3, length=24, window=(5, -1), slopes=slopes, leftpad=True, softcap=softcap, dtype=dtype)
    lse = backend != "sdpa" and not (backend == "flex" and device.type == "cpu")  # no LSE there (torch 2.13)
    if backend == "flex" and slopes and device.type == "cpu":  # ALiBi at each row's own position: refused there
        with pytest.raises(ValueError, match="reads a tensor by query position, on CPU"):
            check_against_hand(case, backend=backend, device=device, lse=lse)
        return
    check_against_hand(case, backend=backend, device=device, atol=2e-5 if dtype == torch.float32 else 1e-12, lse=lse)


def test_auto_passes_flex_over_where_it_cannot_read_each_rows_alibi_position():
    from multihead.backends import registry

    (q, k, v), cu_q, cu_k = packed([2, 3], [4, 3], dtype=torch.float32)
    mask = masks.ragged_documents(cu_q, cu_k, (None, 0)) & masks.aligned_alibi(
        masks.alibi_slopes(4).view(1, 4, 1), masks.ragged_rows(cu_q, cu_k, 5)[1][None]
    )
    packed_qkv = [t.transpose(0, 1)[None] for t in (q, k, v)]
    from multihead.functional import _prepare

    options = dict(causal=False, scale=None, dropout=0.0, training=False, backend="auto", return_weights=False)
    call = _prepare(*packed_qkv, mask=mask, **options, return_lse=False).call
    assert "flex" not in [backend.name for backend in registry.serving_for_auto(call)]
    assert "reads a tensor by query position" in " ".join(registry.explain_call(call, "flex").rejected["flex"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kvcache_call_in_half_precision_within_the_rule(dtype):
    options = dict(s=5, new=3, length=48, g=3, window=(9, -1), slopes=True, rotary=0.5, leftpad=True)
    case64, low = make_case(**options), make_case(**options, dtype=dtype)
    ref64 = kvcache_by_hand(case64, case64["cache_k"], case64["cache_v"])[0]
    ref_lowp = kvcache_by_hand(low, low["cache_k"], low["cache_v"], lowp=True)[0]
    out = call_with(low, low["cache_k"].clone(), low["cache_v"].clone(), return_lse=False)
    assert out.dtype == dtype
    assert_within_rule(out, ref64, ref_lowp)


def test_rows_whose_band_holds_no_key_give_zero_and_minus_infinity():
    # 4 queries over a row of 2 keys, causal: the first two queries sit before the first key
    case = make_case(s=4, new=1, length=8, seqlens=torch.tensor([1, 6]))
    out, lse = call_with(case, case["cache_k"].clone(), case["cache_v"].clone())
    assert not out[0, :2].any() and bool((lse[0, :, :2] == -math.inf).all()) and bool(lse[1].isfinite().all())
    check_against_hand(case)


def test_gradients_reach_q_and_match_the_call_by_hand():
    case = make_case(s=3, new=2, length=16, slopes=True)
    q = case["q"].clone().requires_grad_()
    out, _ = call_with({**case, "q": q}, case["cache_k"].clone(), case["cache_v"].clone())
    (grad,) = torch.autograd.grad(out.square().sum(), q)
    q_hand = case["q"].clone().requires_grad_()
    out_hand = kvcache_by_hand({**case, "q": q_hand}, case["cache_k"], case["cache_v"])[0]
    (expected,) = torch.autograd.grad(out_hand.square().sum(), q_hand)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)


def test_the_output_comes_in_flash_attentions_layout():
    case = make_case(s=3, new=1, length=16, b=2, h=6, g=3, d=16, e=12)
    out = call_with(case, case["cache_k"].clone(), case["cache_v"].clone(), return_lse=False)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3, 6, 12)


def test_a_call_that_fails_after_writing_puts_the_cache_back():
    case = make_case(s=2, new=2, length=16)
    k_cache, v_cache = case["cache_k"].clone(), case["cache_v"].clone()
    with pytest.raises(ValueError, match="backend"):  # the paged backend serves no dense call: raised in dispatch
        call_with(case, k_cache, v_cache, backend="paged")
    assert torch.equal(k_cache, case["cache_k"]) and torch.equal(v_cache, case["cache_v"])


def bad_calls():
    """(name, change to the call's arguments, error type, message fragment)."""
    b, length = 2, 16
    yield "num_splits", {"num_splits": 2}, ValueError, "num_splits: expected 0 (the backend decides"
    yield "k without v", {"v": None}, ValueError, "v: expected k and v together, or neither"
    yield "k without cache_seqlens", {"cache_seqlens": None}, ValueError, "cache_seqlens: expected the keys each row"
    yield "no room", {"cache_seqlens": torch.tensor([3, 15])}, ValueError, "cache_seqlens[1] = 15"
    yield "negative length", {"cache_seqlens": torch.tensor([-1, 2])}, ValueError, "cache_seqlens[0] = -1"
    yield "lengths float", {"cache_seqlens": torch.tensor([1.0, 2.0])}, TypeError, "cache_seqlens: expected an int32"
    yield "lengths shape", {"cache_seqlens": torch.tensor([1, 2, 3])}, ValueError, "cache_seqlens: expected shape (2,)"
    yield "leftpad past length", {"cache_leftpad": torch.tensor([0, 6])}, ValueError, "cache_leftpad[1] = 6"
    yield (
        "batch_idx repeated",
        {"cache_batch_idx": torch.tensor([1, 1])},
        ValueError,
        "cache_batch_idx: expected distinct",
    )
    yield "batch_idx out", {"cache_batch_idx": torch.tensor([0, 2])}, ValueError, "cache_batch_idx[1] = 2"
    yield "window", {"window_size": (3,)}, ValueError, "window_size: expected (left, right)"
    yield "window below -1", {"window_size": (-2, 0)}, ValueError, "window_size: expected (left, right)"
    yield "softcap", {"softcap": -1.0}, ValueError, "softcap: expected a finite number >= 0"
    yield "scale", {"softmax_scale": "big"}, TypeError, "softmax_scale: expected a finite real number"
    yield "slopes shape", {"alibi_slopes": torch.ones(3, 6)}, ValueError, "alibi_slopes: expected (h,) = (6,)"
    yield "slopes int", {"alibi_slopes": torch.ones(6, dtype=torch.long)}, TypeError, "alibi_slopes: expected a float"
    yield "rotary alone", {"rotary_sin": None}, ValueError, "rotary_sin: expected rotary_cos and rotary_sin together"
    yield (
        "rotary short",
        {"rotary_cos": torch.ones(5, 4), "rotary_sin": torch.ones(5, 4)},
        ValueError,
        ("rotary_cos: expected a row for every position turned"),
    )
    yield (
        "rotary wide",
        {"rotary_cos": torch.ones(length, 9), "rotary_sin": torch.ones(length, 9)},
        ValueError,
        ("with 2 <= r <= d = 16"),
    )
    yield "q 3-D", {"q": torch.randn(b, 3, 16)}, ValueError, "q: expected shape (b, s, h, d)"
    yield "cache dtype", {"k_cache": torch.zeros(b, length, 3, 16)}, TypeError, "k_cache: expected dtype torch.float64"
    yield "cache rows", {"k_cache": torch.zeros(3, length, 3, 16, dtype=torch.float64)}, ValueError, "v_cache: expected"
    yield (
        "new keys learn",
        {"k": torch.randn(b, 2, 3, 16, dtype=torch.float64, requires_grad=True)},
        ValueError,
        ("k: expected new keys and values that need no gradient"),
    )
    yield (
        "k heads",
        {"k": torch.randn(b, 2, 1, 16, dtype=torch.float64)},
        ValueError,
        "k: expected shape (b, s_new, g, d)",
    )
    yield "interleaved", {"rotary_interleaved": 1}, TypeError, "rotary_interleaved"


@pytest.mark.parametrize("name, change, kind, fragment", list(bad_calls()), ids=[c[0] for c in bad_calls()])
def test_bad_kvcache_calls_are_named_and_change_nothing(name, change, kind, fragment):
    case = make_case(s=3, new=2, length=16, rotary=0.5, seqlens=torch.tensor([3, 4]))
    k_cache, v_cache = case["cache_k"].clone(), case["cache_v"].clone()
    arguments = (
        dict(
            q=case["q"],
            k_cache=k_cache,
            v_cache=v_cache,
            k=case["k"],
            v=case["v"],
            rotary_cos=case["cos"],
            rotary_sin=case["sin"],
            cache_seqlens=case["seqlens"],
            causal=True,
        )
        | change
    )
    with pytest.raises(kind) as raised:
        attention_with_kvcache(**arguments)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value), str(raised.value)
    assert torch.equal(k_cache, case["cache_k"]) and torch.equal(v_cache, case["cache_v"])


def bad_paged_calls():
    yield "batch_idx", {"cache_batch_idx": torch.tensor([0, 1])}, ValueError, "cache_batch_idx: expected None with"
    yield "page out of pool", {"block_table": torch.tensor([[9, 1], [2, 3]])}, ValueError, "block_table[0, 0] = 9"
    yield "page missing", {"block_table": torch.tensor([[0, 1], [-1, 3]])}, ValueError, "block_table[1, 0] = -1"
    yield "shared slot", {"block_table": torch.tensor([[0, 1], [0, 3]])}, ValueError, "two rows writing one page slot"
    yield "table float", {"block_table": torch.ones(2, 2)}, TypeError, "block_table: expected an int32 or int64"


@pytest.mark.parametrize("name, change, kind, fragment", list(bad_paged_calls()), ids=[c[0] for c in bad_paged_calls()])
def test_bad_paged_kvcache_calls_are_named_and_change_nothing(name, change, kind, fragment):
    case = make_case(s=2, new=2, length=16, seqlens=torch.tensor([3, 3]))
    (k_pool, table), (v_pool, _) = paged_pools(case["cache_k"], 8), paged_pools(case["cache_v"], 8)
    before = k_pool.clone(), v_pool.clone()
    arguments = (
        dict(
            q=case["q"],
            k_cache=k_pool,
            v_cache=v_pool,
            k=case["k"],
            v=case["v"],
            cache_seqlens=case["seqlens"],
            block_table=table,
            causal=True,
        )
        | change
    )
    with pytest.raises(kind) as raised:
        attention_with_kvcache(**arguments)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value), str(raised.value)
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])


def test_the_whole_grid_of_options_on_small_calls():
    """Every combination of the options FlashAttention's test crosses, on a small cache: each against the hand."""
    grid = itertools.product([False, True], [(-1, -1), (2, -1), (2, 1)], [False, True], [False, True], [0, 0.5])
    for n, (causal, window, slopes, leftpad, rotary) in enumerate(grid):
        case = make_case(
            s=3,
            new=2,
            length=12,
            g=3,
            causal=causal,
            window=window,
            slopes=slopes,
            leftpad=leftpad,
            rotary=rotary,
            interleaved=n % 2 == 0,
            batch_idx=n % 3 == 0,
            seed=n,
        )
        check_against_hand(case)
