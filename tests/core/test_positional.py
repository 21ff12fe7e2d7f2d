"""Positions: rotary (RoPE), fixed sinusoidal and learned absolute tables.

Rotary is checked against its defining property (scores depend only on m - n) and
against an independent complex-number formulation; the sinusoidal table against the
paper's formula evaluated with ``math`` and its rotation property; the learned table by
its values, gradients and state. Sizes are pairwise distinct (b=2, h=6, g=3, i=5, j=7,
d=8; b=2, n=5, dim=6, max_len=11) so that a swapped axis cannot pass.
"""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead import positional
from multihead.positional import LearnedPositions, RotaryEmbedding, SinusoidalPositions
from support import is_input_error, randn

FLOATING = "a floating dtype (float16, bfloat16, float32 or float64)"  # what an integer input is told

# sizes by axis: b, h, g, i (Q_LEN: query positions), j, d
B, H, G, Q_LEN, J, D = 2, 6, 3, 5, 7, 8
N, DIM, MAX_LEN = 5, 6, 11


def complex_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """An independent RoPE: the pair (x[m], x[m + d/2]) as the complex number x[m] + i x[m + d/2],
    multiplied by exp(i * pos * base^(-2m/d)). x (..., n, d) float64, positions (n,) or broadcastable, on x's
    device or the CPU (moved)."""
    d = x.shape[-1]
    half = d // 2
    pairs = torch.stack((x[..., :half], x[..., half:]), dim=-1).contiguous()  # (..., n, d/2, 2)
    z = torch.view_as_complex(pairs)  # (..., n, d/2)
    theta = torch.tensor([base ** (-2.0 * m / d) for m in range(half)], dtype=torch.float64, device=x.device)  # (d/2,)
    angles = positions.to(x.device).double()[..., None] * theta  # (..., n, d/2)
    rotated = torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles))  # (..., n, d/2, 2)
    return torch.cat((rotated[..., 0], rotated[..., 1]), dim=-1)  # (..., n, d): back to the halves layout


# =========================================================================== rotary


@pytest.mark.portable
def test_rotary_scores_depend_only_on_relative_position(device):
    rope = RotaryEmbedding(D)
    q, k = randn(D, seed=1, device=device), randn(D, seed=2, device=device)
    differences = [-4, 0, 3, 11]
    query_positions = [11, 20, 137, 1000]
    m = torch.tensor([p for _ in differences for p in query_positions], device=device)  # (16,)
    n = torch.tensor([p - diff for diff in differences for p in query_positions], device=device)
    rq = rope.rotate(q.expand(1, 1, len(m), D), m)  # (1, 1, 16, d): q at positions m
    rk = rope.rotate(k.expand(1, 1, len(n), D), n)  # k at positions n
    scores = (rq * rk).sum(-1).reshape(len(differences), len(query_positions))  # (difference, m)
    # same difference -> same score, to 1e-10
    assert (scores - scores[:, :1]).abs().max().item() < 1e-10
    # ... and equal to the score with the key at 0 and the query at the difference
    for row, diff in enumerate(differences):
        if diff >= 0:
            at_zero = (rope.rotate(q.expand(1, 1, 1, D), diff) * rope.rotate(k.expand(1, 1, 1, D), 0)).sum()
            assert abs(scores[row, 0].item() - at_zero.item()) < 1e-10
    # difference 0 leaves the score untouched; other differences change it (the rotation is not the identity)
    assert abs(scores[1, 0].item() - torch.dot(q, k).item()) < 1e-10
    firsts = scores[:, 0]
    assert (firsts[:, None] - firsts[None, :]).abs().add(torch.eye(len(differences), device=device)).min().item() > 1e-3


