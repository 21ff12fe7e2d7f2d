"""multihead.attention as an entry point: autocast, sizes that cannot fit, meta tensors, selections.

The kernels' numbers are tested against the oracle in test_backends.py; here, what the entry does
before and around them. Sizes are pairwise distinct (b=2, h=6, g=3, i=5, j=7, d=4, e=3).
"""

from __future__ import annotations

import pytest
import torch

from multihead import WeightSelection, attention, attention_result, explain, masks
from support import is_input_error, make_qkv

BACKENDS = ["auto", "sdpa", "tiled", "materialized", "reference"]


@pytest.mark.parametrize(
    "options",
    [
        dict(backend="tiled"),
        dict(return_lse=True),
        dict(backend="auto"),
        dict(backend="materialized", return_weights=True),
        dict(backend="reference", return_weights=True, return_lse=True),
    ],
    ids=["tiled", "lse", "auto", "materialized-weights", "reference-all"],
)
@pytest.mark.portable
def test_autocast_computes_as_if_called_in_the_autocast_dtype(options, device):
    """Under torch.autocast the inputs are cast as SDPA's are and the kernel runs unaffected by autocast."""
    leaves = make_qkv(dtype=torch.float32, requires_grad=True, device=device)
    mask = masks.causal() & masks.padding(torch.tensor([7, 4], device=device))
    with torch.autocast(device.type, dtype=torch.bfloat16):
        result = attention_result(*leaves, mask=mask, **options)
    expected = attention_result(*(t.detach().bfloat16() for t in leaves), mask=mask, **options)
    for name, got, want in zip(("output", "weights", "lse"), result, expected, strict=True):
        if want is not None:
            assert got.dtype == (torch.float32 if name == "lse" else torch.bfloat16)  # the LSE is never half
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    output = result.output
    output.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 and t.grad.isfinite().all() for t in leaves)


@pytest.mark.portable
def test_autocast_leaves_float64_alone(device):
    q, k, v = make_qkv(dtype=torch.float64, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        output = attention(q, k, v, causal=True)
    assert output.dtype == torch.float64


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_that_cannot_exist_in_memory_are_refused_before_any_kernel_runs(backend):
    q = torch.randn(1, 1, 1, 64)
    k = torch.randn(1, 1, 1, 64).expand(1, 1, 2**40, 64)  # a view costs nothing; its keys would be 256 TiB
    with pytest.raises(ValueError, match="k: expected a tensor to fit in this machine's memory") as info:
        attention(q, k, k, backend=backend)
    assert is_input_error(info.value, ValueError) and "256.0 TiB" in str(info.value)


def test_all_weights_that_cannot_fit_are_refused_with_the_selection_as_the_fix():
    q = torch.randn(1, 1, 1, 8).expand(1, 1, 2**17, 8)  # 2**34 weights of 4 bytes: 64 GiB
    with pytest.raises(ValueError, match="return_weights: expected the weights to fit") as info:
        attention_result(q, q, q, return_weights=True)
    assert "WeightSelection" in str(info.value)
    with pytest.raises(ValueError, match="return_weights: expected the weights to fit"):
        explain(q, q, q, return_weights=True)


def _meta_call():
    q, k, v = (t.to("meta") for t in make_qkv())
    lengths = torch.tensor([7, 4], device="meta")
    return q, k, v, masks.padding(lengths) & masks.causal() & masks.alibi(masks.alibi_slopes(6).to("meta"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_tensors_give_results_of_the_right_shape(backend):
    """Shape inference on the meta device (deferred initialisation) works with every mask kind."""
    q, k, v, mask = _meta_call()
    result = attention_result(
        q, k, v, mask=mask, backend=backend, return_weights=backend in ("materialized", "reference")
    )
    output = result.output
    assert output.device.type == "meta" and output.shape == (2, 6, 5, 3)


@pytest.mark.parametrize(
    ("queries", "kind", "fragment"),
    [
        (slice(0, 2.5), TypeError, "WeightSelection.queries: expected a slice of ints"),
        (slice(True, 3), TypeError, "WeightSelection.queries: expected a slice of ints"),
        (slice(0, 4, 0), ValueError, "WeightSelection.queries: expected a slice with a positive step"),
        (slice(9, 12), ValueError, "WeightSelection.queries: expected a slice selecting some of the 5 queries"),
    ],
)
@pytest.mark.portable
def test_bad_query_slices_are_refused_in_the_callers_terms(queries, kind, fragment, device):
    with pytest.raises(kind) as info:
        attention_result(*make_qkv(device=device), return_weights=WeightSelection(queries=queries))
    assert is_input_error(info.value, kind) and fragment in str(info.value), str(info.value)


@pytest.mark.portable
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stepped_query_slice_selects_those_rows_with_any_mask(backend, device):
    q, k, v = make_qkv(device=device)
    mask = masks.causal() & masks.padding(torch.tensor([7, 5], device=device))
    selected = attention_result(
        q, k, v, mask=mask, backend=backend, return_weights=WeightSelection(queries=slice(None, None, 2))
    )
    every = attention_result(q, k, v, mask=mask, backend="reference", return_weights=True)
    torch.testing.assert_close(selected.weights, every.weights[:, :, ::2], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "mask",
    [lambda: masks.padding(torch.tensor([1, 2], device="meta")), lambda: masks.alibi(torch.ones(6, device="meta"))],
    ids=["padding", "alibi"],
)
def test_a_mask_tensor_on_meta_for_a_real_call_is_refused_clearly(mask):
    with pytest.raises(ValueError, match="expected a tensor with values, on cpu") as info:
        attention(*make_qkv(), mask=mask())
    assert is_input_error(info.value, ValueError)
