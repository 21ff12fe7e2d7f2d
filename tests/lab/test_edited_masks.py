"""Masks that models edit: transformers' models index the mask they are handed (Gemma 4's KV-shared layers keep the
last query rows, DeepSeek-V3.2's indexer reads one head). Our typed mask indexes as the dense mask it stands for,
so Gemma 4 with KV-shared layers equals eager in forward, generate and capture (it raised TypeError: 'TransformersMask'
object is not subscriptable)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import multihead.integrations.transformers as integration
from hf_tiny import VOCAB, first_output, tiny_model
from multihead import masks
from multihead.integrations.transformers_masks import TransformersMask
from multihead.lab.inspect import attention_sites, capture

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def gemma4_twins(device) -> tuple[torch.nn.Module, torch.nn.Module]:
    theirs = tiny_model("gemma4", num_hidden_layers=4, num_kv_shared_layers=2).to(device)
    theirs.set_attn_implementation("eager")
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    return theirs, ours


def ids(device) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)


def test_indexing_the_typed_mask_indexes_the_dense_mask_it_stands_for():
    mask = TransformersMask([masks.causal(), masks.window(2, 0)], batch=2, q_length=5, kv_length=7, device="cpu")
    dense = mask.dense()
    assert dense.shape == (2, 1, 5, 7) and not dense.all()
    for index in ((slice(None), slice(None), slice(-1, None), slice(None)), (slice(None), 0), (0,)):
        assert torch.equal(mask[index], dense[index])


@pytest.mark.portable
@pytest.mark.parametrize("keep", [0, 1], ids=["all-logits", "last-logit"])
def test_gemma4_kv_shared_forward_equals_eager(keep, device):
    theirs, ours = gemma4_twins(device)
    with torch.no_grad():
        expected = first_output(theirs, input_ids=ids(device), logits_to_keep=keep)
        got = first_output(ours, input_ids=ids(device), logits_to_keep=keep)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.portable
def test_gemma4_kv_shared_generates_and_captures_as_eager(device):
    theirs, ours = gemma4_twins(device)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    prompt = ids(device)[:, :4]
    with torch.no_grad():
        assert torch.equal(ours.generate(prompt, **settings), theirs.generate(prompt, **settings))
        eager = theirs(input_ids=ids(device), output_attentions=True).attentions
        with capture(ours) as recorder:
            ours(input_ids=ids(device))
    sites = attention_sites(ours)
    assert len(sites) == len(eager) == 4
    for site in sites:
        torch.testing.assert_close(recorder.weights(site.index), eager[site.index], atol=1e-5, rtol=1e-5)


@pytest.mark.portable
def test_gemma4_kv_shared_gradients_equal_transformers_own_attention(device):
    """Against sdpa, whose float32 softmax rounds as ours (eager's differs from both by 8e-5 of the largest
    gradient here, its own rounding)."""
    theirs, ours = gemma4_twins(device)
    theirs.set_attn_implementation("sdpa")
    batch = {"input_ids": ids(device)}
    expected, got = first_output(theirs, **batch), first_output(ours, **batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2)).to(device)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    named = dict(ours.named_parameters())
    for name, parameter in theirs.named_parameters():
        if parameter.grad is not None:
            scale = float(parameter.grad.abs().max()) + 1.0
            torch.testing.assert_close(named[name].grad, parameter.grad, atol=1e-5 * scale, rtol=1e-5, msg=name)
