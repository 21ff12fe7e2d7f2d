"""Head importance on transformers checkpoints through their attention steps (no pruning needed).

The same BERT save read two ways — transformers' modules on our kernel, and our own encoder — must give
the same importance scores: the ablation and the gates act on the attention step either way.
"""

from __future__ import annotations

import pytest
import torch

from hf_checkpoints import SENTENCES, build
from multihead.integrations.transformers_models import load_model
from multihead.lab.inspect.importance import ablated, ablation_importance, gradient_importance, pruning_curve
from multihead.lab.models import load_encoder


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    """A BERT save whose heads matter: random init leaves attention outputs far below the residual stream
    (every head's ablation would round to a cosine of 1), so the attention weights are scaled up."""
    model, tokenizer = build("bert")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".attention." in name and name.endswith("weight") and "LayerNorm" not in name:
                parameter.mul_(8.0)
    folder = tmp_path_factory.mktemp("checkpoints") / "bert"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_ablation_importance_of_the_wrapped_model_equals_our_encoders(bert_folder):
    wrapped, ours = load_model(bert_folder), load_encoder(bert_folder)
    for how in ("zero", "uniform"):
        got = ablation_importance(wrapped, SENTENCES, how=how)
        expected = ablation_importance(ours, SENTENCES, how=how)
        assert got.scores.shape == (2, 4) and torch.isfinite(got.scores).all() and (got.scores > 0).any()
        torch.testing.assert_close(got.scores, expected.scores, atol=1e-5, rtol=1e-4)


def test_an_ablation_changes_the_wrapped_model_only_inside_the_block(bert_folder):
    wrapped = load_model(bert_folder)
    plain = wrapped.encode(SENTENCES)
    with ablated(wrapped, {1: [0, 2]}):
        changed = wrapped.encode(SENTENCES)
    assert (changed - plain).abs().max() > 1e-4
    torch.testing.assert_close(wrapped.encode(SENTENCES), plain, atol=0, rtol=0)


def test_gradient_importance_of_the_wrapped_model_equals_our_encoders(bert_folder):
    wrapped, ours = load_model(bert_folder), load_encoder(bert_folder)

    def loss(model, texts):  # pull each text's mean-pooled states towards the first's (encode has no autograd)
        batch = model.tokenizer.batch(texts)
        states = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        embeddings = torch.nn.functional.normalize(model.mean_pool(states, batch.attention_mask), dim=-1)
        return -(embeddings @ embeddings[0]).sum()

    for model in (wrapped, ours):
        model.eval()
    with torch.enable_grad():
        got = gradient_importance(wrapped, loss, [SENTENCES])
        expected = gradient_importance(ours, loss, [SENTENCES])
    assert torch.isfinite(got.scores).all() and (got.scores > 0).all()
    torch.testing.assert_close(got.scores, expected.scores, atol=1e-6, rtol=1e-4)


def test_pruning_a_model_that_cannot_remove_heads_says_to_ablate(bert_folder):
    wrapped = load_model(bert_folder)
    with pytest.raises(TypeError, match="model: expected a model whose heads can be removed .* ablation_importance"):
        pruning_curve(wrapped, SENTENCES, torch.zeros(2, 4))
