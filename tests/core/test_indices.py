"""One validator for each kind of argument (issue 32): every entry point takes layers, heads and query rows
through ``multihead._indices.checked_indices``, where a negative index counts from the end (``WeightSelection``
and head surgery refused -1 while capture and the reports took it as the last one), and a dropout probability
through ``multihead._errors.checked_probability``."""

from __future__ import annotations

import pytest
import torch

import multihead
from multihead import WeightSelection
from multihead._indices import checked_indices
from multihead.capture import capture


def test_the_validator_counts_negatives_from_the_end_and_names_the_range():
    assert checked_indices("heads", [-1, 0, -4], 4, "head") == [3, 0, 0]
    assert checked_indices("heads", 2, 4, "head") == [2] and checked_indices("heads", None, 3, "head") == [0, 1, 2]
    with pytest.raises(ValueError, match=r"^heads: expected head indices in 0\.\.3 \(or -4\.\.-1, from the end\)"):
        checked_indices("heads", [-5], 4, "head")
    with pytest.raises(ValueError, match="heads: expected each head once, got head 3 twice"):
        checked_indices("heads", [3, -1], 4, "head", distinct=True)
    for bad in ("01", [1.0], [True], object()):
        with pytest.raises(TypeError, match="heads: expected"):
            checked_indices("heads", bad, 4, "head")


def test_a_set_is_refused_where_the_order_is_the_results_and_taken_where_it_is_not():
    """A WeightSelection given a set took the set's iteration order for its rows: refused wherever the result comes
    in the order given; head surgery, whose order does not matter, takes a set."""
    with pytest.raises(TypeError, match=r"^rows: expected an ordered list of query indices .* got a set"):
        checked_indices("rows", {2, 0}, 4, "query")
    assert checked_indices("heads", {2, 0}, 4, "head", ordered=False) in ([0, 2], [2, 0])
    layer = multihead.MultiHeadAttention(16, 4)
    layer.ablate_heads({3, 1})
    assert layer.head_ablation is not None and layer.head_ablation.heads == (1, 3)


@pytest.mark.portable
def test_minus_one_is_the_last_head_and_row_everywhere(device):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 8, device=device) for _ in range(3))
    full = multihead.attention_result(q, k, v, return_weights=True).weights  # (1, 4, 5, 5)
    last = multihead.attention_result(q, k, v, return_weights=WeightSelection(heads=[-1], queries=[-1])).weights
    torch.testing.assert_close(last, full[:, 3:, 4:])

    layer = multihead.MultiHeadAttention(16, 4, device=device)
    x = torch.randn(2, 5, 16, device=device)
    with capture(layer, heads=[-1]) as recorder:
        layer(x)
    assert recorder.weights(0, 3).shape == (2, 5, 5)  # head -1 recorded as head 3

    ablated_last, ablated_three = (multihead.MultiHeadAttention(16, 4, device=device) for _ in range(2))
    ablated_three.load_state_dict(ablated_last.state_dict())
    ablated_last.ablate_heads([-1])
    ablated_three.ablate_heads([3])
    torch.testing.assert_close(ablated_last(x), ablated_three(x))


@pytest.mark.parametrize("where", ["attention", "layer", "compat"])
@pytest.mark.parametrize(
    "bad, kind",
    [("0.1", TypeError), (True, TypeError), (1.0, ValueError), (-0.1, ValueError), (float("nan"), ValueError)],
)
def test_attention_the_layer_and_compat_check_dropout_alike(where, bad, kind):
    """One check of a probability (multihead._errors.checked_probability): the layer refused a string dropout
    as a ValueError where attention and compat said TypeError, and refused a numpy float32 as no number."""
    from multihead.compat import MultiheadAttention

    q = torch.randn(1, 2, 3, 4)
    calls = {
        "attention": lambda: multihead.attention(q, q, q, dropout=bad, training=True),
        "layer": lambda: multihead.MultiHeadAttention(8, 2, dropout=bad),
        "compat": lambda: MultiheadAttention(8, 2, dropout=bad),
    }
    with pytest.raises(kind, match=r"^dropout: expected a probability in \[0, 1\)"):
        calls[where]()
