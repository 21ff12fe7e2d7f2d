"""Head detectors (multihead.lab.circuits.detectors) against TransformerLens' definitions, written out here position by
position, on transformers' own eager attention weights of a tiny random GPT-2 and Llama."""

from __future__ import annotations

import copy

import pytest
import torch

from multihead.integrations import transformers as integration
from multihead.lab.circuits import (
    DETECTORS,
    SINK_THRESHOLD,
    HeadDetection,
    detect_heads,
    detection_patterns,
    repeated_random_tokens,
)
from support import is_input_error
from test_integrations_transformers import VOCAB, build


def patterns_by_hand(tokens: list[int]) -> dict[str, torch.Tensor]:
    """TransformerLens' head_detector patterns, one entry at a time: previous-token (i, i - 1); duplicate-token
    (i, j) for j < i with the same token; induction (i, j) for 1 <= j <= i where token j - 1 is token i."""
    n = len(tokens)
    found = {name: torch.zeros(n, n) for name in DETECTORS}
    for i in range(n):
        for j in range(i + 1):
            found["previous_token"][i, j] = float(j == i - 1)
            found["duplicate_token"][i, j] = float(j < i and tokens[j] == tokens[i])
            found["induction"][i, j] = float(j >= 1 and tokens[j - 1] == tokens[i])
    return found


def test_detection_patterns_are_transformer_lens_definitions():
    ids = torch.tensor([[7, 3, 9, 3, 7, 3, 9, 9], [1, 2, 3, 4, 1, 2, 3, 4]])
    patterns = detection_patterns(ids)
    for row in range(2):
        expected = patterns_by_hand(ids[row].tolist())
        for name in DETECTORS:
            torch.testing.assert_close(patterns[name][row], expected[name], rtol=0, atol=0)


def test_repeated_random_tokens_repeat_their_first_half_the_same_everywhere():
    ids = repeated_random_tokens(50, 6, batch=3, seed=4, bos=0, low=1)
    assert ids.shape == (3, 13) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:7], ids[:, 7:]) and bool((ids[:, 0] == 0).all()) and int(ids[:, 1:].min()) >= 1
    assert torch.equal(ids, repeated_random_tokens(50, 6, batch=3, seed=4, bos=0, low=1))  # seeded: reproducible
    assert repeated_random_tokens(50, 6).shape == (4, 12)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_scores_are_the_share_of_transformers_own_weights_on_each_pattern(name):
    theirs = build(name).to(torch.float64).eval()
    theirs.set_attn_implementation("eager")
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    ids = repeated_random_tokens(VOCAB, 5, batch=2, seed=1, low=3)
    found = detect_heads(ours, ids)
    assert isinstance(found, HeadDetection) and found.part == "self"
    with torch.no_grad():
        weights = theirs(ids, output_attentions=True).attentions  # per layer (b, h, n, n)
    tolerance = 1e-6 if name == "llama" else 1e-10  # Llama's eager softmax is taken in float32
    for layer, layer_weights in enumerate(weights):
        for head in range(layer_weights.shape[1]):
            for detector in DETECTORS:
                shares = [
                    float((layer_weights[row, head] * patterns_by_hand(ids[row].tolist())[detector].double()).sum())
                    / float(layer_weights[row, head].sum())
                    for row in range(ids.shape[0])
                ]
                expected = sum(shares) / len(shares)
                assert float(getattr(found, detector)[layer, head]) == pytest.approx(expected, abs=tolerance)
            sink = float(layer_weights[:, head, :, 0].mean())  # Gu et al.: weight on the first token, per query
            assert float(found.sink[layer, head]) == pytest.approx(sink, abs=tolerance)


def test_sink_heads_are_those_above_the_threshold():
    sink = torch.tensor([[0.1, 0.35], [0.31, 0.29]])
    zeros = torch.zeros(2, 2)
    found = HeadDetection("self", zeros, zeros, zeros, sink)
    assert SINK_THRESHOLD == 0.3
    assert found.sink_heads() == [(0, 1), (1, 0)]
    assert found.sink_heads(0.32) == [(0, 1)]
    assert found.to_dict()["sink"] == sink.tolist()


@pytest.mark.parametrize(
    "call, kind, fragment",
    [
        (lambda model: detect_heads(model, "tokens"), TypeError, "ids: expected token ids"),
        (lambda model: detect_heads(model, torch.tensor([[3]])), ValueError, "ids: expected at least two tokens"),
        (lambda model: repeated_random_tokens(0, 5), ValueError, "vocab_size"),
        (lambda model: repeated_random_tokens(50, 5, bos=50), ValueError, "bos: expected None or a token id"),
    ],
)
def test_bad_arguments_are_named(call, kind, fragment):
    model = build("gpt2").eval()
    model.set_attn_implementation(integration.IMPLEMENTATION)
    with pytest.raises(kind) as raised:
        call(model)
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)


