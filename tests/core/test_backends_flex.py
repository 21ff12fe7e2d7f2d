"""The flex backend (torch's FlexAttention) against the float64 reference, its refusals, and its compile cache.

Compiling a FlexAttention kernel takes 10-50 s on a busy 2-core CPU, so the compiled tests share one
kernel (a module-scoped fixture): diagonal (causal in both alignments, or a window) & padding & ALiBi &
soft-cap, float32, GQA. Every mask kind's lowering (dense bias and allowed tensors too, which the CPU
kernel refuses) is checked through FlexAttention's unfused path, which runs the same mask_mod /
score_mod / BlockMask on dense scores and returns the LSE.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters

import multihead
from multihead import masks
from multihead.backends import costs, flex, policy
from multihead.backends.rates import CPU_AVX2_RATES
from multihead.functional import attention, attention_result
from multihead.masks import AttentionShape, bind_mask
from support import assert_within_rule, make_qkv, textbook_lowp
from test_backends import MASK_KINDS, cast_mask, make_mask

B, H, G, D, E = 2, 6, 3, 8, 4  # GQA: each key/value head serves two query heads

pytestmark = pytest.mark.skipif(not flex._cpu_supported(), reason="FlexAttention's CPU kernel needs AVX2")


def inputs(i: int, j: int, dtype=torch.float64, seed: int = 0):
    return make_qkv(b=B, h=H, g=G, i=i, j=j, d=D, e=E, dtype=dtype, seed=seed)


def check_against_reference(run, mask, i: int, j: int, dtype: torch.dtype, what: str) -> None:
    """run(q, k, v, mask) -> output in dtype; compared with the reference under the tolerance rule."""
    q, k, v = inputs(i, j)
    ref64 = attention(q, k, v, mask=mask, backend="reference")
    low = [t.to(dtype) for t in (q, k, v)]
    lowp = textbook_lowp(*low, mask=mask)[0]
    out = run(*low, mask)
    assert out.dtype == dtype
    assert_within_rule(out, ref64, lowp, what=what)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


# --------------------------------------------------------------------------- the compiled kernel, shared
#
# Causal and every window lower to one diagonal mod, so one kernel (float32, GQA) serves the causal
# alignments and the window combination alike: diagonal & padding & ALiBi & soft-cap.

SLOPES = masks.alibi_slopes(H)


def causal_mask(align: str, j: int):
    """causal(align), with the other terms of the shared kernel (batch row 1 loses its last key)."""
    return masks.causal(align) & masks.padding(torch.tensor([j, j - 1])) & masks.alibi(SLOPES) & masks.softcap(30.0)


def window_mask(j: int):
    """window & padding (batch row 1 has no real key: its rows are fully masked) & ALiBi & soft-cap."""
    return (
        masks.window(3, 1, align="top_left")
        & masks.padding(torch.tensor([j, 0]))
        & masks.alibi(SLOPES)
        & masks.softcap(2.0)
    )


@pytest.fixture(scope="module")
def kernel():
    """The shared kernel, warmed up once for the module (at length 256); the seconds it took."""
    return flex.warm_up(heads=H, kv_heads=G, qk_dim=D, v_dim=E, mask=window_mask(256), batch=B)


def flex_backend(q, k, v, mask):
    return attention(q, k, v, mask=mask, backend="flex")


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("lengths", [(5, 7), (7, 5), (130, 300), (300, 131)], ids=str)
def test_compiled_causal_matches_reference(kernel, align, lengths):
    """Both alignments, i != j (i > j bottom-right leaves rows with no key), several key blocks."""
    i, j = lengths
    check_against_reference(flex_backend, causal_mask(align, j), i, j, torch.float32, f"causal {align} {lengths}")


@pytest.mark.parametrize("lengths", [(9, 11), (11, 9), (200, 150)], ids=str)
def test_compiled_window_combination_matches_reference(kernel, lengths):
    i, j = lengths
    check_against_reference(flex_backend, window_mask(j), i, j, torch.float32, f"window combination {lengths}")


def test_fully_masked_rows_give_zero(kernel):
    q, k, v = inputs(9, 11, torch.float32)
    out = attention(q, k, v, mask=window_mask(11), backend="flex")
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # batch row 1: no real key
    assert out[0].abs().sum() > 0


def test_no_recompile_at_new_lengths(kernel):
    """After warm_up, calls at lengths never seen, either alignment, compile nothing (counted by dynamo)."""
    before, kernels = graphs(), dict(flex._COMPILE_SECONDS)
    for i, j in ((17, 33), (333, 257), (64, 64)):
        q, k, v = inputs(i, j, torch.float32, seed=i)
        attention(q, k, v, mask=causal_mask("bottom_right", j), backend="flex")
        attention(q, k, v, mask=causal_mask("top_left", j), backend="flex")
        attention(q, k, v, mask=window_mask(j), backend="flex")
    assert graphs() == before
    assert flex._COMPILE_SECONDS == kernels


def test_custom_scale_reuses_the_kernel(kernel):
    """The scale enters the score_mod as a tensor: another scale compiles nothing, and is applied before the cap."""
    before = graphs()
    q, k, v = inputs(9, 11)
    mask = causal_mask("bottom_right", 11)
    ref64 = attention(q, k, v, mask=mask, scale=0.9, backend="reference")
    low = [t.float() for t in (q, k, v)]
    out = attention(*low, mask=mask, scale=0.9, backend="flex")
    assert_within_rule(out, ref64, textbook_lowp(*low, mask=mask, scale=0.9)[0], what="scale 0.9")
    assert graphs() == before


def test_warm_up_twice_compiles_once(kernel):
    assert kernel > 0
    assert flex.warm_up(heads=H, kv_heads=G, qk_dim=D, v_dim=E, mask=window_mask(256), batch=B) == 0.0


# --------------------------------------------------------------------------- lowering of every mask kind


def unfused(q, k, v, mask, *, lse=False):
    """FlexAttention's unfused path on the same lowering (dense scores; any mask kind, LSE).

    Run directly, not under dynamo, which would trace every new mask_mod for nothing (seconds per test).
    """
    b, h, i, d = q.shape
    bound = bind_mask(mask, False, AttentionShape(b, h, i, k.shape[2], q.device))
    with mock.patch.object(torch.nn.attention.flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True):
        out, lse_ = flex._run(q, k, v, mask=bound, scale=d**-0.5, need_lse=lse, compiled=False)
    return (out, lse_) if lse else out


def softcapped(i, j):
    return masks.causal() & masks.bias(torch.randn(1, H, i, j, dtype=torch.float64)) & masks.softcap(0.5)


EXTRA_KINDS = {
    "window_bottom_right": lambda i, j: masks.window(2, 1),
    "window_top_left": lambda i, j: masks.window(1, 2, align="top_left"),
    "softcap_then_bias": softcapped,
    "allowed_and_padding": lambda i, j: (
        masks.allowed(torch.rand(1, 1, i, j, generator=torch.Generator().manual_seed(3)) < 0.6)
        & masks.padding(torch.tensor([j, 1]))
    ),
}


@pytest.mark.parametrize("lengths", [(5, 7), (7, 5)], ids=["i<j", "i>j"])
@pytest.mark.parametrize("kind", MASK_KINDS + list(EXTRA_KINDS))
def test_lowering_matches_reference(kind, lengths):
    i, j = lengths
    mask = EXTRA_KINDS[kind](i, j) if kind in EXTRA_KINDS else make_mask(kind, B, H, i, j)
    check_against_reference(unfused, cast_mask(mask, torch.float32), i, j, torch.float32, kind)


@pytest.mark.parametrize("kind", ["causal", "padding_valid", "float_neg_inf", "combo"])
def test_lse_matches_reference(kind):
    """Natural-log LSE, -inf on fully masked rows (whose output is 0)."""
    i, j = 7, 5
    q, k, v = inputs(i, j)
    mask = make_mask(kind, B, H, i, j)
    ref = attention_result(q, k, v, mask=mask, backend="reference", return_lse=True)
    low = [t.float() for t in (q, k, v)]
    out, lse = unfused(*low, cast_mask(mask, torch.float32), lse=True)
    dead = ref.lse == -math.inf
    assert dead.any() or kind == "causal"
    assert torch.equal(lse == -math.inf, dead)
    torch.testing.assert_close(lse[~dead].double(), ref.lse[~dead], rtol=0, atol=1e-5)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))


def test_block_mask_skips_empty_blocks():
    """A window of 8 over 1024 keys: only the blocks along the diagonal are visited."""
    bound = bind_mask(masks.window(7, 0), False, AttentionShape(1, 1, 1024, 1024, torch.device("cpu")))
    lowered = flex._lower(bound, torch.float32)
    block_mask = flex._block_mask(bound, lowered.mask_mod)
    visited = block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum()
    assert visited == 8 + 7  # the diagonal blocks, and the one before each but the first
    assert block_mask.full_kv_num_blocks.sum() == 0  # a window of 8 fills no 128 x 128 block


# --------------------------------------------------------------------------- refusals and auto


def test_cpu_backward_is_refused_with_the_reason():
    q, k, v = make_qkv(b=1, h=2, g=2, i=5, j=5, d=D, e=E, dtype=torch.float32, requires_grad=True)
    why = str(multihead.explain(q, k, v, causal=True, backend="flex"))
    assert "backward on CPU (FlexAttention has no CPU backward" in why
    assert "backward on CPU (FlexAttention has no CPU backward" in str(multihead.explain(q, k, v, causal=True))
    with pytest.raises(ValueError, match="backward on CPU"):
        attention(q, k, v, causal=True, backend="flex")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"return_lse": True}, "return_lse on CPU"),
        ({"mask": masks.bias(torch.zeros(5, 5))}, "a bias term whose mod reads a tensor by query position, on CPU"),
        ({"mask": torch.ones(5, 5, dtype=torch.bool)}, "an allowed term whose mod reads a tensor by query position"),
        ({"dropout": 0.1, "training": True}, "dropout"),
        ({"return_weights": True}, None),  # served: the weights come from another pass, as for sdpa
    ],
)
def test_refusals_name_what_flex_lacks(kwargs, fragment):
    q, k, v = make_qkv(b=1, h=2, g=2, i=5, j=5, d=D, e=E, dtype=torch.float32)
    why = str(multihead.explain(q, k, v, backend="flex", **kwargs))
    if fragment is None:
        assert why.startswith("chosen: flex")
    else:
        assert why.startswith("chosen: None") and fragment in why
        with pytest.raises(ValueError, match=fragment.split(" (")[0]):
            attention_result(q, k, v, backend="flex", **kwargs)


def test_float64_is_refused():
    q, k, v = make_qkv(b=1, h=2, g=2, i=5, j=5, d=D, e=E)
    assert "dtype torch.float64" in str(multihead.explain(q, k, v, backend="flex"))


def test_auto_skips_flex_while_cold_and_says_why(kernel):
    # five query heads: a kernel no test compiles
    q, k, v = make_qkv(b=1, h=5, g=5, i=5, j=5, d=D, e=E, dtype=torch.float32)
    before = graphs()
    why = multihead.explain(q, k, v, causal=True)
    assert "not compiled yet for this call" in "; ".join(why.rejected["flex"])
    assert "multihead.backends.flex.warm_up(...) or name backend='flex'" in str(why)
    attention(q, k, v, causal=True)  # auto: some other backend, and no compile
    assert graphs() == before
    # a warm kernel is no longer skipped for that reason
    q, k, v = inputs(5, 7, torch.float32)
    rejected = multihead.explain(q, k, v, mask=causal_mask("bottom_right", 7)).rejected.get("flex", [])
    assert not any("not compiled" in r for r in rejected)


def kernel_call(i, j, kv_heads=G, mask=None, dtype=torch.float32):
    """The AttentionCall of a forward call on the shared kernel's heads and head dims."""
    mask = causal_mask("top_left", j) if mask is None else mask
    bound = bind_mask(mask, False, AttentionShape(B, H, i, j, torch.device("cpu")))
    return multihead.backends.AttentionCall(
        B, H, kv_heads, i, j, D, E, dtype, torch.device("cpu"), bound, 0.0, "none", False, False
    )


