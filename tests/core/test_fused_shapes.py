"""Shapes that reach the fused kernels on a GPU (head dim 64 and 128, bf16 and fp16, GQA), forward and backward,
every backend against the float64 oracle under the tolerance rule (DESIGN.md).

The other kernel tests use tiny, pairwise-distinct sizes, which torch's flash and memory-efficient SDPA kernels
never see on CUDA (they are chosen for half types with head dims they were built for). These cases stay cheap on
the CPU: one batch of 2, 8 query heads on 2 key/value heads, 128 queries against 192 keys.
"""

from __future__ import annotations

import pytest
import torch

from multihead import masks
from multihead.functional import attention
from support import assert_within_rule, make_qkv, randn, textbook_lowp

pytestmark = pytest.mark.portable

B, H, G, QUERIES, KEYS = 2, 8, 2, 128, 192  # GQA, 4 query heads a group; i < j: causal empties no row


def make_mask(kind: str, device: torch.device):
    if kind == "causal":
        return masks.causal()  # bottom-right: the last query sees the last key
    if kind == "window":
        return masks.window(48, 0)  # 48 keys back, none ahead: a sliding window
    if kind == "padding":
        return masks.padding(torch.tensor([KEYS, KEYS - 61], device=device))  # batch 1 has 131 real keys
    raise ValueError(kind)


def forward_backward(backend: str, q, k, v, mask, dout):
    """Output and (dq, dk, dv) of one backend, or of the low-precision textbook; q, k, v are fresh leaves."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if backend == "textbook_lowp":
        out = textbook_lowp(q, k, v, mask=mask)[0]
    else:
        out = attention(q, k, v, mask=mask, backend=backend)
    out.backward(dout.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kind", ["causal", "window", "padding"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "tiled", "materialized"])
def test_fused_shapes_forward_and_backward_within_the_rule(backend, d, dtype, kind, device):
    q, k, v = make_qkv(b=B, h=H, g=G, i=QUERIES, j=KEYS, d=d, e=d, seed=d, device=device)
    dout = randn(B, H, QUERIES, d, seed=d + 1, device=device)
    mask = make_mask(kind, device)
    ref64 = forward_backward("reference", q, k, v, mask, dout)
    low = [t.to(dtype) for t in (q, k, v)]
    ref_lowp = forward_backward("textbook_lowp", *low, mask, dout)
    fast = forward_backward(backend, *low, mask, dout)
    for name, f, r64, rlp in zip(("output", "dq", "dk", "dv"), fast, ref64, ref_lowp, strict=True):
        assert f.dtype == dtype and f.device == q.device
        assert_within_rule(f, r64, rlp, what=f"{backend}/d={d}/{dtype}/{kind} {name}")
