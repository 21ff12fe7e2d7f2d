"""Shared test helpers: inputs with pairwise-distinct sizes, the DESIGN.md tolerance rule, small kernel blocks,
the input-error check and the low-precision textbook baseline.

Imported as ``from support import ...``: a module of its own, because ``conftest`` names two files here
(tests/ and tests/fuzz/), and importing either by name finds whichever pytest loaded last.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from multihead.backends import materialized, spans, tiled


def make_qkv(b=2, h=6, g=3, i=5, j=7, d=4, e=3, *, dtype=torch.float64, seed=0, requires_grad=False, device="cpu"):
    """q (b, h, i, d), k (b, g, j, d), v (b, g, j, e) from a fixed seed, on ``device``.

    Drawn on the CPU and then moved, so every device gets the same values from the same seed.
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(*shape, generator=gen, dtype=torch.float64, device="cpu").to(device=device, dtype=dtype)
        for shape in ((b, h, i, d), (b, g, j, d), (b, g, j, e))
    ]
    return [t.requires_grad_(requires_grad) for t in tensors]


def randn(*shape, seed=0, dtype=torch.float64, device="cpu", requires_grad=False):
    """A seeded standard-normal tensor drawn on the CPU and moved to ``device`` (the same values everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    tensor = torch.randn(*shape, generator=gen, dtype=torch.float64, device="cpu").to(device=device, dtype=dtype)
    return tensor.requires_grad_(requires_grad)


TINY = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-5, torch.float16: 1e-5}


def assert_within_rule(
    fast: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, *, what: str = "output", tiny: float | None = None
) -> None:
    """The FlashAttention test rule, over the whole tensor: max|fast - ref64| <= 2 max|ref_lowp - ref64| + tiny.

    ref_lowp is the textbook computed in fast's dtype without upcasting (textbook_lowp); tiny depends on that dtype.
    """
    tiny = TINY[fast.dtype] if tiny is None else tiny
    fast64, ref64, ref_lowp = (t.detach().double() for t in (fast, ref64, ref_lowp))
    assert fast64.shape == ref64.shape, f"{what}: shape {tuple(fast64.shape)} != {tuple(ref64.shape)}"
    assert not fast64.isnan().any(), f"{what}: NaN"
    error = (fast64 - ref64).abs().max().item()
    bound = 2 * (ref_lowp - ref64).abs().max().item() + tiny
    assert error <= bound, f"{what}: max error {error:.3g} > bound {bound:.3g}"


@contextlib.contextmanager
def tiny_blocks(block_q: int = 2, block_k: int = 3, rows: int = 2):
    """Tiny kernel blocks, so small tests cross many blocks, partial blocks and skipped blocks (and the
    materialised kernel's row blocks attend key spans narrower than the whole sequence)."""
    saved = tiled.BLOCK_Q, tiled.BLOCK_K, materialized.ROWS_PER_BLOCK, materialized.KEY_BLOCK
    saved_plan = spans.PLAN_ROWS, spans.PLAN_KEYS, spans.GROUP_ROWS, spans.UNMASKED_KEYS, spans.CAUSAL_ROWS
    tiled.BLOCK_Q, tiled.BLOCK_K, materialized.ROWS_PER_BLOCK, materialized.KEY_BLOCK = block_q, block_k, rows, block_k
    # the spans backend's plan: row tiles of block_q, key tiles of block_k, groups of at most two row tiles, and a
    # key tile kept whole already run unmasked, and a causal triangle of two rows already a causal call
    spans.PLAN_ROWS, spans.PLAN_KEYS, spans.GROUP_ROWS, spans.UNMASKED_KEYS = block_q, block_k, 2 * block_q, block_k
    spans.CAUSAL_ROWS = 2
    try:
        yield
    finally:
        tiled.BLOCK_Q, tiled.BLOCK_K, materialized.ROWS_PER_BLOCK, materialized.KEY_BLOCK = saved
        spans.PLAN_ROWS, spans.PLAN_KEYS, spans.GROUP_ROWS, spans.UNMASKED_KEYS, spans.CAUSAL_ROWS = saved_plan


CPU_ONLY_BACKENDS = frozenset({"spans"})  # torch's CPU flash kernel: its Capabilities name the cpu device alone


def refused_off_the_cpu(backend: str, device: torch.device, call) -> bool:
    """For a CPU-only backend on another device: ``call()`` is refused with a ValueError naming the device, and
    True says so (the caller checks nothing more); False where the backend serves the device."""
    if backend not in CPU_ONLY_BACKENDS or device.type == "cpu":
        return False
    with pytest.raises(ValueError, match=f"device {device.type}"):
        call()
    return True


def is_input_error(exc: BaseException, kind: type[Exception]) -> bool:
    """Exactly multihead's input-error class for ``kind`` (ValueError or TypeError): catchable as ``kind``,
    and marked as the caller's mistake (:class:`multihead._errors.InputError`)."""
    from multihead._errors import ArgumentTypeError, ArgumentValueError

    return type(exc) is {ValueError: ArgumentValueError, TypeError: ArgumentTypeError}.get(kind, kind)


def textbook_lowp(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask=None, causal: bool = False, scale: float | None = None
):
    """softmax(q k^T * scale + mask) v computed in q's dtype throughout, no upcast (differentiable); a mask's
    soft-cap applied to the scaled scores first.

    Returns (output (b, h, i, e), weights (b, h, i, j), lse (b, h, i)). This is the low-precision
    baseline of the tolerance rule (FlashAttention's ``attention_ref(upcast=False)``): the oracle
    itself upcasts half types to float32, so it is no measure of what low precision costs. A bias (ALiBi, a
    tensor) is added in float32, as attention_ref adds its float32 ALiBi bias to the half scores: the scores are
    then float32, and the weights are rounded to v's dtype before they meet v.
    """
    from multihead.backends.reference import apply_mask, masked_softmax
    from multihead.masks import AttentionShape, bind_mask

    b, h, i, d = q.shape
    g, j = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    bias_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    bound = bind_mask(mask, causal, AttentionShape(b, h, i, j, q.device))
    keep, bias = bound.dense(bias_dtype)
    keys, values = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)  # (b, h, j, d|e)
    scores = q @ keys.transpose(-2, -1) * scale  # (b, h, i, j), rounded to q's dtype
    if bound.softcap is not None:  # attention_ref's soft-cap, in q's dtype: cap * tanh(scores / cap)
        scores = bound.softcap * torch.tanh(scores / bound.softcap)
    weights, lse = masked_softmax(apply_mask(scores, keep, bias))
    weights = weights.to(values.dtype)
    return weights @ values, weights, lse