@pytest.fixture
def faster_half_flex():
    """Rates of a machine where compiled FlexAttention is faster in bfloat16 than in float32."""
    gflops = {name: dict(by_key) for name, by_key in CPU_AVX2_RATES.gflops.items()}
    gflops["flex"]["forward half"] = 10 * gflops["flex"]["forward float32"]
    faster = costs.KernelRates(gflops, mask_gbs=CPU_AVX2_RATES.mask_gbs, source="test")
    with policy.use_policy(policy.current_policy().with_rates(faster)):
        yield


def test_flex_is_warm_follows_the_cache_key(kernel):
    assert flex.flex_is_warm(kernel_call(100, 1000))
    assert flex.flex_is_warm(kernel_call(3, 4))
    assert not flex.flex_is_warm(kernel_call(3, 4, kv_heads=H))  # head counts are compiled in
    assert not flex.flex_is_warm(kernel_call(1, 4))  # one query: a kernel of its own
    assert not flex.flex_is_warm(kernel_call(3, 4, mask=masks.window(3, 0)))  # other mask kinds: other code
    assert flex.compile_seconds() > 0


def test_a_half_call_runs_on_the_float32_kernel_where_that_is_faster(kernel):
    # the shipped rates (this project's AVX2 machine): compiled FlexAttention runs 45 GFLOP/s in float32, 30 in bf16
    assert flex.flex_is_warm(kernel_call(3, 4, dtype=torch.bfloat16))
    before, kernels = graphs(), dict(flex._COMPILE_SECONDS)
    check_against_reference(flex_backend, causal_mask("top_left", 300), 130, 300, torch.bfloat16, "bf16 in float32")
    assert graphs() == before and flex._COMPILE_SECONDS == kernels  # the float32 kernel served it
    q, k, v = inputs(300, 300, torch.bfloat16)  # big enough for auto to compare estimates (explain runs nothing)
    estimate = multihead.explain(q, k, v, mask=causal_mask("top_left", 300)).estimates["flex"]
    assert estimate.computes_in == torch.float32


