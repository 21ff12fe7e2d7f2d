"""The spans backend at its own sizes: its plan (every kept pair inside a group's pieces, unmasked pieces kept whole),
its results against the float64 reference (output, LSE, gradients through both) on calls whose plans have several
groups and unmasked pieces, and what it refuses. The mask-by-mask matrix at tiny plan tiles is in test_backends.py
and the autograd stack (gradcheck, double backward, batched gradients, autocast) in test_autograd_stack.py."""

from __future__ import annotations

import math

import pytest
import torch

import multihead
from multihead import masks
from multihead.backends import spans
from multihead.masks import AttentionShape, bind_mask
from support import make_qkv


def documents_of(lengths: list[int]) -> torch.Tensor:
    """(1, n) document index of each position of documents of ``lengths`` packed in one row."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


# sizes whose plans have many groups, groups cut at documents, unmasked pieces of UNMASKED_KEYS or more keys
# (causal & padding, prefix documents) and rows with no key at all (padding of 0 keys, bottom-right causal i > j)
CASES = {
    "documents & causal": (1, 1100, 1100, lambda: masks.documents(documents_of([300, 37, 700, 63])) & masks.causal()),
    "causal & padding": (2, 1300, 1300, lambda: masks.causal() & masks.padding(torch.tensor([1300, 1250]))),
    "causal & padding, a row of no key": (2, 900, 900, lambda: masks.causal() & masks.padding(torch.tensor([900, 0]))),
    "window": (1, 1000, 1000, lambda: masks.window(100, 20)),
    "causal, more queries than keys": (1, 1200, 700, lambda: masks.causal()),
    "documents, not causal": (1, 1200, 1200, lambda: masks.documents(documents_of([900, 300]))),
    "causal & alibi": (1, 700, 700, lambda: masks.causal() & masks.alibi(masks.alibi_slopes(4))),
    # triangles run as causal calls: a whole causal call, one after a prefix every row sees, the rows of a window
    # that reach back to the first key, and documents whose triangles follow one another with no row between
    "causal": (1, 900, 900, lambda: masks.causal()),
    "causal, fewer queries than keys": (2, 300, 1000, lambda: masks.causal()),
    "wide window": (1, 1000, 1000, lambda: masks.window(600)),
    "documents & causal, equal padding": (
        2,
        800,
        800,
        lambda: masks.documents(documents_of([250, 550]).expand(2, -1)) & masks.causal() & masks.padding([700, 700]),
    ),
}


def plan_of(case: str):
    b, i, j, make = CASES[case]
    bound = bind_mask(make(), False, AttentionShape(b, 4, i, j, torch.device("cpu")))
    return bound, spans.span_plan(bound)


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_holds_every_kept_pair_and_its_unmasked_pieces_are_kept_whole(case):
    bound, plan = plan_of(case)
    keep = bound.dense(torch.float32)[0]
    keep = torch.ones(1, 1, bound.shape.q_len, bound.shape.k_len, dtype=torch.bool) if keep is None else keep
    keep = keep.expand(bound.shape.batch, -1, bound.shape.q_len, bound.shape.k_len).any(1)  # (b, i, j) over heads
    covered = torch.zeros_like(keep)
    assert [row for group in plan for row in group.rows] == list(range(bound.shape.q_len))  # every row once, in order
    for group in plan:
        rows = slice(group.rows.start, group.rows.stop)
        pieces = sorted(group.pieces, key=lambda piece: piece.keys.start)
        assert all(a.keys.stop == b.keys.start for a, b in zip(pieces, pieces[1:], strict=False))  # one span
        in_triangle = any(piece.causal for piece in group.pieces)
        for piece in group.pieces:
            keys = slice(piece.keys.start, piece.keys.stop)
            assert covered[:, rows, keys].sum() == 0  # no pair in two pieces
            covered[:, rows, keys] = True
            if piece.causal:  # the mask keeps exactly the kernel's triangle: row n of the group its first n + 1 keys
                assert len(piece.keys) == len(group.rows) and not piece.masked
                triangle = torch.ones(len(group.rows), len(piece.keys), dtype=torch.bool).tril()
                assert torch.equal(keep[:, rows, keys], triangle.expand_as(keep[:, rows, keys]))
            elif not piece.masked:  # kept whole: a long run, or what every row of a triangle sees before it
                assert len(piece.keys) >= spans.UNMASKED_KEYS or in_triangle
                assert keep[:, rows, keys].all()
    assert not (keep & ~covered).any()  # every kept pair is computed
    # and the plan is cached on the bound mask: auto's estimate and the kernel share it
    assert spans.span_plan(bound) is plan


def test_the_plans_skip_what_their_masks_rule_out():
    """Packed documents are cut at their boundaries; their plan computes a fraction of the grid."""
    bound, plan = plan_of("documents & causal")
    computed = sum(group.pairs for group in plan)
    kept = sum(n * (n + 1) // 2 for n in (300, 37, 700, 63))
    # each document one causal call, which computes its triangle and the kernel's key blocks across the diagonal
    assert [(group.rows, [piece.causal for piece in group.pieces]) for group in plan] == [
        (range(0, 300), [True]),
        (range(300, 337), [True]),
        (range(337, 1037), [True]),
        (range(1037, 1100), [True]),
    ]
    assert kept <= computed <= 2 * kept < 0.5 * 1100 * 1100
    prefix, triangle = plan_of("causal, fewer queries than keys")[1][0].pieces  # bottom-right: 700 keys, then 300
    assert (prefix.keys, prefix.masked, triangle.keys, triangle.causal) == (
        range(0, 700),
        False,
        range(700, 1000),
        True,
    )
    assert any(not piece.masked for group in plan_of("causal & padding")[1] for piece in group.pieces)
    beyond = plan_of("causal, more queries than keys")[1]  # bottom-right: 500 rows with no key, then a triangle
    assert all(not group.pieces for group in beyond if group.rows.stop <= 480)  # the row tiles with no key
    assert beyond[-1].rows == range(500, 1200)
    assert beyond[-1].pieces == (spans.KeyPiece(range(0, 700), masked=False, causal=True),)


def loss_of(result: multihead.AttentionResult, seed: int) -> torch.Tensor:
    """A random linear function of the output and of the LSE (its -inf rows left out), so both get a gradient."""
    gen = torch.Generator().manual_seed(seed)
    out_weights = torch.randn(result.output.shape, generator=gen, dtype=torch.float64).to(result.output.dtype)
    lse_weights = torch.randn(result.lse.shape, generator=gen, dtype=torch.float64).to(result.lse.dtype)
    lse = result.lse.masked_fill(result.lse == -math.inf, 0.0)
    return (result.output * out_weights).sum() + (lse * lse_weights).sum()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_output_lse_and_gradients_through_both_equal_the_reference(case, dtype):
    b, i, j, make = CASES[case]
    q, k, v = make_qkv(b=b, h=4, g=2, i=i, j=j, d=16, e=8, seed=3)
    results = {}
    for backend, run_dtype in (("reference", torch.float64), ("spans", dtype)):
        leaves = [t.to(run_dtype).requires_grad_(True) for t in (q, k, v)]
        result = multihead.attention_result(*leaves, mask=make(), backend=backend, return_lse=True)
        grads = torch.autograd.grad(loss_of(result, seed=4), leaves)
        results[backend] = (result.output, result.lse, *grads)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    for name, got, want in zip(
        ("output", "lse", "dq", "dk", "dv"), results["spans"], results["reference"], strict=True
    ):
        assert got.dtype == (dtype if name != "lse" else dtype)
        finite = want.isfinite()
        assert torch.equal(got.isfinite(), finite), f"{case} {name}: -inf where the reference has it"
        torch.testing.assert_close(got[finite].double(), want[finite], rtol=0, atol=tolerance, msg=f"{case} {name}")
    if case == "causal & padding, a row of no key":  # batch row 1 has no key: output 0, LSE -inf, gradients 0
        output, lse, dq = results["spans"][:3]
        assert (output[1] == 0).all() and (lse[1] == -math.inf).all() and (dq[1] == 0).all()


@pytest.mark.parametrize("case", ["window", "wide window", "causal, more queries than keys"])
def test_a_bands_piece_masks_are_built_once_per_shape_and_offset_and_equal_those_built_each_time(case):
    """A band's groups alike but for their place along the diagonal share one mask (_PieceMasks); every piece of
    the plan, and pieces of one shape at other offsets (keys 0 .. 63 and 100 .. 163 for rows 100 .. 163), get the
    mask built for them alone."""
    bound, plan = plan_of(case)
    assert bound.shift_invariant
    q, k, v = make_qkv(b=1, h=4, g=2, i=bound.shape.q_len, j=bound.shape.k_len, d=8, e=8)
    lay = spans._Layout(q, k, v, scale=1.0)
    shared = spans._PieceMasks(lay, bound)
    extra = [(range(100, 164), spans.KeyPiece(keys, masked=True)) for keys in (range(0, 64), range(100, 164))]
    pieces = [(group.rows, piece) for group in plan for piece in group.pieces] + extra * 2
    for rows, piece in pieces:
        got, want = shared.of(rows, piece, True), spans._piece_mask(lay, bound, rows, piece, True)
        for a, b in zip(got, want, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), (case, rows, piece)
    assert shared.made is not None and len(shared.made) < len(pieces)  # built once, used again
    # a mask of data (padding) is built for every piece
    padded = bind_mask(masks.padding([900, 800]), False, AttentionShape(2, 4, 900, 900, torch.device("cpu")))
    assert not padded.shift_invariant and spans._PieceMasks(lay, padded).made is None


@pytest.mark.parametrize("case", ["causal", "documents & causal", "causal, fewer queries than keys", "window"])
def test_a_negative_scale_gives_the_references_results_through_causal_calls(case):
    """torch's causal mode scales after its triangle's -inf (a negative scale gave NaN rows): spans negates the
    queries instead, and their gradient back."""
    b, i, j, make = CASES[case]
    q, k, v = make_qkv(b=b, h=4, g=2, i=i, j=j, d=16, e=8, seed=5)
    results = {}
    for backend in ("reference", "spans"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        result = multihead.attention_result(*leaves, mask=make(), backend=backend, return_lse=True, scale=-0.8)
        results[backend] = (result.output, result.lse, *torch.autograd.grad(loss_of(result, seed=6), leaves))
    for name, got, want in zip(
        ("output", "lse", "dq", "dk", "dv"), results["spans"], results["reference"], strict=True
    ):
        finite = want.isfinite()
        assert torch.equal(got.isfinite(), finite), f"{case} {name}"
        torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=1e-10, msg=f"{case} {name}")


def test_half_inputs_are_computed_in_float32_and_returned_in_their_dtype():
    q, k, v = (t.to(torch.bfloat16).requires_grad_(True) for t in make_qkv(b=1, h=4, g=2, i=600, j=600, d=16, e=16))
    result = multihead.attention_result(q, k, v, mask=masks.window(64), backend="spans", return_lse=True)
    assert result.output.dtype == torch.bfloat16 and result.lse.dtype == torch.float32
    result.output.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.bfloat16
    single = multihead.attention(q.float(), k.float(), v.float(), mask=masks.window(64), backend="spans")
    assert torch.equal(result.output, single.to(torch.bfloat16))


@pytest.mark.parametrize(
    "options, lacks",
    [
        (dict(dropout=0.1, training=True), "dropout"),
        (dict(mask=masks.softcap(30.0)), "logit soft-capping"),
        (dict(mask=masks.bias(torch.zeros(1, 1, 8, 8, requires_grad=True))), "gradient with respect to an additive"),
    ],
    ids=["dropout", "softcap", "bias gradient"],
)
def test_what_it_does_not_serve_is_refused_by_name(options, lacks):
    q, k, v = make_qkv(b=1, h=2, g=2, i=8, j=8, d=4, e=4, dtype=torch.float32, requires_grad=True)
    with pytest.raises(ValueError, match=lacks):
        multihead.attention(q, k, v, backend="spans", **options)
    assert multihead.explain(q.detach(), k.detach(), v.detach(), **options).chosen != "spans"


def test_under_torch_func_it_is_refused_and_auto_serves_the_call_elsewhere():
    q, k, v = make_qkv(b=1, h=2, g=2, i=6, j=6, d=4, e=4)
    stacked = torch.stack([q, 2 * q])

    def lse_of(backend):
        return lambda q: multihead.attention_result(q, k, v, causal=True, backend=backend, return_lse=True).lse

    with pytest.raises(ValueError, match="torch.func transforms"):
        torch.func.vmap(lse_of("spans"))(stacked)
    batched = torch.func.vmap(lse_of("auto"))(stacked)
    for n in range(2):
        torch.testing.assert_close(batched[n], lse_of("spans")(stacked[n]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shipped", ["avx2", "avx512-bf16"])
def test_the_shipped_rates_send_masked_calls_to_spans_and_plain_causal_to_sdpa(shipped):
    """Auto's choice on each CPU kind's table (explain only: nothing runs). Measured on the AVX-512 EPYC
    (benchmarks/packed.py, benchmarks/window.py, 2026-12-07): spans ran packed documents 1.9x faster than SDPA
    with the padded dense mask, and causal & window(256) at 8k 16x faster than SDPA with a dense mask; plain
    causal is SDPA's own kernel, which skips the blocks above the diagonal itself."""
    from multihead.backends import policy
    from multihead.backends.rates import CPU_AVX2_RATES, CPU_AVX512_BF16_RATES

    table = {"avx2": CPU_AVX2_RATES, "avx512-bf16": CPU_AVX512_BF16_RATES}[shipped]
    n = 4096
    q = torch.empty(1, 8, n, 64, requires_grad=True)
    k = torch.empty(1, 2, n, 64, requires_grad=True)
    packed = masks.documents(documents_of([300, 900, 37, 1500, 700, 659])) & masks.causal()
    with policy.use_policy(policy.current_policy().with_rates(table)):
        for mask in (packed, masks.causal() & masks.window(255, 0)):
            explained = multihead.explain(q, k, k, mask=mask)
            assert explained.chosen == "spans", str(explained)
            assert "'spans' is cheaper" in str(explained)  # the others, each with its estimate
        assert multihead.explain(q, k, k, causal=True).chosen == "sdpa"
