"""Hybrid models (attention beside Mamba mixers, convolutions, linear attention, routers and indexers): the attention
steps are found by what calls transformers' attention function, never by names or attributes. Each family is built
tiny with its attention in the second of its layer kinds (tests/hf_tiny.py); capture numbers the attention layers
0..n-1 in order, names each one's module path, and records the weights eager returns for those layers."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import multihead.integrations.transformers as integration
from hf_tiny import VOCAB, tiny_model
from multihead.lab.inspect import attention_sites, capture

ALTERNATING = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
# the Mamba sizes of a tiny model (its heads times their size are the mixer's width, expand x hidden_size)
TINY_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8)

# family -> (its layer kinds, the attention one second so its layer number differs from its site number, or None
# where every layer attends beside its other mixer; the config's other tiny sizes)
HYBRIDS = {
    "qwen3_next": (ALTERNATING, {}),
    "nemotron_h": (["linear_attention", "full_attention", "moe", "full_attention"], {}),
    "minimax": (ALTERNATING, {}),
    "kimi_linear": (ALTERNATING, {}),
    "bailing_hybrid": (ALTERNATING, {}),
    "granitemoehybrid": (ALTERNATING, TINY_MAMBA),
    "lfm2": (["conv", "full_attention", "conv", "full_attention"], {}),
    "lfm3": (["conv", "full_attention", "conv", "full_attention"], {}),
    "falcon_h1": (None, {**TINY_MAMBA, "mamba_d_ssm": 64}),  # a Mamba mixer beside the attention of every layer
    "zaya": (None, {}),
    "hy_v4": (None, {}),  # every layer attends; each holds an indexer beside its attention
}


def build(family: str) -> torch.nn.Module:
    kinds, sizes = HYBRIDS[family]
    overrides = dict(sizes) if kinds is None else {**sizes, "num_hidden_layers": len(kinds), "layer_types": kinds}
    model = tiny_model(family, **overrides)
    if kinds is not None:  # the kinds asked for survive the config's own checks
        assert list(model.config.layer_types) == kinds
    return model


@pytest.mark.portable
@pytest.mark.parametrize("family", list(HYBRIDS))
def test_sites_are_the_modules_that_call_attention_in_order(family, device):
    theirs = build(family).to(device)
    theirs.set_attn_implementation("eager")
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    kinds = HYBRIDS[family][0] or ["full_attention"] * theirs.config.num_hidden_layers
    attending = [n for n, kind in enumerate(kinds) if kind == "full_attention"]
    sites = attention_sites(ours)
    assert [site.index for site in sites] == list(range(len(attending)))
    assert [site.name.split(".")[2] for site in sites] == [str(n) for n in attending]  # model.layers.<n>.<module>
    for site in sites:
        module = ours.get_submodule(site.name)
        assert integration.calls_attention(module) and not site.name.endswith(("indexer", "router", "gate"))
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        eager = theirs(input_ids=ids, output_attentions=True).attentions
        with capture(ours) as recorder:
            ours(input_ids=ids)
    # eager returns weights for its attention layers only, or a tensor for every layer (MiniMax)
    expected = [eager[n] for n in attending] if len(eager) == len(kinds) else list(eager)
    assert len(expected) == len(sites)
    for number, weights in enumerate(expected):
        torch.testing.assert_close(recorder.weights(number), weights, atol=1e-5, rtol=1e-5)


def test_a_module_that_never_calls_attention_is_not_a_site():
    assert not integration.calls_attention(torch.nn.Linear(2, 2))
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, vocab_size=VOCAB
        )
    )
    assert integration.calls_attention(llama.model.layers[0].self_attn)
    assert not integration.calls_attention(llama.model.layers[0].mlp)
