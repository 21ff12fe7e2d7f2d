"""multihead.attention_varlen: FlashAttention's varlen layout. Each document of the packed call equals attention
on that document alone (causal and windows aligned bottom-right within it), forward and backward, on every backend;
the LSE and weights come in FlashAttention's layout; the blocks between documents are classified exactly; device
boundaries are never read; bad arguments are named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead import attention, attention_result, attention_varlen, attention_varlen_result, masks
from multihead.masks import STATE_PARTIAL, AttentionShape, bind_mask
from multihead.masks._documents import ragged_documents
from support import is_input_error, refused_off_the_cpu, tiny_blocks
from test_block_states import true_states

pytestmark = pytest.mark.portable

BACKENDS = ["reference", "sdpa", "tiled", "spans", "materialized", "flex"]


def packed(query_lengths, key_lengths, h=4, g=2, d=8, e=6, dtype=torch.float64, seed=0, device="cpu"):
    """q (total_q, h, d), k (total_k, g, d), v (total_k, g, e) and both boundaries, drawn on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(query_lengths), sum(key_lengths)
    q = torch.randn(total_q, h, d, generator=generator, dtype=torch.float64)
    k = torch.randn(total_k, g, d, generator=generator, dtype=torch.float64)
    v = torch.randn(total_k, g, e, generator=generator, dtype=torch.float64)
    cu_q = torch.tensor([0, *torch.tensor(query_lengths).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(key_lengths).cumsum(0).tolist()])
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], cu_q, cu_k


def alone(q, k, v, mask=None, **kwargs):
    """One document's q (rows, h, d), k and v (keys, g, .) through the reference kernel: its output (rows, h, e),
    or the AttentionResult in the (1, h, ...) layout when more is asked for. A document with no key gives 0."""
    if k.shape[0] == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
    packed = [t.transpose(0, 1)[None] for t in (q, k, v)]
    if kwargs:
        return attention_result(*packed, mask=mask, backend="reference", **kwargs)
    return attention(*packed, mask=mask, backend="reference")[0].transpose(0, 1)


def document(tensors, cu_q, cu_k, n):
    """Document n's q, k and v out of the packed ones."""
    q, k, v = tensors
    return q[cu_q[n] : cu_q[n + 1]], k[cu_k[n] : cu_k[n + 1]], v[cu_k[n] : cu_k[n + 1]]


BANDS = {"none": (False, None), "causal": (True, None), "window": (False, (2, 1)), "causal window": (True, (3, None))}


def band_mask(name):
    causal, window = BANDS[name]
    parts = ([masks.causal()] if causal else []) + ([masks.window(*window)] if window else [])
    return None if not parts else masks.all_of(*parts) if len(parts) > 1 else parts[0]


@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_document_equals_attention_on_it_alone(backend, band, device):
    # queries fewer than keys (a prefix cached), as many, more (the first rows of a causal document see nothing),
    # an empty document on the query side and a one-token document
    query_lengths, key_lengths = [3, 5, 0, 4, 1], [6, 5, 2, 3, 1]
    dtype = torch.float32 if backend == "flex" else torch.float64
    (q, k, v), cu_q, cu_k = packed(query_lengths, key_lengths, dtype=dtype, device=device)
    backward = not (backend == "flex" and device.type == "cpu")  # FlexAttention has no CPU backward (torch 2.13)
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    causal, window = BANDS[band]

    def run():
        return attention_varlen(*leaves, cu_q, cu_k, 5, 6, causal=causal, window=window, backend=backend)

    if refused_off_the_cpu(backend, device, run):
        return
    out = run()
    assert out.shape == (sum(query_lengths), 4, 6)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(out)
    if backward:
        out.backward(dout)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-12
    for n in range(len(query_lengths)):
        if not query_lengths[n]:
            continue  # nothing of it in the output; its keys' gradients are checked below
        rows, keys = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        pieces = [t.detach().clone().requires_grad_(True) for t in document((q, k, v), cu_q, cu_k, n)]
        expected = alone(*pieces, band_mask(band))
        torch.testing.assert_close(out[rows], expected, atol=tolerance, rtol=0)
        if backward:
            expected.backward(dout[rows])
            for leaf, piece, part in zip(leaves, pieces, (rows, keys, keys), strict=True):
                torch.testing.assert_close(leaf.grad[part], piece.grad, atol=tolerance, rtol=0)
    if backward:  # the keys of the document with no query get no gradient
        empty = slice(cu_k[2], cu_k[3])
        assert not leaves[1].grad[empty].any() and not leaves[2].grad[empty].any()


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=6).filter(
        lambda pairs: sum(a for a, _ in pairs) and sum(b for _, b in pairs)
    ),
    band=st.sampled_from(list(BANDS)),
    backend=st.sampled_from(["tiled", "materialized", "sdpa"]),
)
def test_random_documents_equal_each_alone_property(lengths, band, backend):
    query_lengths, key_lengths = [a for a, _ in lengths], [b for _, b in lengths]
    (q, k, v), cu_q, cu_k = packed(query_lengths, key_lengths)
    causal, window = BANDS[band]
    with tiny_blocks():  # many small blocks: full, empty and partial ones across document boundaries
        out = attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=causal, window=window, backend=backend)
    for n in range(len(lengths)):
        if query_lengths[n]:
            expected = alone(*document((q, k, v), cu_q, cu_k, n), band_mask(band))
            torch.testing.assert_close(out[cu_q[n] : cu_q[n + 1]], expected, atol=1e-12, rtol=0)