def test_a_half_call_gets_its_own_kernel_where_half_is_faster(kernel, faster_half_flex):
    assert not flex.flex_is_warm(kernel_call(3, 4, dtype=torch.bfloat16))
    assert flex.flex_is_warm(kernel_call(3, 4))


def test_a_compiler_failure_is_a_clear_error_and_flex_is_passed_over_after(monkeypatch):
    """torch's compiler can fail for some mask structures on the CPU (inductor's C++ for a padding-only mask at
    h = 16, n = 1024 here): the call raises a ValueError naming the backend, and explain then refuses flex for
    that kind of call, with the compiler's words, so auto never tries it."""

    def failing(*args, **kwargs):
        raise RuntimeError("CppCompileError: C++ compile error\n(details)")

    q = torch.randn(1, 3, 40, 8)
    mask = masks.padding(torch.tensor([30])) & masks.softcap(7.0)  # a structure no other test compiles
    monkeypatch.setattr(flex, "_kernel", lambda key: failing)
    with pytest.raises(
        ValueError,
        match=r"backend: expected a mask FlexAttention's compiler handles here.*"
        r"CppCompileError.*Fix: use backend='auto' or 'tiled'",
    ):
        attention(q, q, q, mask=mask, backend="flex")
    reasons = multihead.explain(q, q, q, mask=mask).rejected["flex"]
    assert any("torch's compiler failed for it here: RuntimeError: CppCompileError" in r for r in reasons)
    assert multihead.explain(q, q, q, mask=mask, backend="flex").chosen is None