def auto_candidates(q, k, v, *, mask=None, return_lse: bool = False) -> list[str]:
    """The backends ``auto`` may choose for this call: every one that serves it, as auto sees them."""
    from multihead.backends import registry
    from multihead.functional import _prepare

    options = dict(causal=False, scale=None, dropout=0.0, training=False, backend="auto", return_weights=False)
    call = _prepare(q, k, v, mask=mask, **options, return_lse=return_lse).call
    return [backend.name for backend in registry.serving_for_auto(call)]


def forward_backward(backend: str, q, k, v, mask, dout):
    """Output and (dq, dk, dv) of one backend, or of the low-precision textbook (``"textbook_lowp"``); q, k and v
    are taken as fresh leaves."""
    from multihead.functional import attention

    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if backend == "textbook_lowp":
        out = textbook_lowp(q, k, v, mask=mask)[0]
    else:
        out = attention(q, k, v, mask=mask, backend=backend)
    out.backward(dout.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


def assert_forward_backward_within_rule(backend: str, q, k, v, mask, dout, dtype: torch.dtype, what: str):
    """``backend``'s output and gradients on q, k, v cast to ``dtype`` within the tolerance rule against the float64
    reference on the originals (the textbook in ``dtype`` as the rule's baseline); returns the backend's
    (out, dq, dk, dv)."""
    ref64 = forward_backward("reference", q, k, v, mask, dout)
    low = [t.to(dtype) for t in (q, k, v)]
    ref_lowp = forward_backward("textbook_lowp", *low, mask, dout)
    fast = forward_backward(backend, *low, mask, dout)
    for name, f, r64, rlp in zip(("output", "dq", "dk", "dv"), fast, ref64, ref_lowp, strict=True):
        assert_within_rule(f, r64, rlp, what=f"{what} {name}")
    return fast
