"""Attention rollout (multihead.lab.circuits.rollout) against Abnar & Zuidema's formula written out on transformers' own
eager attention weights: the product of every layer's head-averaged attention mixed with the identity."""

from __future__ import annotations

import copy

import pytest
import torch

from multihead.integrations import transformers as integration
from multihead.lab.circuits import attention_rollout
from support import is_input_error
from test_integrations_transformers import VOCAB, build


def pair(name: str):
    theirs = build(name).to(torch.float64).eval()
    theirs.set_attn_implementation("eager")
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    return theirs, ours


def ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "bare"])
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_rollout_is_the_product_of_the_mixed_layers(name, residual):
    theirs, ours = pair(name)
    with torch.no_grad():
        layers = theirs(ids(), output_attentions=True).attentions  # per layer (b, h, n, n)
    mixed = [
        w.mean(1) * (0.5 if residual else 1.0) + (0.5 * torch.eye(6, dtype=torch.float64) if residual else 0)
        for w in layers
    ]
    expected = mixed[-1]
    for layer in reversed(mixed[:-1]):
        expected = expected @ layer  # the last layer on the left: A_L ... A_1
    flow = attention_rollout(ours, ids(), queries=[0, -1], residual=residual)
    assert flow.shape == (2, 2, 6)
    torch.testing.assert_close(flow, expected[:, [0, 5]], rtol=0, atol=1e-12)
    torch.testing.assert_close(flow.sum(-1), torch.ones(2, 2, dtype=torch.float64), rtol=0, atol=1e-12)
    if name == "gpt2":  # causal: a position's rollout never reaches a later token
        assert float(attention_rollout(ours, ids(), queries=2)[:, :, 3:].abs().max()) == 0.0
    assert attention_rollout(ours, ids()).shape == (2, 6, 6)


@pytest.mark.parametrize(
    "call, kind, fragment",
    [
        (lambda m: attention_rollout(m, "text"), TypeError, "ids: expected token ids"),
        (lambda m: attention_rollout(m, ids(), queries=6), ValueError, "queries"),
        (lambda m: attention_rollout(m, ids(), residual=1), TypeError, "residual: expected True or False"),
    ],
)
def test_bad_arguments_are_named(call, kind, fragment):
    _, ours = pair("gpt2")
    with pytest.raises(kind) as raised:
        call(ours)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)
