"""The architectures of 2025-26 with learned attention sinks, on attn_implementation="multihead", against their own
eager attention: tiny random models built from each config's defaults (tests/hf_tiny.py), logits in float32,
gradients (the sinks' own included), greedy generation and the captured weights."""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch

import multihead.integrations.transformers as integration
from hf_tiny import VOCAB, assert_outputs_and_gradients_equal, tiny_model
from multihead.lab.inspect import attention_sites, capture

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# each passes its sinks to the attention function: an (h,) parameter as s_aux, Inkling 2 a per-row column as sinks
SINK_ARCHITECTURES = [
    "gpt_oss",
    "deepseek_v4",
    "mimo_v2_flash",
    "granite_swa",
    "granitemoe_swa",
    "hy_v4",
    "flint",
    "inkling2",
]
# Inkling 2's config builds a base model here (no causal LM class takes it): the others generate
GENERATING = [name for name in SINK_ARCHITECTURES if name != "inkling2"]
LENGTH = 12
# whose eager returns the sink-free softmax as its weights (the output is scaled after it)
SINK_FREE_WEIGHTS = {"granite_swa", "granitemoe_swa"}  # past the tiny sliding windows (4 keys)


def twins(model_type: str, device, **overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    theirs = tiny_model(model_type, **overrides).to(device)
    with torch.no_grad():  # sinks large enough to take a visible share (their initial values are often 0)
        for name, parameter in theirs.named_parameters():
            if name.endswith("sinks"):
                parameter.copy_(torch.linspace(-1.0, 2.0, parameter.numel()).view_as(parameter))
    theirs.set_attn_implementation("eager")
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    return theirs, ours


def batch(device) -> dict:
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1)).to(device)
    return {"input_ids": ids}


def assert_greedy_generation_equal(theirs: torch.nn.Module, ours: torch.nn.Module, device) -> None:
    """8 greedy new tokens after the first 5 of :func:`batch`: the same from both models."""
    prompt = batch(device)["input_ids"][:, :5]
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(ours.generate(prompt, **settings), theirs.generate(prompt, **settings))


def has_sinks(model: torch.nn.Module) -> bool:
    return any(name.endswith("sinks") or "sink_proj" in name for name, _ in model.named_parameters())


@pytest.mark.portable
@pytest.mark.parametrize("model_type", SINK_ARCHITECTURES)
def test_logits_and_gradients_equal_eager(model_type, device):
    theirs, ours = twins(model_type, device)
    assert has_sinks(theirs)
    assert_outputs_and_gradients_equal(theirs, ours, 1e-4, **batch(device))


@pytest.mark.portable
def test_deepseek_v4_compressed_keys_equal_eager(device):
    """DeepSeek-V4's compressed layers append compressed keys to the window's and their 0/-inf block bias to the
    mask, in the mask's dtype: a bool mask would turn that bias around, a typed one would miss the keys. Both kinds
    of compressed layer compress here (every 4 tokens), the indexer picking fewer blocks than there are."""
    kinds = ["compressed_sparse_attention", "heavily_compressed_attention"]
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 4}
    theirs, ours = twins("deepseek_v4", device, layer_types=kinds, compress_rates=rates)
    assert_outputs_and_gradients_equal(theirs, ours, 1e-4, **batch(device))
    assert_greedy_generation_equal(theirs, ours, device)


@pytest.mark.portable
@pytest.mark.parametrize("model_type", GENERATING)
def test_greedy_generation_equals_eager(model_type, device):
    theirs, ours = twins(model_type, device)
    assert_greedy_generation_equal(theirs, ours, device)


@pytest.mark.portable
@pytest.mark.parametrize("model_type", SINK_ARCHITECTURES)
def test_captured_weights_are_those_eager_applies(model_type, device):
    """Capture records the weights applied, over the keys (rows sum to 1 - the sink's share). Eager returns
    those too, but Granite-SWA's: it scales the output after a sink-free softmax and returns that softmax."""
    theirs, ours = twins(model_type, device)
    inputs = batch(device)
    with torch.no_grad():
        eager = theirs(**inputs, output_attentions=True).attentions
        with capture(ours) as recorder:
            ours(**inputs)
    compared = 0
    for site in attention_sites(ours):
        layer = re.fullmatch(r"(?:model|language_model)\.layers\.(\d+)\.self_attn", site.name)
        if layer is None:  # Inkling 2: its attention over block states, its vision tower (eager returns neither)
            continue
        got, expected = recorder.weights(site.index), eager[int(layer.group(1))]
        if model_type in SINK_FREE_WEIGHTS:
            expected = expected * got.sum(-1, keepdim=True)  # its softmax, scaled by each row's kept share
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        compared += 1
        assert compared == 1 or (got.sum(-1) <= 1 + 1e-6).all()
    config = getattr(theirs.config, "text_config", None) or theirs.config
    assert compared == config.num_hidden_layers
    # the sinks took a share of some rows (MiMo-V2-Flash has them in its sliding-window layers only)
    assert any((recorder.weights(site.index).sum(-1) < 1 - 1e-3).any() for site in attention_sites(ours))
