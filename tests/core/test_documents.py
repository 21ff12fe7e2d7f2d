"""masks.documents: packed documents. The packed batch equals running each document alone, forward and backward, on
every backend; cu_seqlens and indices give the same mask; the blocks between documents are skipped without being
built; bad indices are named. (Every backend against the reference, documents alone and combined with causal,
padding and ALiBi: test_backends.py; its block states: test_block_states.py.)"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch

from multihead import attention, masks
from multihead.masks import STATE_EMPTY, STATE_FULL, AttentionShape, bind_mask
from support import is_input_error, refused_off_the_cpu, tiny_blocks

pytestmark = pytest.mark.portable

BACKENDS = ["reference", "sdpa", "tiled", "spans", "materialized", "flex"]


def random_lengths(n: int, seed: int) -> list[int]:
    """Document lengths summing to n, from 1 up (a one-token document is a corner of its own)."""
    generator = torch.Generator().manual_seed(seed)
    cuts = sorted(set((torch.randperm(n - 1, generator=generator)[: 1 + seed % 5] + 1).tolist()))
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("band", ["causal", "window", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_packed_row_equals_each_document_alone_forward_and_backward(backend, band, seed, device):
    dtype = torch.float32 if backend == "flex" else torch.float64
    n, h, d = 23, 4, 8
    lengths = random_lengths(n, seed)
    generator = torch.Generator().manual_seed(100 + seed)
    q, k, v = (torch.randn(1, h, n, d, generator=generator, dtype=dtype).to(device) for _ in range(3))
    dout = torch.randn(1, h, n, d, generator=generator, dtype=dtype).to(device)
    extra = {"causal": masks.causal(), "window": masks.window(3, 2), "none": None}[band]
    packed = masks.documents(cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
    mask = packed if extra is None else packed & extra
    backward = not (backend == "flex" and device.type == "cpu")  # FlexAttention has no CPU backward (torch 2.13)
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    if refused_off_the_cpu(backend, device, lambda: attention(*leaves, mask=mask, backend=backend)):
        return
    out = attention(*leaves, mask=mask, backend=backend)
    if backward:
        out.backward(dout)
    start = 0
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    for length in lengths:
        part = slice(start, start + length)
        alone = [t[:, :, part].detach().clone().requires_grad_(True) for t in (q, k, v)]
        expected = attention(*alone, mask=extra, backend="reference")
        expected.backward(dout[:, :, part])
        torch.testing.assert_close(out[:, :, part], expected, atol=tolerance, rtol=0)
        for leaf, single in zip(leaves if backward else [], alone, strict=False):
            torch.testing.assert_close(leaf.grad[:, :, part], single.grad, atol=tolerance, rtol=0)
        start += length


def test_boundaries_and_indices_are_the_same_mask(device):
    shape = AttentionShape(1, 2, 9, 9, device)
    by_bounds = bind_mask(masks.documents(cu_seqlens=[0, 2, 2, 7, 9]), False, shape).dense(torch.float32)[0]
    ids = torch.tensor([[0, 0, 2, 2, 2, 2, 2, 3, 3]], device=device)  # an empty document numbers past itself
    by_ids = bind_mask(masks.documents(ids), False, shape).dense(torch.float32)[0]
    assert torch.equal(by_bounds.expand(1, 2, 9, 9), by_ids.expand(1, 2, 9, 9))
    assert int(by_ids.sum()) == 4 + 25 + 4


def test_a_query_after_its_keys_reads_its_documents_at_its_aligned_position(device):
    # decoding the last 2 positions of a packed row of 6 (bottom-right): each query sees its own document's keys
    ids = torch.tensor([[0, 0, 0, 1, 1, 1]], device=device)
    keep = bind_mask(masks.documents(ids) & masks.causal(), False, AttentionShape(1, 1, 2, 6, device)).dense(
        torch.float32
    )[0]
    assert keep[0, 0].int().tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    # more queries than keys: the rows before the first key have no document, and see nothing
    shape = AttentionShape(1, 1, 4, 2, device)
    bound = bind_mask(masks.documents(torch.tensor([[5, 5]], device=device)), False, shape)
    assert bound.dense(torch.float32)[0][0, 0].int().tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]
    assert bound.may_empty_rows()


def test_the_blocks_between_documents_are_skipped_unbuilt():
    # four documents of 8 over 4 x 4 tiles: tiles inside a document are full, the others empty; the tiled kernel
    # visits only the tiles inside documents, builds a keep mask for none of them, and with causal only for the
    # tiles on the diagonal
    ids = (torch.arange(32) // 8)[None]
    states = bind_mask(masks.documents(ids), False, AttentionShape(1, 2, 32, 32, torch.device("cpu"))).block_states(4)
    inside = (torch.arange(8) // 2)[:, None] == (torch.arange(8) // 2)[None, :]
    assert torch.equal(states, torch.where(inside, STATE_FULL, STATE_EMPTY).to(torch.int8))
    visited: list[tuple[int, int, bool]] = []  # (first row, first key, whether a keep mask was built)
    block = masks.BoundMask.block

    def recording(self, rows, cols, *args, **kwargs):
        keep, bias = block(self, rows, cols, *args, **kwargs)
        visited.append((rows.start, cols.start, keep is not None))
        return keep, bias

    q = k = v = torch.randn(1, 2, 32, 8, dtype=torch.float64)
    with tiny_blocks(4, 4), patch.object(masks.BoundMask, "block", recording):
        attention(q, k, v, mask=masks.documents(ids), backend="tiled")
        assert all(r // 8 == c // 8 for r, c, _ in visited) and not any(built for *_, built in visited)
        assert len({(r, c) for r, c, _ in visited}) == 16  # 4 documents x 2 x 2 tiles
        visited.clear()
        attention(q, k, v, mask=masks.documents(ids), causal=True, backend="tiled")
        assert {(r, c) for r, c, built in visited if built} == {(r, r) for r in range(0, 32, 4)}


@pytest.mark.parametrize(
    "arguments, kind, fragment",
    [
        ({}, TypeError, "documents: expected ids or cu_seqlens, one of them, got neither"),
        ({"ids": [[0, 0]], "cu_seqlens": [0, 2]}, TypeError, "got both"),
        ({"ids": [[0.0, 1.0]]}, TypeError, "documents(ids): expected a (b, j) integer tensor"),
        ({"ids": [0, 1]}, ValueError, "documents(ids): expected a (b, j) integer tensor"),
        ({"cu_seqlens": [1, 4]}, ValueError, "non-decreasing boundaries starting at 0"),
        ({"cu_seqlens": [0, 3, 2, 4]}, ValueError, "non-decreasing boundaries starting at 0"),
        ({"cu_seqlens": [0]}, ValueError, "at least two boundaries"),
        ({"ids": [[0, 0]], "align": "left"}, ValueError, "documents(align=...)"),
    ],
)
def test_bad_documents_are_named(arguments, kind, fragment):
    with pytest.raises(kind) as raised:
        masks.documents(**arguments)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)


@pytest.mark.parametrize(
    "mask, b, fragment",
    [
        (masks.documents(cu_seqlens=[0, 3, 5]), 1, "a last boundary equal to the key length j = 6"),
        (masks.documents(cu_seqlens=[0, 3, 6]), 2, "a call of batch 1 (one packed row)"),
        (masks.documents(torch.zeros(1, 5, dtype=torch.long)), 1, "shape (b, j) = (1, 6)"),
    ],
)
def test_documents_that_do_not_fit_the_call_are_named(mask, b, fragment):
    q = k = v = torch.randn(b, 2, 6, 4)
    with pytest.raises(ValueError) as raised:
        attention(q, k, v, mask=mask)
    assert is_input_error(raised.value, ValueError) and fragment in str(raised.value)


def test_document_positions_restart_at_each_document_without_a_host_read():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [7, 7, 7, 7, 7, 7]])
    assert masks.document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    with FakeTensorMode():  # ops only: a read of the values would raise
        assert masks.document_positions(torch.randint(0, 3, (2, 9)).sort(-1).values).shape == (2, 9)


@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "plain"])
def test_the_layer_on_a_packed_row_equals_each_document_alone(rotary, device):
    from multihead import MultiHeadAttention

    layer = MultiHeadAttention(24, 6, num_kv_heads=2, rotary=rotary, dtype=torch.float64, device=device)
    lengths = [4, 1, 6]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None].to(device)
    x = torch.randn(1, 11, 24, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    positions = masks.document_positions(ids) if rotary else None
    packed, _ = layer(x, mask=masks.documents(ids), causal=True, positions=positions)
    start = 0
    for length in lengths:
        alone, _ = layer(x[:, start : start + length], causal=True)
        torch.testing.assert_close(packed[:, start : start + length], alone, atol=1e-12, rtol=0)
        start += length


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_a_decoder_trains_on_packed_documents_as_on_each_alone(positions, device):
    from multihead.lab.models.decoder import Decoder, DecoderConfig

    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=30, max_positions=8, hidden=32, heads=4, kv_heads=2, mlp=48, positions=positions)
    model = Decoder(config).to(device=device, dtype=torch.float64)
    lengths = [5, 1, 8]  # each within the 8 learned positions, the row of 14 past them
    tokens = torch.randint(0, 30, (1, 14), generator=torch.Generator().manual_seed(1)).to(device)
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None].to(device)
    packed = model(tokens, document_ids=documents)
    packed.sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    start, total = 0, 0.0
    for length in lengths:
        alone = model(tokens[:, start : start + length])
        torch.testing.assert_close(packed[:, start : start + length], alone, atol=1e-12, rtol=0)
        total = total + alone.sum()
        start += length
    total.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-10, rtol=0, msg=name)


def test_packed_decoder_arguments_are_named():
    from multihead.lab.models.decoder import Decoder, DecoderConfig
    from multihead.positional import LearnedPositions

    model = Decoder(DecoderConfig(vocab_size=30, max_positions=8, hidden=32, heads=4, mlp=None))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError) as raised:
        model(tokens, document_ids=torch.zeros(1, 4, dtype=torch.long), cache=model.new_cache(1))
    assert is_input_error(raised.value, ValueError) and "document_ids: expected no cache beside it" in str(raised.value)
    with pytest.raises(ValueError) as raised:
        model(tokens, document_ids=torch.zeros(1, 5, dtype=torch.long))
    assert "document_ids: expected a tensor of input_ids' shape (1, 4)" in str(raised.value)
    with pytest.raises(ValueError) as raised:
        LearnedPositions(4, 6)(torch.zeros(1, 3, 6), positions=torch.tensor([0, 1, 4]))
    assert is_input_error(raised.value, ValueError) and "positions: expected positions in [0, 4)" in str(raised.value)
