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
from support import assert_forward_backward_within_rule, make_qkv, randn

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


@pytest.mark.parametrize("kind", ["causal", "window", "padding"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "tiled", "materialized"])
def test_fused_shapes_forward_and_backward_within_the_rule(backend, d, dtype, kind, device):
    q, k, v = make_qkv(b=B, h=H, g=G, i=QUERIES, j=KEYS, d=d, e=d, seed=d, device=device)
    dout = randn(B, H, QUERIES, d, seed=d + 1, device=device)
    mask = make_mask(kind, device)
    fast = assert_forward_backward_within_rule(backend, q, k, v, mask, dout, dtype, f"{backend}/d={d}/{dtype}/{kind}")
    assert all(f.dtype == dtype and f.device == q.device for f in fast)