def test_lse_and_weights_come_in_flash_attentions_layout(device):
    (q, k, v), cu_q, cu_k = packed([2, 3], [4, 3], device=device)
    result = attention_varlen_result(q, k, v, cu_q, cu_k, 3, 4, causal=True, return_weights=True, return_lse=True)
    assert result.lse.shape == (4, 5) and result.weights.shape == (4, 5, 7)
    for n in range(2):
        rows, keys = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        expected = alone(*document((q, k, v), cu_q, cu_k, n), masks.causal(), return_weights=True, return_lse=True)
        torch.testing.assert_close(result.lse[:, rows], expected.lse[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(result.weights[:, rows, keys], expected.weights[0], atol=1e-12, rtol=0)
        assert float(result.weights[:, rows].sum()) == pytest.approx(float(expected.weights.sum()))  # none outside


def test_alibi_and_a_softcap_within_each_document(device):
    (q, k, v), cu, _ = packed([3, 5], [3, 5], device=device)
    slopes = masks.alibi_slopes(4).to(device)
    out = attention_varlen(q, k, v, cu, cu, 5, 5, causal=True, softcap_to=2.0, alibi_slopes=slopes)
    for n in range(2):
        rows = slice(cu[n], cu[n + 1])
        mask = masks.causal() & masks.alibi(slopes) & masks.softcap(2.0)
        torch.testing.assert_close(out[rows], alone(*document((q, k, v), cu, cu, n), mask), atol=1e-12, rtol=0)


@pytest.mark.parametrize("band", [(None, None), (None, 0), (2, 1)])
@pytest.mark.parametrize("block", [1, 2, 3, 5])
def test_the_blocks_are_classified_as_their_pairs_say(band, block):
    # a block is classified from its ranges of documents and positions: never against its pairs, and exactly
    # where its rows lie in one document (rows of two documents may each miss the other's keys: partial)
    cu_q, cu_k = torch.tensor([0, 3, 8, 8, 12]), torch.tensor([0, 5, 10, 12, 13])
    shape = AttentionShape(1, 2, 12, 13, torch.device("cpu"))
    bound = bind_mask(ragged_documents(cu_q, cu_k, band), False, shape)
    truth = true_states(bound, block)
    states = bound.block_states(block).cpu()
    one_document = torch.tensor(
        [
            len({int(d) for d in torch.bucketize(torch.arange(r, min(12, r + block)), cu_q[1:], right=True)}) == 1
            for r in range(0, 12, block)
        ]
    )
    said = states != STATE_PARTIAL
    assert torch.equal(states[said], truth[said]) and torch.equal(states[one_document], truth[one_document])
    assert said.sum() >= truth.numel() // 2  # most tiles settled without their pairs
    for r in range(truth.shape[0]):
        for c in range(truth.shape[1]):
            rows, cols = range(r * block, min(12, (r + 1) * block)), range(c * block, min(13, (c + 1) * block))
            assert bound.state(rows, cols).value == ["empty", "partial", "full"][int(states[r, c])]
    keep = bound.dense(torch.float32)[0][0, 0]
    assert bound.may_empty_rows() == bool((~keep.any(-1)).any())  # the rows left without a key, exactly


def test_boundaries_on_a_device_are_never_read():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.randn(12, 4, 8), torch.randn(13, 2, 8), torch.randn(13, 2, 8)
        cu_q = torch.randint(0, 3, (5,)).cumsum(0)  # values unknown to the host: read, they would raise
        cu_k = torch.randint(0, 3, (5,)).cumsum(0)
        out = attention_varlen(q, k, v, cu_q, cu_k, 12, 13, causal=True, backend="tiled")
        assert out.shape == (12, 4, 8)


@pytest.mark.parametrize(
    "change, kind, fragment",
    [
        ({"q": torch.randn(1, 7, 4, 8)}, ValueError, "q: expected a 3-D tensor (total_q, h, d)"),
        ({"k": torch.randn(0, 4, 8)}, ValueError, "k: expected every size at least 1"),
        ({"cu_seqlens_q": torch.tensor([0, 3, 6])}, ValueError, "cu_seqlens_q: expected non-decreasing boundaries"),
        ({"cu_seqlens_q": torch.tensor([1, 3, 7])}, ValueError, "from 0 to the 7 packed tokens"),
        ({"cu_seqlens_k": torch.tensor([0, 7]), "max_seqlen_k": 7}, ValueError, "cu_seqlens_k: expected 3 boundaries"),
        ({"cu_seqlens_k": [0, 3, 7]}, TypeError, "cu_seqlens_k: expected a 1-D integer tensor"),
        ({"max_seqlen_q": 3}, ValueError, "max_seqlen_q: expected at least the longest document, 4"),
        ({"window": (2,)}, ValueError, "window: expected (left, right)"),
        ({"alibi_slopes": torch.ones(3, 4)}, ValueError, "alibi_slopes: expected (h,) = (4,) one slope per query"),
        ({"alibi_slopes": torch.ones(2, 5)}, ValueError, "or (documents, h) = (2, 4) one per document and head"),
        ({"alibi_slopes": torch.ones(2, 4, 1)}, ValueError, "alibi_slopes: expected (h,) = (4,) or (documents, h)"),
        ({"alibi_slopes": torch.ones(4, dtype=torch.long)}, TypeError, "alibi_slopes: expected a float tensor"),
    ],
)
def test_bad_arguments_are_named(change, kind, fragment):
    q = k = v = torch.randn(7, 4, 8)
    arguments = {
        "q": q,
        "k": k,
        "v": v,
        "cu_seqlens_q": torch.tensor([0, 3, 7]),
        "cu_seqlens_k": torch.tensor([0, 3, 7]),
    }
    arguments |= {"max_seqlen_q": 4, "max_seqlen_k": 4} | change
    with pytest.raises(kind) as raised:
        attention_varlen(**arguments)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)
