"""multihead.lab.circuits against TransformerLens (its TransformerBridge over the same tiny random GPT-2 and Llama).

TransformerLens runs the transformers model with its eager attention and its own hooks; we run a copy of the
same weights with attn_implementation="multihead". Compared: activation patching (TransformerLens'
``transformer_lens.patching`` sweeps, with the normalised logit difference as their metric), the head detectors
(its detection patterns and "mul" score on its cached patterns), direct logit attribution (its
``stack_head_results(apply_ln=True)`` through W_U), the logit lens (its accumulated residual through its
final norm and unembedding), and each head's weights, composition scores and QK/OV singular values. Nothing
is downloaded: the bridge is given the model and a local tokenizer.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers
from transformer_lens import head_detector, patching
from transformer_lens.model_bridge import TransformerBridge

import hf_checkpoints
from multihead.integrations import transformers as integration
from multihead.lab.circuits import (
    COMPOSITIONS,
    DETECTORS,
    activation_patching,
    composition_scores,
    detect_heads,
    head_circuit,
    head_weights,
    repeated_random_tokens,
)
from multihead.lab.circuits.lens import direct_logit_attribution, logit_lens
from test_integrations_transformers import VOCAB, build

ANSWER, WRONG = 5, 11
# the adapter TransformerLens picks for each architecture goes by a model name of that family
BRIDGE_NAMES = {"gpt2": "gpt2", "llama": "meta-llama/Llama-2-7b-hf"}
# Llama's eager attention takes its softmax in float32 (GPT-2's stays in float64); TransformerLens' sweeps add a
# little float32 rounding of their own (1e-8 measured)
TOLERANCE = {"gpt2": 1e-6, "llama": 1e-5}


@pytest.fixture(scope="module", params=list(BRIDGE_NAMES))
def models(request, tmp_path_factory):
    """(name, TransformerLens' bridge over the eager model, our copy on the kernel), float64, eval mode."""
    name = request.param
    theirs = build(name).to(torch.float64).eval()
    theirs.set_attn_implementation("eager")
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    folder = tmp_path_factory.mktemp(f"{name}-tokenizer")
    hf_checkpoints.tokenizer("byte_bpe").save_pretrained(folder)  # the bridge reloads it by its folder
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    logging.disable(logging.WARNING)  # the bridge warns about a model name that names no downloaded model
    try:
        bridge = TransformerBridge.boot_transformers(
            BRIDGE_NAMES[name], hf_model=theirs, tokenizer=tokenizer, dtype=torch.float64
        )
    finally:
        logging.disable(logging.NOTSET)
    return name, bridge, ours


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    clean = torch.randint(3, VOCAB, (2, 7), generator=generator)
    corrupt = clean.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 17) % VOCAB
    return clean, corrupt


SWEEPS = {
    ("z", "head"): "get_act_patch_attn_head_out_all_pos",
    ("q", "head"): "get_act_patch_attn_head_q_all_pos",
    ("k", "head"): "get_act_patch_attn_head_k_all_pos",
    ("v", "head"): "get_act_patch_attn_head_v_all_pos",
    ("pattern", "head"): "get_act_patch_attn_head_pattern_all_pos",
    ("z", "position"): "get_act_patch_attn_out",  # every head of a layer at one position: the layer's output there
}


@pytest.mark.parametrize("what, by", list(SWEEPS))
def test_activation_patching_equals_transformer_lens(models, what, by):
    name, bridge, ours = models
    clean, corrupt = prompts()

    def difference(logits):
        return (logits[:, -1, ANSWER] - logits[:, -1, WRONG]).mean()

    with torch.no_grad():
        clean_logits, clean_cache = bridge.run_with_cache(clean)
        clean_difference, corrupt_difference = difference(clean_logits), difference(bridge(corrupt))
    sweep = getattr(patching, SWEEPS[what, by])
    expected = sweep(
        bridge,
        corrupt,
        clean_cache,
        lambda logits: (difference(logits) - corrupt_difference) / (clean_difference - corrupt_difference),
    )
    result = activation_patching(ours, clean, corrupt, answer=ANSWER, wrong=WRONG, what=what, by=by)
    assert result.scores.shape == expected.shape
    torch.testing.assert_close(result.scores, expected.detach().double(), rtol=0, atol=TOLERANCE[name])