@pytest.mark.portable
def test_rotary_preserves_the_norm_of_every_rotated_pair(device):
    rope = RotaryEmbedding(D)
    x = randn(B, H, Q_LEN, D, device=device)
    out = rope.rotate(x, 9)
    half = D // 2
    pair_norms = lambda t: t[..., :half] ** 2 + t[..., half:] ** 2  # noqa: E731  (b, h, i, d/2)
    torch.testing.assert_close(pair_norms(out), pair_norms(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=0, atol=1e-12)
    assert (out - x).abs().max() > 0.1  # it did rotate


@pytest.mark.portable
def test_rotary_position_zero_is_the_identity(device):
    rope = RotaryEmbedding(D)
    x = randn(B, H, Q_LEN, D, device=device)
    assert torch.equal(rope.rotate(x[:, :, :1], 0), x[:, :, :1])
    assert torch.equal(rope.rotate(x, torch.zeros(Q_LEN, dtype=torch.long, device=device)), x)
    assert not torch.equal(rope.rotate(x, 0)[:, :, 1:], x[:, :, 1:])


@pytest.mark.portable
def test_rotary_uses_the_rotate_half_layout(device):
    # head_dim 4, base 100: pair 0 = (x[0], x[2]) turns 1 rad per position, pair 1 = (x[1], x[3]) 0.1 rad
    rope = RotaryEmbedding(4, base=100.0)
    eye = torch.eye(4, dtype=torch.float64, device=device)[None]  # (1, 4, 4): unit vectors as 4 rows at one head
    at_one = rope.rotate(eye, torch.ones(4, dtype=torch.long, device=device))[0]  # every row at position 1
    c0, s0, c1, s1 = math.cos(1.0), math.sin(1.0), math.cos(0.1), math.sin(0.1)
    expected = torch.tensor(
        [[c0, 0, s0, 0], [0, c1, 0, s1], [-s0, 0, c0, 0], [0, -s1, 0, c1]], dtype=torch.float64, device=device
    )
    torch.testing.assert_close(at_one, expected, rtol=0, atol=1e-14)


@pytest.mark.portable
def test_rotary_matches_the_complex_formulation(device):
    rope = RotaryEmbedding(D)
    x = randn(B, H, Q_LEN, D, device=device)
    torch.testing.assert_close(rope.rotate(x, 13), complex_rope(x, torch.arange(13, 13 + Q_LEN)), rtol=0, atol=1e-10)
    scattered = torch.tensor([3, 0, 9, 9, 250], device=device)  # any order, repeats allowed
    torch.testing.assert_close(rope.rotate(x, scattered), complex_rope(x, scattered), rtol=0, atol=1e-10)


@pytest.mark.portable
@settings(max_examples=40, deadline=None)
@given(
    half=st.integers(1, 8),
    n=st.integers(0, 9),
    offset=st.integers(0, 500),
    b=st.integers(1, 3),
    h=st.integers(1, 4),
    base=st.sampled_from([10000.0, 500000.0, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_rotary_property_offsets_lengths_and_head_dims(half, n, offset, b, h, base, seed, device):
    d = 2 * half
    rope = RotaryEmbedding(d, base=base)
    x = randn(b, h, n, d, seed=seed, device=device)
    positions = torch.arange(offset, offset + n, device=device)
    expected = complex_rope(x, positions, base)
    torch.testing.assert_close(rope.rotate(x, offset), expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(rope.rotate(x, positions), expected, rtol=0, atol=1e-10)
    per_row = positions + 3 * torch.arange(b, device=device)[:, None]  # (b, n): each batch row shifted differently
    torch.testing.assert_close(rope.rotate(x, per_row), complex_rope(x, per_row[:, None], base), rtol=0, atol=1e-10)
    torch.testing.assert_close(rope.rotate(x[0], offset), expected[0], rtol=0, atol=1e-10)  # unbatched (h, n, d)


@pytest.mark.portable
def test_rotary_offset_equals_explicit_positions_and_per_row_positions(device):
    rope = RotaryEmbedding(D)
    x = randn(B, H, Q_LEN, D, device=device)
    # positions in a CPU tensor are read on the host and index the same tables as an offset: equal, on any device
    assert torch.equal(rope.rotate(x, 4), rope.rotate(x, torch.arange(4, 4 + Q_LEN)))
    assert torch.equal(rope.rotate(x, 4), rope.rotate(x, torch.arange(4, 4 + Q_LEN, dtype=torch.int32)))
    per_row = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])  # (b, n): e.g. a left-padded second row
    out = rope.rotate(x, per_row)
    assert torch.equal(out[0], rope.rotate(x[0], 0))
    assert torch.equal(out[1], rope.rotate(x[1], 7))
    # positions on x's device are never read: their angles are computed for the call, to float64 rounding
    on_device = rope.rotate(x, torch.arange(4, 4 + Q_LEN, device=device))
    torch.testing.assert_close(on_device, rope.rotate(x, 4), rtol=0, atol=1e-13)
    torch.testing.assert_close(rope.rotate(x, per_row.to(device)), out, rtol=0, atol=1e-13)


@pytest.mark.portable
def test_rotary_whole_sequence_equals_pieces_at_their_offsets(device):
    x = randn(B, H, J, D, device=device)
    whole = RotaryEmbedding(D).rotate(x, 0)
    rope = RotaryEmbedding(D)  # fresh cache: grows from 4 positions to 7
    pieces = torch.cat([rope.rotate(x[:, :, :4], 0), rope.rotate(x[:, :, 4:], 4)], dim=2)
    torch.testing.assert_close(pieces, whole, rtol=0, atol=1e-13)
    # cache-style through forward: prefill 4 tokens, then 3 new tokens at offset 4
    q = randn(B, H, J, D, seed=3, device=device)
    rope_steps = RotaryEmbedding(D)
    q_a, k_a = rope_steps(q[:, :, :4], x[:, :, :4])
    q_b, k_b = rope_steps(q[:, :, 4:], x[:, :, 4:], offset=4)
    q_all, k_all = RotaryEmbedding(D)(q, x)
    torch.testing.assert_close(torch.cat([q_a, q_b], 2), q_all, rtol=0, atol=1e-13)
    torch.testing.assert_close(torch.cat([k_a, k_b], 2), k_all, rtol=0, atol=1e-13)
    # a cache first built far out still serves the start
    rope_far = RotaryEmbedding(D)
    rope_far.rotate(x, 300)
    torch.testing.assert_close(rope_far.rotate(x, 0), whole, rtol=0, atol=1e-13)


@pytest.mark.portable
def test_rotary_forward_aligns_queries_bottom_right_with_grouped_keys(device):
    rope = RotaryEmbedding(D)
    q, k = (
        randn(B, H, 2, D, seed=4, device=device),
        randn(B, G, J, D, seed=5, device=device),
    )  # 2 new queries, 7 keys, h=6, g=3
    q_rot, k_rot = rope(q, k, offset=3)
    # keys at 3 .. 9; the queries at the last two key positions, 8 and 9
    torch.testing.assert_close(k_rot, complex_rope(k, torch.arange(3, 3 + J)), rtol=0, atol=1e-10)
    torch.testing.assert_close(q_rot, complex_rope(q, torch.arange(8, 10)), rtol=0, atol=1e-10)
    # the last query and the last key share a position: their score is the unrotated one
    same_position = (q_rot[:, 0, -1] * k_rot[:, 0, -1]).sum(-1)
    torch.testing.assert_close(same_position, (q[:, 0, -1] * k[:, 0, -1]).sum(-1), rtol=0, atol=1e-12)
    # unbatched (h, i, d) and (g, j, d) give the batched result
    q0, k0 = rope(q[1], k[1], offset=3)
    assert torch.equal(q0, q_rot[1]) and torch.equal(k0, k_rot[1])


@pytest.mark.portable
@pytest.mark.parametrize("offset", [0, 100_000])
def test_rotary_float32_and_bfloat16_are_close_to_float64(offset, device):
    rope = RotaryEmbedding(D)
    x64 = randn(B, H, Q_LEN, D, seed=6, device=device) * 3
    for dtype in (torch.float32, torch.bfloat16):
        x = x64.to(dtype)
        out = rope.rotate(x, offset)
        assert out.dtype == dtype
        ref = complex_rope(x.double(), torch.arange(offset, offset + Q_LEN))  # the same (rounded) input, exactly
        eps = torch.finfo(dtype).eps
        error = (out.double() - ref).abs()
        # float32: a few ulps (tables computed in float64, so large positions keep their precision);
        # bfloat16: computed in float32, one rounding of the output
        bound = 4 * eps * x.double().abs().amax(-1, keepdim=True) + (eps / 2) * ref.abs()
        assert (error <= bound).all(), f"{dtype}: max error {error.max().item():.3g}"
    # float64 in, float64 tables
    torch.testing.assert_close(
        rope.rotate(x64, offset), complex_rope(x64, torch.arange(offset, offset + Q_LEN)), rtol=0, atol=1e-9
    )


@pytest.mark.portable
def test_rotary_tables_are_buffers_outside_the_state_dict_and_survive_module_casts(device):
    rope = RotaryEmbedding(D)
    x = randn(B, H, Q_LEN, D, seed=7, device=device).float()
    reference = complex_rope(x.double(), torch.arange(40, 40 + Q_LEN))
    rope.rotate(x, 40)
    assert rope.state_dict() == {} and list(rope.parameters()) == []
    assert sum(buf.numel() for buf in rope.buffers()) >= 2 * 45 * D // 2  # cached, and moved by .to(device)
    RotaryEmbedding(D).load_state_dict(rope.state_dict())  # strict load of an empty state works
    for cast in (lambda m: m.half(), lambda m: m.double(), lambda m: m.to(torch.bfloat16)):
        cast(rope)  # casts the cached tables; the next call must rebuild them in float32
        error = (rope.rotate(x, 40).double() - reference).abs().max().item()
        assert error < 1e-5


# =========================================================================== sinusoidal


@pytest.mark.portable
def test_sinusoidal_values_follow_the_paper(device):
    pe = SinusoidalPositions(DIM)
    table = pe.table(1001, dtype=torch.float64, device=device).cpu()  # (1001, 6), read back once
    for pos, m in [(0, 0), (1, 0), (3, 1), (7, 2), (50, 1), (1000, 2), (999, 0)]:
        angle = pos / 10000.0 ** (2 * m / DIM)
        assert abs(table[pos, 2 * m].item() - math.sin(angle)) < 1e-12, (pos, m)
        assert abs(table[pos, 2 * m + 1].item() - math.cos(angle)) < 1e-12, (pos, m)
    base_100 = SinusoidalPositions(4, base=100.0).table(8, dtype=torch.float64, device=device).cpu()
    assert abs(base_100[5, 2].item() - math.sin(5 / 100.0 ** (2 / 4))) < 1e-12
    assert abs(base_100[5, 3].item() - math.cos(5 / 100.0 ** (2 / 4))) < 1e-12


@pytest.mark.portable
@pytest.mark.parametrize("shift", [1, 5, 17])
def test_sinusoidal_shift_is_a_fixed_rotation_of_each_pair(shift, device):
    dim, length = 8, 60
    table = SinusoidalPositions(dim).table(length + shift, dtype=torch.float64, device=device)  # (length + shift, dim)
    for m in range(dim // 2):
        omega = 10000.0 ** (-2 * m / dim)
        c, s = math.cos(shift * omega), math.sin(shift * omega)
        rotation = torch.tensor(
            [[c, s], [-s, c]], dtype=torch.float64, device=device
        )  # (sin, cos)(p) -> (sin, cos)(p + shift)
        pairs = table[:, 2 * m : 2 * m + 2]  # (length + shift, 2): (sin, cos) of pair m at each position
        torch.testing.assert_close(pairs[:length] @ rotation.T, pairs[shift:], rtol=0, atol=1e-10)


@pytest.mark.portable
def test_sinusoidal_forward_adds_the_table_at_the_offset(device):
    pe = SinusoidalPositions(DIM)
    x = randn(B, N + 4, DIM, device=device)
    full = pe(x)
    torch.testing.assert_close(full, x + pe.table(N + 4, dtype=torch.float64, device=device)[None], rtol=0, atol=1e-15)
    # cache style: the last N rows alone, at offset 4, are the same rows of the full call
    torch.testing.assert_close(pe(x[:, 4:], offset=4), full[:, 4:], rtol=0, atol=1e-15)
    torch.testing.assert_close(pe.table(N, offset=4, device=device), pe.table(N + 4, device=device)[4:], rtol=0, atol=0)
    assert torch.equal(pe(x[1]), full[1])  # unbatched (n, dim)
    assert not torch.allclose(pe(x, offset=1), full)  # the offset matters


@pytest.mark.portable
def test_sinusoidal_max_len_bounds_and_lengths_up_to_it_work(device):
    pe = SinusoidalPositions(DIM, max_len=MAX_LEN)
    x = randn(B, N, DIM, device=device)
    out = pe(x, offset=MAX_LEN - N)  # the last allowed positions
    table = SinusoidalPositions(DIM).table(MAX_LEN, dtype=torch.float64, device=device)
    torch.testing.assert_close(out, x + table[MAX_LEN - N :], rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match=r"offset \+ length <= max_len = 11, got offset 7 \+ length 5 = 12"):
        pe(x, offset=MAX_LEN - N + 1)


@pytest.mark.portable
def test_sinusoidal_has_no_state_keeps_dtype_and_precision(device):
    pe = SinusoidalPositions(DIM)
    assert list(pe.parameters()) == [] and pe.state_dict() == {}
    x64 = randn(B, N, DIM, seed=8, device=device)
    ref = x64 + SinusoidalPositions(DIM).table(N, offset=3000, dtype=torch.float64, device=device)
    for dtype in (torch.float32, torch.bfloat16):
        out = pe(x64.to(dtype), offset=3000)
        assert out.dtype == dtype
        exact = x64.to(dtype).double() + SinusoidalPositions(DIM).table(
            N, offset=3000, dtype=torch.float64, device=device
        )
        eps = torch.finfo(dtype).eps
        assert ((out.double() - exact).abs() <= eps * exact.abs() + 1e-7).all(), dtype
    pe.half()  # a module cast does not leave a half-precision table behind
    assert (pe(x64.float(), offset=3000).double() - ref).abs().max().item() < 1e-5


@pytest.mark.portable
@settings(max_examples=30, deadline=None)
@given(half=st.integers(1, 6), n=st.integers(0, 7), offset=st.integers(0, 400))
def test_sinusoidal_property_against_math(half, n, offset, device):
    dim = 2 * half
    got = SinusoidalPositions(dim).table(n, offset=offset, dtype=torch.float64, device=device)
    assert got.shape == (n, dim) and got.device == device
    got = got.cpu()  # read back once
    for row in range(n):
        for m in range(half):
            angle = (offset + row) / 10000.0 ** (2 * m / dim)
            assert abs(got[row, 2 * m].item() - math.sin(angle)) < 1e-11
            assert abs(got[row, 2 * m + 1].item() - math.cos(angle)) < 1e-11


# =========================================================================== learned


@pytest.mark.portable
def test_learned_forward_adds_the_rows_at_the_offset(device):
    pos = LearnedPositions(MAX_LEN, DIM, device=device)
    x = randn(B, N, DIM, device=device).float()
    assert torch.equal(pos(x, offset=3), x + pos.weight[3 : 3 + N])
    assert torch.equal(pos(x[0], offset=6), x[0] + pos.weight[6 : 6 + N])  # unbatched, last allowed offset
    assert not torch.equal(pos(x, offset=3), pos(x, offset=2))


@pytest.mark.portable
def test_learned_gradient_reaches_only_the_used_rows(device):
    pos = LearnedPositions(MAX_LEN, DIM, dtype=torch.float64, device=device)
    x = randn(B, N, DIM, device=device).requires_grad_()
    upstream = randn(B, N, DIM, seed=9, device=device)
    (pos(x, offset=4) * upstream).sum().backward()
    grad = pos.weight.grad  # (max_len, dim)
    torch.testing.assert_close(grad[4 : 4 + N], upstream.sum(0), rtol=0, atol=1e-14)
    assert torch.count_nonzero(grad[:4]) == 0 and torch.count_nonzero(grad[4 + N :]) == 0
    torch.testing.assert_close(x.grad, upstream, rtol=0, atol=0)


@pytest.mark.portable
def test_learned_table_is_state_and_initialised_like_bert(device):
    torch.manual_seed(0)
    pos = LearnedPositions(MAX_LEN, DIM, device=device)
    state = pos.state_dict()
    assert list(state) == ["weight"] and state["weight"].shape == (MAX_LEN, DIM)
    other = LearnedPositions(MAX_LEN, DIM, device=device)
    x = randn(B, N, DIM, device=device).float()
    assert not torch.equal(other(x), pos(x))
    other.load_state_dict(state)
    assert torch.equal(other(x), pos(x))
    big = LearnedPositions(64, 48, device=device).weight.detach()  # 3072 draws of N(0, 0.02^2)
    assert 0.018 < big.std().item() < 0.022 and abs(big.mean().item()) < 0.002


@pytest.mark.portable
def test_learned_keeps_the_input_dtype(device):
    pos = LearnedPositions(MAX_LEN, DIM, device=device)
    x = randn(B, N, DIM, device=device).bfloat16()
    out = pos(x, offset=1)
    assert out.dtype == torch.bfloat16
    exact = x.double() + pos.weight[1 : 1 + N].double()
    assert ((out.double() - exact).abs() <= torch.finfo(torch.bfloat16).eps * exact.abs()).all()


# =========================================================================== docstrings


def test_docstring_examples_run():
    result = doctest.testmod(positional, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 15 and result.failed == 0


# =========================================================================== bad inputs

_rope = RotaryEmbedding(D)
_sin = SinusoidalPositions(DIM, max_len=MAX_LEN)
_learned = LearnedPositions(MAX_LEN, DIM)
Q, K, X = randn(B, H, Q_LEN, D).float(), randn(B, G, J, D).float(), randn(B, N, DIM).float()

BAD = [
    # ---- RotaryEmbedding(head_dim, base)
    pytest.param(
        lambda: RotaryEmbedding(7),
        ValueError,
        "head_dim: expected a positive even int (sin/cos come in pairs), got 7. Fix: use an even size, e.g. head_dim=8",
        id="rope-odd-head-dim",
    ),
    pytest.param(lambda: RotaryEmbedding(0), ValueError, "head_dim: expected a positive even int", id="rope-zero"),
    pytest.param(
        lambda: RotaryEmbedding(-4),
        ValueError,
        "head_dim: expected a positive even int (sin/cos come in pairs), got -4",
        id="rope-negative",
    ),
    pytest.param(
        lambda: RotaryEmbedding(8.0),
        TypeError,
        "head_dim: expected a positive even int (sin/cos come in pairs), got float 8.0",
        id="rope-float-head-dim",
    ),
    pytest.param(lambda: RotaryEmbedding(True), TypeError, "got bool True", id="rope-bool-head-dim"),
    pytest.param(
        lambda: RotaryEmbedding(D, base=0.0),
        ValueError,
        "base: expected a positive finite float, got 0.0",
        id="rope-base-zero",
    ),
    pytest.param(
        lambda: RotaryEmbedding(D, base=-2.0),
        ValueError,
        "base: expected a positive finite float",
        id="rope-base-negative",
    ),
    pytest.param(
        lambda: RotaryEmbedding(D, base=math.inf),
        ValueError,
        "base: expected a positive finite float, got inf",
        id="rope-base-inf",
    ),
    pytest.param(lambda: RotaryEmbedding(D, base=math.nan), ValueError, "got nan", id="rope-base-nan"),
    pytest.param(
        lambda: RotaryEmbedding(D, base="10000"),
        TypeError,
        "base: expected a positive finite float, got str '10000'",
        id="rope-base-str",
    ),
    # ---- RotaryEmbedding.forward(q, k, offset)
    pytest.param(
        lambda: _rope(Q[..., :4], K),
        ValueError,
        "q: expected last dim head_dim = 8, got shape (2, 6, 5, 4). Fix: construct the module with head_dim=4",
        id="rope-q-head-dim",
    ),
    pytest.param(
        lambda: _rope(Q, K[..., :6]),
        ValueError,
        "k: expected last dim head_dim = 8, got shape (2, 3, 7, 6)",
        id="rope-k-head-dim",
    ),
    pytest.param(
        lambda: _rope(Q[0, 0], K),
        ValueError,
        "q: expected shape (b, h, i, d), or unbatched (h, i, d), got shape (5, 8)",
        id="rope-q-2d",
    ),
    pytest.param(
        lambda: _rope(Q, K[None]),
        ValueError,
        "k: expected shape (b, g, j, d), or unbatched (g, j, d), got shape (1, 2, 3, 7, 8)",
        id="rope-k-5d",
    ),
    pytest.param(lambda: _rope(Q.long(), K), TypeError, f"q: expected {FLOATING}, got torch.int64", id="rope-q-int"),
    pytest.param(lambda: _rope(Q.tolist(), K), TypeError, "q: expected a torch.Tensor, got list", id="rope-q-list"),
    pytest.param(
        lambda: _rope(Q, K, offset=-1),
        ValueError,
        "offset: expected a non-negative int (the position of the first row), got -1",
        id="rope-offset-negative",
    ),
    pytest.param(
        lambda: _rope(Q, K, offset=1.5), TypeError, "offset: expected a non-negative int", id="rope-offset-float"
    ),
    pytest.param(
        lambda: _rope(Q, K, offset=torch.tensor(3)),
        TypeError,
        "offset: expected a non-negative int (the position of the first row), got tensor of shape ()",
        id="rope-offset-tensor",
    ),
    pytest.param(
        lambda: _rope(randn(B, H, 8, D).float(), K),
        ValueError,
        "q: expected at most j = 7 query positions "
        "(queries are aligned bottom-right with the keys), got i = 8. Fix: rotate q and k separately",
        id="rope-more-queries-than-keys",
    ),
    # ---- RotaryEmbedding.rotate(x, positions)
    pytest.param(
        lambda: _rope.rotate(X[0]),
        ValueError,
        "x: expected shape (b, h, n, d), or unbatched (h, n, d), got shape (5, 6)",
        id="rotate-x-2d",
    ),
    pytest.param(
        lambda: _rope.rotate(X),
        ValueError,
        "x: expected last dim head_dim = 8, got shape (2, 5, 6). Fix: "
        "construct the module with head_dim=6, or pass a tensor laid out as (b, h, n, d)",
        id="rotate-x-layer-input",
    ),
    pytest.param(
        lambda: _rope.rotate(Q, torch.arange(Q_LEN).float()),
        TypeError,
        "positions: expected an int or an "
        "integer tensor of positions, got tensor of shape (5,) and dtype torch.float32. Fix: convert with "
        "positions.long()",
        id="rotate-float-positions",
    ),
    pytest.param(
        lambda: _rope.rotate(Q, torch.ones(Q_LEN, dtype=torch.bool)),
        TypeError,
        "positions: expected an int or an integer tensor",
        id="rotate-bool-positions",
    ),
    pytest.param(
        lambda: _rope.rotate(Q, torch.arange(4)),
        ValueError,
        "positions: expected shape (n,) = (5,) or (b, n) = (2, 5), one per row of x, got shape (4,)",
        id="rotate-positions-too-short",
    ),
    pytest.param(
        lambda: _rope.rotate(Q, torch.zeros(3, Q_LEN, dtype=torch.long)),
        ValueError,
        "positions: expected shape (n,) = (5,) or (b, n) = (2, 5), one per row of x, got shape (3, 5)",
        id="rotate-positions-wrong-batch",
    ),
    pytest.param(
        lambda: _rope.rotate(Q, torch.zeros(Q_LEN, B, dtype=torch.long)),
        ValueError,
        "got shape (5, 2)",
        id="rotate-positions-transposed",
    ),
    pytest.param(
        lambda: _rope.rotate(Q[0], torch.zeros(B, Q_LEN, dtype=torch.long)),
        ValueError,
        "positions: expected shape (n,) = (5,) (x is unbatched (h, n, d)), one per row of x, got shape (2, 5)",
        id="rotate-2d-positions-unbatched-x",
    ),
    pytest.param(
        lambda: _rope.rotate(Q, torch.zeros(1, B, Q_LEN, dtype=torch.long)),
        ValueError,
        "got shape (1, 2, 5)",
        id="rotate-3d-positions",
    ),
    pytest.param(
        lambda: _rope.rotate(Q, torch.tensor([0, 1, -2, 3, 4])),
        ValueError,
        "positions: expected non-negative positions, got a minimum of -2",
        id="rotate-negative-positions",
    ),
    pytest.param(
        lambda: _rope.rotate(Q, -3),
        ValueError,
        "positions: expected a non-negative int (the position of the first row), got -3",
        id="rotate-negative-offset",
    ),
    pytest.param(lambda: _rope.rotate(Q, "0"), TypeError, "positions: expected a non-negative int", id="rotate-str"),
    # ---- SinusoidalPositions
    pytest.param(
        lambda: SinusoidalPositions(5),
        ValueError,
        "dim: expected a positive even int (sin/cos come in pairs), got 5. Fix: use an even size, e.g. dim=6",
        id="sin-odd-dim",
    ),
    pytest.param(lambda: SinusoidalPositions(0), ValueError, "dim: expected a positive even int", id="sin-zero-dim"),
    pytest.param(
        lambda: SinusoidalPositions(6.0),
        TypeError,
        "dim: expected a positive even int (sin/cos come in pairs), got float 6.0",
        id="sin-float-dim",
    ),
    pytest.param(
        lambda: SinusoidalPositions(DIM, max_len=0),
        ValueError,
        "max_len: expected a positive int or None, got 0",
        id="sin-max-len-zero",
    ),
    pytest.param(
        lambda: SinusoidalPositions(DIM, max_len=5.5),
        TypeError,
        "max_len: expected a positive int or None, got float 5.5",
        id="sin-max-len-float",
    ),
    pytest.param(
        lambda: SinusoidalPositions(DIM, base=-1.0),
        ValueError,
        "base: expected a positive finite float",
        id="sin-base-negative",
    ),
    pytest.param(
        lambda: _sin(X[..., :4]),
        ValueError,
        "x: expected last dim dim = 6, got shape (2, 5, 4). Fix: construct the module with dim=4",
        id="sin-wrong-dim",
    ),
    pytest.param(
        lambda: _sin(Q),
        ValueError,
        "x: expected shape (b, n, dim), or unbatched (n, dim), got shape (2, 6, 5, 8)",
        id="sin-per-head-input",
    ),
    pytest.param(lambda: _sin(X.int()), TypeError, f"x: expected {FLOATING}, got torch.int32", id="sin-int-x"),
    pytest.param(
        lambda: _sin(X, offset=-2), ValueError, "offset: expected a non-negative int", id="sin-offset-negative"
    ),
    pytest.param(
        lambda: _sin(X, offset=7),
        ValueError,
        "x: expected offset + length <= max_len = 11, got offset 7 + "
        "length 5 = 12. Fix: truncate the sequence so that offset + length <= 11, or construct "
        "SinusoidalPositions with max_len >= 12",
        id="sin-past-max-len",
    ),
    pytest.param(
        lambda: _sin.table(12),
        ValueError,
        "n: expected offset + length <= max_len = 11, got offset 0 + length 12 = 12",
        id="sin-table-past-max-len",
    ),
    pytest.param(
        lambda: _sin.table(-1),
        ValueError,
        "n: expected a non-negative int (number of positions), got -1",
        id="sin-table-negative-n",
    ),
    pytest.param(
        lambda: _sin.table(3, dtype=torch.int64),
        ValueError,
        "dtype: expected a real floating dtype",
        id="sin-table-int-dtype",
    ),
    pytest.param(
        lambda: _sin.table(3, dtype="float32"), TypeError, "dtype: expected a torch.dtype", id="sin-table-str-dtype"
    ),
    pytest.param(
        lambda: _sin.table(3, device="nope"),
        ValueError,
        "device: expected a device this torch can use",
        id="sin-table-bad-device",
    ),
    pytest.param(
        lambda: LearnedPositions(2**40, DIM), ValueError, "max_len: expected the table to fit", id="learned-too-big"
    ),
    pytest.param(
        lambda: LearnedPositions(8, DIM, dtype=torch.int64),
        ValueError,
        "dtype: expected a real floating",
        id="learned-int-dtype",
    ),
    pytest.param(
        lambda: LearnedPositions(8, DIM, dtype=torch.complex64),
        ValueError,
        "dtype: expected a real floating",
        id="learned-complex-dtype",
    ),
    pytest.param(
        lambda: LearnedPositions(8, DIM, device="nope"),
        ValueError,
        "device: expected a device",
        id="learned-bad-device",
    ),
    # ---- LearnedPositions
    pytest.param(
        lambda: LearnedPositions(0, DIM),
        ValueError,
        "max_len: expected a positive int, got 0",
        id="learned-max-len-zero",
    ),
    pytest.param(
        lambda: LearnedPositions(MAX_LEN, -1),
        ValueError,
        "dim: expected a positive int, got -1",
        id="learned-dim-negative",
    ),
    pytest.param(
        lambda: LearnedPositions(MAX_LEN, "6"),
        TypeError,
        "dim: expected a positive int, got str '6'",
        id="learned-dim-str",
    ),
    pytest.param(
        lambda: LearnedPositions(None, DIM),
        TypeError,
        "max_len: expected a positive int, got NoneType None",
        id="learned-max-len-none",
    ),
    pytest.param(
        lambda: _learned(randn(B, 12, DIM).float()),
        ValueError,
        "x: expected offset + length <= max_len = "
        "11, got offset 0 + length 12 = 12. Fix: truncate the sequence so that offset + length <= 11, or "
        "construct LearnedPositions with max_len >= 12",
        id="learned-past-max-len",
    ),
    pytest.param(
        lambda: _learned(X, offset=MAX_LEN - N + 1),
        ValueError,
        "got offset 7 + length 5 = 12",
        id="learned-offset-past-max-len",
    ),
    pytest.param(
        lambda: _learned(X, offset=-1), ValueError, "offset: expected a non-negative int", id="learned-offset-negative"
    ),
    pytest.param(
        lambda: _learned(X[..., :4]),
        ValueError,
        "x: expected last dim dim = 6, got shape (2, 5, 4)",
        id="learned-wrong-dim",
    ),
    pytest.param(
        lambda: _learned(X[0, 0]),
        ValueError,
        "x: expected shape (b, n, dim), or unbatched (n, dim), got shape (6,)",
        id="learned-1d",
    ),
    pytest.param(lambda: _learned(None), TypeError, "x: expected a torch.Tensor, got NoneType None", id="learned-none"),
]


@pytest.mark.parametrize(("thunk", "kind", "fragment"), BAD)
def test_bad_inputs_raise_the_right_error_with_a_fix(thunk, kind, fragment):
    with pytest.raises(Exception) as info:
        thunk()
    assert is_input_error(info.value, kind), f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert fragment in message
    assert "expected" in message and "got" in message and "Fix:" in message


# --------------------------------------------------------------------------- shared tables: threads and failures


@pytest.mark.portable
def test_a_rotary_layer_shared_by_four_threads_gives_the_single_threaded_outputs(device):
    """Threads growing the cos/sin tables at once (2500 then 7 positions...) must never read a mixed table."""
    import threading

    from multihead import MultiHeadAttention

    layer = MultiHeadAttention(16, 4, rotary=True, device=device)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, n, 16, generator=gen).to(device) for n in (7, 300, 2500, 40, 1200, 9, 3000, 5)]
    with torch.no_grad():
        expected = [layer(x)[0] for x in inputs]
        for _ in range(3):
            layer.rotary._cos_sin = torch.empty(2, 0, 2, device=device)  # start empty, so the threads race to grow it
            errors, mismatches = [], []

            def work(first: int, errors: list[str], mismatches: list[int]) -> None:
                try:
                    for index in range(first, len(inputs), 2):
                        if not torch.equal(layer(inputs[index])[0], expected[index]):
                            mismatches.append(index)
                except Exception as error:  # noqa: BLE001 - every failure is reported below
                    errors.append(repr(error))

            threads = [threading.Thread(target=work, args=(n % 2, errors, mismatches)) for n in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors and not mismatches, (errors, mismatches)


@pytest.mark.portable
@pytest.mark.parametrize("module", [RotaryEmbedding(6), SinusoidalPositions(6)], ids=["rotary", "sinusoidal"])
def test_an_allocation_failing_while_a_table_grows_leaves_the_old_table_working(module, monkeypatch, device):
    x = randn(2, 3, 5, 6, dtype=torch.float32, device=device)
    run = (
        (lambda n, offset: module.rotate(x[:, :, :n], offset))
        if isinstance(module, RotaryEmbedding)
        else (lambda n, offset: module(x[0, :, :n], offset))
    )
    small = run(5, 0)  # tables for a few positions
    buffer = "_cos_sin" if isinstance(module, RotaryEmbedding) else "_table"
    before = getattr(module, buffer).clone()
    real_stack = torch.stack

    def failing_stack(*args, **kwargs):
        raise MemoryError("simulated: no memory for the new table")

    monkeypatch.setattr(torch, "stack", failing_stack)
    with pytest.raises(MemoryError):
        run(5, 1000)  # needs a bigger table
    monkeypatch.setattr(torch, "stack", real_stack)
    assert torch.equal(getattr(module, buffer), before)  # the old table, whole
    torch.testing.assert_close(run(5, 0), small, rtol=0, atol=0)
    assert run(5, 1000).shape == small.shape  # and growing works once memory is back


@pytest.mark.portable
@pytest.mark.parametrize("far", [2**27, 2**40])
def test_positions_far_apart_cost_what_they_ask_not_a_table_up_to_the_largest(far, device):
    """positions=[0, 2**27] built rotary tables for 2**27 positions (15 s and 4 GiB for a head of 8), and an offset
    of 2**40 was refused as a table that cannot fit. Positions far apart are now computed for the call alone, with
    the tables' float64 arithmetic (the same numbers), and the tables stay as small as before."""
    x = randn(2, 3, 2, 8, seed=1, device=device)
    rope = RotaryEmbedding(8)
    positions = torch.tensor([0, far])
    angles = positions.double()[:, None] * 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    cos, sin = (t.to(device)[None, None] for t in (angles.cos(), angles.sin()))  # (1, 1, 2, 4)
    first, second = x[..., :4], x[..., 4:]
    expected = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    torch.testing.assert_close(rope.rotate(x, positions.to(device)), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(rope.rotate(x[:, :, 1:], far), expected[:, :, 1:], rtol=0, atol=1e-12)
    q = k = x[:, :, 1:]
    rotated_q, _ = rope(q, k, offset=far)
    torch.testing.assert_close(rotated_q, expected[:, :, 1:], rtol=0, atol=1e-12)
    assert rope._cos_sin.shape[-2] <= positional.TABLE_FLOOR
    pe = SinusoidalPositions(8)
    row = pe.table(1, offset=far, dtype=torch.float64)
    expected_row = torch.stack((angles[1].sin(), angles[1].cos()), dim=-1).reshape(1, 8)
    torch.testing.assert_close(row, expected_row, rtol=0, atol=0)
    torch.testing.assert_close(
        pe(torch.zeros(1, 1, 8, dtype=torch.float64, device=device), offset=far)[0], row.to(device)
    )
    assert pe._table.shape[0] <= positional.TABLE_FLOOR
    # dense positions still grow the tables: a prompt of 100 tokens keeps 100 rows
    rope.rotate(randn(1, 1, 100, 8, device=device), 0)
    assert rope._cos_sin.shape[-2] == 100
