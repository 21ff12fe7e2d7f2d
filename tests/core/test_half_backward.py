"""Half-precision gradients within FlashAttention's tolerance rule on every backend auto can choose, where many
queries share few keys (FlashAttention's test_flash_attn_splitkv with its lengths swapped: 20000 queries over 16
keys). torch's CPU SDPA backward summed dK and dV over its query blocks in half precision and missed the rule
(bfloat16 dV 1.25 from float64 where the rule allowed 0.41); auto must never choose a path that does.
"""

from __future__ import annotations

import pytest
import torch

import multihead
from multihead.backends import costs
from support import assert_within_rule, auto_candidates, randn, textbook_lowp

HEADS, QUERIES, KEYS, DIM = 2, 20000, 16, 64


def gradients(run, q, k, v, grad_out):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = run(*leaves)
    out.backward(grad_out)
    return [t.grad for t in leaves]


@pytest.mark.portable
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_many_queries_over_few_keys_give_gradients_within_the_rule(dtype, device):
    q = randn(1, HEADS, QUERIES, DIM, seed=0, device=device, dtype=dtype)
    k, v = (randn(1, HEADS, KEYS, DIM, seed=n, device=device, dtype=dtype) for n in (1, 2))
    grad_out = randn(1, HEADS, QUERIES, DIM, seed=3, device=device, dtype=dtype)
    exact = gradients(
        lambda q, k, v: multihead.attention(q, k, v, backend="reference"), *(t.double() for t in (q, k, v, grad_out))
    )
    textbook = gradients(lambda q, k, v: textbook_lowp(q, k, v)[0], q, k, v, grad_out)
    candidates = auto_candidates(q.requires_grad_(), k, v)
    assert "sdpa" in candidates  # served, and now within the rule
    for backend in ["auto", *candidates]:
        got = gradients(lambda q, k, v, name=backend: multihead.attention(q, k, v, backend=name), q, k, v, grad_out)
        for name, grad, want, low in zip(("dq", "dk", "dv"), got, exact, textbook, strict=True):
            assert_within_rule(grad, want, low, what=f"{backend} {name}")


def test_sdpa_runs_a_half_backward_in_float32_on_the_cpu_whatever_the_rates():
    """Accuracy first: the rates may say bfloat16 is faster (a CPU with bf16 units); with gradients SDPA computes
    in float32 all the same, and without them the rates still decide."""
    kind = multihead.backends.policy.current_policy().kind_of(torch.device("cpu"))
    for label in costs.HALF_BACKWARD_INACCURATE_ON_CPU:
        for dtype in (torch.bfloat16, torch.float16):
            chosen = costs.faster_compute_dtype(label, dtype, kind, True, flops=1.0, cast_bytes=10**12)
            assert chosen == torch.float32