def test_head_detectors_equal_transformer_lens(models):
    name, bridge, ours = models
    ids = repeated_random_tokens(VOCAB, 5, batch=2, seed=1, low=3)
    found = detect_heads(ours, ids)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    patterns = {
        "previous_token": head_detector.get_previous_token_head_detection_pattern,
        "duplicate_token": head_detector.get_duplicate_token_head_detection_pattern,
        "induction": head_detector.get_induction_head_detection_pattern,
    }
    assert set(patterns) == set(DETECTORS)
    for layer in range(found.induction.shape[0]):
        weights = cache["pattern", layer]  # (b, h, i, j)
        for head in range(weights.shape[1]):
            for detector, pattern in patterns.items():
                expected = [
                    head_detector.compute_head_attention_similarity_score(
                        weights[row, head].clone(),
                        pattern(ids[row : row + 1]).to(weights),
                        exclude_bos=False,
                        exclude_current_token=False,
                        error_measure="mul",
                    )
                    for row in range(ids.shape[0])
                ]
                score = float(getattr(found, detector)[layer, head])
                assert score == pytest.approx(sum(expected) / len(expected), abs=TOLERANCE[name])


def test_direct_logit_attribution_equals_transformer_lens(models):
    name, bridge, ours = models
    clean, _ = prompts()
    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean)
        # every head's output at the last position through the final norm, frozen at the final residual
        stacked = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=True)  # (layers x heads, b, hidden)
        direction = bridge.W_U[:, ANSWER] - bridge.W_U[:, WRONG]
        expected = (stacked @ direction).mean(-1).reshape(len(bridge.blocks), -1)
    found = direct_logit_attribution(ours, clean, answer=ANSWER, wrong=WRONG)
    torch.testing.assert_close(found.heads, expected.double(), rtol=0, atol=TOLERANCE[name])
    # the parts of the residual stream, through the same linearised norm, sum to the logit difference itself
    assert found.explained == pytest.approx(found.difference, abs=TOLERANCE[name])


def test_logit_lens_equals_transformer_lens(models):
    name, bridge, ours = models
    clean, _ = prompts()
    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean)
        residuals = cache.accumulated_resid(layer=None, incl_mid=False, apply_ln=False, pos_slice=-1)
        expected = bridge.unembed(bridge.ln_final(residuals))  # (layers + 1, b, vocab)
    lens = logit_lens(ours, clean, answer=ANSWER, wrong=WRONG)
    torch.testing.assert_close(lens.logits, expected, rtol=0, atol=TOLERANCE[name])
    assert torch.equal(lens.top, lens.logits.topk(5, dim=-1).indices)
    last = expected[:, :, ANSWER] - expected[:, :, WRONG]
    torch.testing.assert_close(lens.differences, last.mean(1), rtol=0, atol=TOLERANCE[name])


def test_head_weights_and_composition_scores_equal_transformer_lens(models):
    _, bridge, ours = models
    weights = head_weights(ours)
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        theirs = getattr(bridge, name)
        if name in ("W_K", "W_V"):  # TransformerLens' key/value heads, repeated for the query heads they serve
            theirs = bridge._expand_kv_heads(theirs)
        torch.testing.assert_close(getattr(weights, name), theirs.detach(), rtol=0, atol=1e-15)
    for mode in COMPOSITIONS:
        expected = bridge.all_composition_scores(mode).scores.detach()
        found = composition_scores(ours, mode)
        later = torch.ones(2, 2, dtype=torch.bool).triu(1)[:, None, :, None].expand_as(found)  # layer 0 -> 1 only
        torch.testing.assert_close(found[later], expected[later], rtol=0, atol=1e-12)
        assert bool(found[~later].isnan().all())
    circuit = head_circuit(ours, 1, 2)
    torch.testing.assert_close(circuit.ov, bridge.OV[1, 2].S.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(circuit.qk, bridge.QK[1, 2].S.detach(), rtol=0, atol=1e-12)
