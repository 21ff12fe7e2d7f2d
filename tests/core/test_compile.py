"""The layer under torch.compile and torch.export: one graph for every sequence length, no graph break
for any typed mask, and the eager results.

Graph counts and breaks are decided by dynamo, whatever the backend, so most cases compile with
backend="eager" (seconds); one case goes through inductor, the default, end to end.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from multihead import MultiHeadAttention, masks

LENGTHS = (5, 7, 11, 13)


def _mask_cases():
    """name -> (extra call inputs for length n, how the layer is called with them)."""
    return {
        "none": (lambda n: (), lambda layer, x: layer(x)),
        "causal": (lambda n: (), lambda layer, x: layer(x, causal=True)),
        "padding lengths": (
            lambda n: (torch.tensor([n, n - 3]),),
            lambda layer, x, lengths: layer(x, mask=masks.padding(lengths)),
        ),
        "padding valid": (
            lambda n: (torch.arange(n)[None] < torch.tensor([[n], [2]]),),
            lambda layer, x, valid: layer(x, mask=masks.padding(valid)),
        ),
        "window": (lambda n: (), lambda layer, x: layer(x, mask=masks.window(3, 1))),
        "causal alibi": (lambda n: (), lambda layer, x: layer(x, causal=True, mask=masks.alibi(masks.alibi_slopes(4)))),
        "bool tensor": (
            lambda n: (torch.ones(n, n, dtype=torch.bool).tril(),),
            lambda layer, x, keep: layer(x, mask=keep),
        ),
        "bias tensor": (lambda n: (torch.randn(2, 1, 1, n),), lambda layer, x, bias: layer(x, mask=masks.bias(bias))),
        "combined": (
            lambda n: (torch.tensor([n, 4]),),
            lambda layer, x, lengths: layer(
                x, causal=True, mask=masks.padding(lengths) & masks.window(4, 0) & masks.alibi(masks.alibi_slopes(4))
            ),
        ),
    }


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _layer() -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(32, 4, num_kv_heads=2, rotary=True).eval()


@pytest.mark.parametrize("case", list(_mask_cases()))
def test_one_graph_for_every_length_and_no_graph_break(case, fresh_dynamo):
    inputs_for, call = _mask_cases()[case]
    layer = _layer()
    compiled = torch.compile(lambda x, *extra: call(layer, x, *extra)[0], dynamic=True, backend="eager")
    with torch.no_grad():
        for n in LENGTHS:
            x, extra = torch.randn(2, n, 32), inputs_for(n)
            torch.testing.assert_close(compiled(x, *extra), call(layer, x, *extra)[0], rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_inductor_compiles_the_layer_once_for_all_lengths(fresh_dynamo):
    layer = _layer()
    compiled = torch.compile(layer, dynamic=True)
    with torch.no_grad():
        for n in LENGTHS[:3]:
            x = torch.randn(2, n, 32)
            torch.testing.assert_close(compiled(x, causal=True)[0], layer(x, causal=True)[0], rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


class _Exported(torch.nn.Module):
    def __init__(self, layer: MultiHeadAttention, call):
        super().__init__()
        self.layer, self.call = layer, call

    def forward(self, x, extra: tuple):
        return self.call(self.layer, x, *extra)[0]


@pytest.mark.parametrize("case", ["causal", "window", "causal alibi", "padding lengths"])
def test_export_takes_a_dynamic_sequence_length(case):
    inputs_for, call = _mask_cases()[case]
    layer = _layer()
    seq = torch.export.Dim("seq", min=2, max=4096)
    example = (torch.randn(2, 9, 32), inputs_for(9))
    shapes = ({1: seq}, tuple(None for _ in example[1]))  # the extra inputs keep their example sizes
    program = torch.export.export(_Exported(layer, call), example, dynamic_shapes=shapes)
    with torch.no_grad():
        for n in (3, 17, 40):
            x, extra = torch.randn(2, n, 32), inputs_for(n)
            torch.testing.assert_close(program.module()(x, extra), call(layer, x, *extra)[0], rtol=1e-6, atol=1e-6)


def test_weights_and_lse_compile_to_one_graph_for_every_length(fresh_dynamo):
    """auto passes over the blocked kernels while compiling (their Python loops would pin the length)."""
    from multihead import attention_result

    layer = _layer()
    weights_call = torch.compile(lambda x: layer(x, causal=True, need_weights=True), dynamic=True, backend="eager")
    lse_call = torch.compile(
        lambda q, k, v: attention_result(q, k, v, causal=True, return_lse=True), dynamic=True, backend="eager"
    )
    with torch.no_grad():
        for n in LENGTHS:
            x, q = torch.randn(2, n, 32), torch.randn(2, 4, n, 8)
            for got, want in zip(weights_call(x), layer(x, causal=True, need_weights=True), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            for got, want in zip(
                lse_call(q, q, q), attention_result(q, q, q, causal=True, return_lse=True), strict=True
            ):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # one per compiled function
    assert not counters["graph_break"], dict(counters["graph_break"])