def test_an_encoder_is_scored_from_its_own_weights_too():
    # BERT's heads see later tokens as well: the detectors still read the weights each head gives
    theirs = build("bert").to(torch.float64).eval()
    theirs.set_attn_implementation("eager")
    ours = copy.deepcopy(theirs)
    ours.set_attn_implementation(integration.IMPLEMENTATION)
    ids = repeated_random_tokens(VOCAB, 4, batch=2, seed=2, low=5)
    found = detect_heads(ours, ids)
    with torch.no_grad():
        weights = theirs(ids, output_attentions=True).attentions
    for layer, layer_weights in enumerate(weights):
        sink = layer_weights[:, :, :, 0].mean((0, 2))  # (heads,)
        torch.testing.assert_close(found.sink[layer], sink, rtol=0, atol=1e-10)


def test_a_pruned_layer_keeps_its_heads_numbers():
    # layer 0 sees the same inputs pruned or not: its surviving heads score what they scored. A Decoder keeps no
    # head_ids: its kept heads are numbered 0, 1 again, and the grid's remaining columns of the layer are NaN
    from multihead.heads import prune_layer
    from multihead.lab.models import Decoder, DecoderConfig

    torch.manual_seed(0)
    whole = Decoder(DecoderConfig(vocab_size=20, hidden=32, layers=2, heads=4, mlp=None)).eval()
    pruned = copy.deepcopy(whole)
    kept = prune_layer(pruned.attention_layers[0], [1, 2])
    ids = repeated_random_tokens(20, 6, batch=2, seed=1, bos=0, low=1)
    before, after = detect_heads(whole, ids), detect_heads(pruned, ids)
    for name in (*DETECTORS, "sink"):
        grid = getattr(after, name)
        assert grid.shape == (2, 4) and grid[0, 2:].isnan().all() and not grid[1].isnan().any()
        torch.testing.assert_close(grid[0, :2], getattr(before, name)[0, kept], rtol=0, atol=1e-6)
    assert after.to_dict()["sink"][0][3] is None  # JSON has no NaN


def test_detector_behaviours_score_a_causal_text_model_only(tmp_path):
    import hf_checkpoints
    from multihead.integrations import load_text_model
    from multihead.lab.circuits import detector_behaviours, probe_heads

    gpt2 = load_text_model(hf_checkpoints.save("gpt2", tmp_path / "gpt2"))
    found = detector_behaviours(gpt2, half_length=5, batch=2, seed=4)
    expected = probe_heads(gpt2, gpt2.tokenizer, half_length=5, batch=2, seed=4)
    assert set(found) == {"previous_token", "duplicate_token", "prefix_matching", "sink"}
    torch.testing.assert_close(found["prefix_matching"], expected.induction.double())  # TL's induction score
    assert detector_behaviours(load_text_model(hf_checkpoints.save("bert", tmp_path / "bert"))) is None


def test_named_heads_are_those_at_a_roles_threshold():
    nan = float("nan")
    grid = {
        "previous_token": torch.tensor([[0.9, 0.1], [0.0, nan]]),
        "duplicate_token": torch.tensor([[0.0, 0.45], [0.39, nan]]),
        "induction": torch.tensor([[0.0, 0.0], [0.8, nan]]),
        "sink": torch.tensor([[0.3, 0.0], [0.9, nan]]),
    }
    named = HeadDetection(part="self", **grid).named_heads()
    # by head; within one, strongest evidence first (score / threshold: sink 0.9/0.3 = 3 before prefix 0.8/0.4 = 2)
    assert [(e["layer"], e["head"], e["role"]) for e in named] == [
        (0, 0, "prev-tok"),
        (0, 0, "sink"),
        (0, 1, "dup-tok"),
        (1, 0, "sink"),
        (1, 0, "prefix"),
    ]
    assert named[0]["score"] == pytest.approx(0.9)


def test_probe_heads_fits_the_models_positions():
    from multihead.lab.circuits import probe_heads
    from multihead.lab.models import Decoder, DecoderConfig
    from multihead.lab.models.symbols import SymbolTokenizer, task_symbols

    model = Decoder(DecoderConfig(vocab_size=24, hidden=16, layers=1, heads=2, mlp=None, max_positions=25)).eval()
    tokenizer = SymbolTokenizer(task_symbols(24), max_length=25)
    found = probe_heads(model, tokenizer, seed=3)
    assert found.ids is not None and found.ids.shape == (4, 25)  # <bos> and 2 x 12: what the positions hold
    assert (found.ids[:, 0] == 0).all() and (found.ids[:, 1:] > 0).all()  # the BOS first, never drawn again
    torch.testing.assert_close(found.ids[:, 1:13], found.ids[:, 13:], rtol=0, atol=0)
    assert probe_heads(model, tokenizer, half_length=5).ids.shape == (4, 11)
    with pytest.raises(ValueError) as raised:
        probe_heads(model, tokenizer, half_length=13)
    assert is_input_error(raised.value, ValueError) and "half_length: expected at most 12" in str(raised.value)
