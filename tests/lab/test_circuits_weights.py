"""QK and OV circuits and composition scores (multihead.lab.circuits.weights) on our own Decoder with GQA: the weights
are the layer's projection slices, the factored norms equal the ones of the built products, and the tokens read
along a singular direction are the top scores along it. (TransformerLens checks them on transformers models:
tests/lab/test_circuits_transformer_lens.py.)"""

from __future__ import annotations

import pytest
import torch

from multihead.lab.circuits import composition_scores, head_circuit, head_weights
from multihead.lab.models import Decoder, DecoderConfig
from support import is_input_error


def decoder() -> Decoder:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=30, hidden=24, layers=3, heads=4, kv_heads=2, tie_embeddings=False)
    return Decoder(config).double().eval()


def test_weights_are_the_layers_projection_slices():
    model = decoder()
    weights = head_weights(model)
    assert weights.W_Q.shape == (3, 4, 24, 6) and weights.W_O.shape == (3, 4, 6, 24)
    layer = model.blocks[1].attention
    torch.testing.assert_close(weights.W_Q[1, 3], layer.q_proj.weight[18:24].T, rtol=0, atol=0)
    # query heads 2 and 3 share key/value head 1 (GQA)
    torch.testing.assert_close(weights.W_K[1, 2], layer.k_proj.weight[6:12].T, rtol=0, atol=0)
    torch.testing.assert_close(weights.W_K[1, 3], weights.W_K[1, 2], rtol=0, atol=0)
    torch.testing.assert_close(weights.W_O[1, 3], layer.out_proj.weight[:, 18:24].T, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["Q", "K", "V"])
def test_composition_scores_equal_the_built_products(mode):
    model = decoder()
    w = head_weights(model)
    found = composition_scores(model, mode)
    for early, h1, late, h2 in [(0, 1, 1, 3), (0, 3, 2, 0), (1, 2, 2, 2)]:
        ov = w.W_V[early, h1] @ w.W_O[early, h1]
        qk = w.W_Q[late, h2] @ w.W_K[late, h2].T
        right = {"Q": qk, "K": qk.T, "V": w.W_V[late, h2] @ w.W_O[late, h2]}[mode]
        expected = torch.linalg.norm(ov @ right) / (torch.linalg.norm(ov) * torch.linalg.norm(right))
        assert float(found[early, h1, late, h2]) == pytest.approx(float(expected), abs=1e-12)
    assert bool(found[1, :, 0].isnan().all()) and bool(found[2, :, 2].isnan().all())


def test_circuits_singular_values_and_readout():
    model = decoder()
    w = head_weights(model)
    circuit = head_circuit(model, 2, 1, directions=2, top=4)
    ov = w.W_V[2, 1] @ w.W_O[2, 1]
    torch.testing.assert_close(circuit.ov, torch.linalg.svdvals(ov)[:6], rtol=0, atol=1e-12)
    torch.testing.assert_close(circuit.qk, torch.linalg.svdvals(w.W_Q[2, 1] @ w.W_K[2, 1].T)[:6], rtol=0, atol=1e-12)
    assert circuit.ov_reads.shape == circuit.ov_writes.shape == (2, 4)
    # the top direction's tokens: the largest scores along it, its sign set by the output side's largest score
    u, _, vh = torch.linalg.svd(ov)
    writes = model.lm_head.weight @ vh[0]
    sign = 1.0 if writes[writes.abs().argmax()] > 0 else -1.0
    assert circuit.ov_writes[0].tolist() == (sign * writes).topk(4).indices.tolist()
    assert circuit.ov_reads[0].tolist() == (sign * (model.token_embeddings.weight @ u[:, 0])).topk(4).indices.tolist()


@pytest.mark.parametrize(
    "call, kind, fragment",
    [
        (lambda m: composition_scores(m, "O"), ValueError, "mode: expected one of ['Q', 'K', 'V']"),
        (lambda m: head_circuit(m, 3, 0), ValueError, "layer: expected layer indices in 0..2 (or -3..-1"),
        (lambda m: head_circuit(m, 0, 1.5), TypeError, "head: expected an int, got float 1.5"),
        (lambda m: head_circuit(m, 0, 0, top=31), ValueError, "top: expected an int in [1, 30]"),
        (lambda m: head_circuit(m, 0, 0, directions=7), ValueError, "directions: expected an int in [1, 6]"),
    ],
)
def test_bad_arguments_are_named(call, kind, fragment):
    with pytest.raises(kind) as raised:
        call(decoder())
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)


def test_a_negative_index_counts_from_the_end_as_everywhere():
    model = decoder()
    last, counted = head_circuit(model, -1, -2), head_circuit(model, 2, 2)
    torch.testing.assert_close(last.qk, counted.qk, rtol=0, atol=0)
    assert last.ov_writes.tolist() == counted.ov_writes.tolist()


def test_a_pruned_layer_keeps_its_heads_weights_and_its_lost_heads_are_nan():
    from multihead.heads import prune_layer

    whole = decoder()
    pruned = decoder()
    kept = prune_layer(pruned.attention_layers[1], [1, 2])  # GQA: each key/value head keeps one query head
    before, after = head_weights(whole), head_weights(pruned)
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        # a Decoder keeps no head_ids: the kept heads are numbered 0, 1 again, the layer's other columns NaN
        torch.testing.assert_close(getattr(after, name)[1, :2], getattr(before, name)[1, kept], rtol=0, atol=0)
        assert getattr(after, name)[1, 2:].isnan().all() and not getattr(after, name)[[0, 2]].isnan().any()
    scores = composition_scores(pruned, "K")
    torch.testing.assert_close(scores[0, :, 1, :2], composition_scores(whole, "K")[0, :, 1, kept], rtol=0, atol=1e-12)
    assert scores[0, :, 1, 2:].isnan().all()
    with pytest.raises(ValueError) as raised:
        head_circuit(pruned, 1, 3)
    assert is_input_error(raised.value, ValueError) and "head: expected a head layer 1 still has" in str(raised.value)