@pytest.mark.portable
def test_warm_up_compiles_the_backward_where_flex_has_one(device):
    """With requires_grad, warm_up compiles the kernel of calls that need gradients, forward and backward: on CUDA
    it is warm afterwards (auto may choose flex for training calls); on the CPU, where FlexAttention has no
    backward, the refusal names what is missing."""
    if device.type == "cpu":
        with pytest.raises(ValueError, match="warm_up: .*backward on CPU"):
            flex.warm_up(heads=2, qk_dim=16, causal=True, device=device, requires_grad=True)
    else:
        flex.warm_up(heads=2, qk_dim=16, causal=True, device=device, requires_grad=True)
        q, k, v = (torch.randn(1, 2, 300, 16, device=device, requires_grad=True) for _ in range(3))
        assert multihead.explain(q, k, v, causal=True, backend="flex").chosen == "flex"
        shape = masks.AttentionShape(1, 2, 300, 300, device)
        bound = masks.bind_mask(None, True, shape)
        call = multihead.backends.AttentionCall(
            1, 2, 2, 300, 300, 16, 16, q.dtype, device, bound, 0.0, "none", False, True
        )
        assert flex.flex_is_warm(call)
    with pytest.raises(TypeError, match="requires_grad: expected True or False"):
        flex.warm_up(heads=2, qk_dim=16, device=device, requires_grad="yes")


def test_a_block_mask_of_bands_is_built_once_per_structure_and_length():
    """A mask whose keep terms hold no data (causal, windows) keeps its BlockMask by structure, lengths and device:
    a loop calling with the same ones builds its table once. Padding (data that may change each call) never."""
    flex._BLOCK_MASKS.clear()

    def built(mask, causal, i, j, b=1):
        bound = bind_mask(mask, causal, AttentionShape(b, H, i, j, torch.device("cpu")))
        return flex._block_mask(bound, lambda b, h, q, k: q >= k)

    first = built(None, True, 300, 300)
    assert built(None, True, 300, 300) is first
    assert built(None, True, 300, 400) is not first  # other lengths
    assert built(masks.window(64), True, 300, 300) is not built(masks.window(65), True, 300, 300)
    padded = built(masks.padding([200]), True, 300, 300)
    assert built(masks.padding([200]), True, 300, 300) is not padded
    # the kept table is the one a fresh build gives
    flex._BLOCK_MASKS.clear()
    again = built(None, True, 300, 300)
    assert torch.equal(again.kv_num_blocks, first.kv_num_blocks) and torch.equal(again.kv_indices, first.kv_indices)
    flex._BLOCK_MASKS.clear()
