"""Direct logit attribution and the logit lens (multihead.lab.circuits.lens) on our own Decoder: the parts read through
the linearised norm add up to the model's logit difference, the lens's last row is the model's logits, and the
heads' shares are each head's columns of W^O applied to its recorded output. (TransformerLens checks the same
tools on transformers models: tests/lab/test_circuits_transformer_lens.py.)"""

from __future__ import annotations

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.capture import capture
from multihead.lab.circuits.lens import direct_logit_attribution, lens_parts, logit_lens
from multihead.lab.models import Decoder, DecoderConfig
from support import is_input_error

ANSWER, WRONG = 3, 8


def decoder(tied: bool) -> Decoder:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=20, hidden=24, layers=2, heads=4, kv_heads=2, mlp=32, tie_embeddings=tied)
    return Decoder(config).double().eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 20, (3, 6), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_parts_add_up_to_the_logit_difference(tied):
    model = decoder(tied)
    found = direct_logit_attribution(model, ids(), answer=ANSWER, wrong=WRONG)
    with torch.no_grad():
        last = model(ids())[:, -1]
    assert found.difference == pytest.approx(float((last[:, ANSWER] - last[:, WRONG]).mean()), abs=1e-12)
    assert found.explained == pytest.approx(found.difference, abs=1e-10)
    assert found.heads.shape == (2, 4) and found.layers.shape == (2,)
    assert set(found.to_dict()) == {"heads", "layers", "logit_difference", "explained"}


@torch.no_grad()
def test_a_heads_share_is_its_output_through_its_columns_of_w_o():
    model = decoder(tied=True)
    with capture(model, weights=False, outputs=True) as recorder:
        model(ids())
    residual = {}
    handle = model.final_norm.register_forward_pre_hook(lambda module, args: residual.setdefault("x", args[0]))
    try:
        model(ids())
    finally:
        handle.remove()
    final = residual["x"][:, -1]  # (b, hidden)
    scale = (final.var(-1, unbiased=False, keepdim=True) + model.final_norm.eps).sqrt()
    direction = model.token_embeddings.weight[ANSWER] - model.token_embeddings.weight[WRONG]
    found = direct_logit_attribution(model, ids(), answer=ANSWER, wrong=WRONG)
    for layer, block in enumerate(model.blocks):
        w_o = block.attention.out_proj.weight  # (hidden, h e)
        e = w_o.shape[1] // 4
        for head in range(4):
            part = recorder.outputs(layer, head)[:, -1] @ w_o[:, head * e : (head + 1) * e].T  # (b, hidden)
            centred = part - part.mean(-1, keepdim=True)
            share = (centred / scale * model.final_norm.weight * direction).sum(-1).mean()
            assert float(found.heads[layer, head]) == pytest.approx(float(share), abs=1e-12)


def test_the_lens_ends_at_the_models_own_logits():
    model = decoder(tied=False)
    lens = logit_lens(model, ids(), position=-2, top=3, answer=ANSWER, wrong=WRONG)
    assert lens.logits.shape == (3, 3, 20) and lens.top.shape == (3, 3, 3)
    torch.testing.assert_close(lens.logits[-1], model(ids())[:, -2], rtol=0, atol=1e-12)
    # row 0 reads the embeddings alone
    embedded = model.final_norm(model.token_embeddings(ids())[:, -2])
    torch.testing.assert_close(lens.logits[0], model.lm_head(embedded), rtol=0, atol=1e-12)
    assert lens.differences is not None and lens.differences.shape == (3,)
    assert logit_lens(model, ids()).differences is None


def test_parts_are_found_for_our_decoder():
    model = decoder(tied=True)
    parts = lens_parts(model)
    assert parts.blocks == list(model.blocks) and parts.final_norm is model.final_norm
    assert parts.unembedding[0] is model.token_embeddings.weight and parts.unembedding[1] is None
    assert parts.out_projections[1][0] is model.blocks[1].attention.out_proj.weight


@pytest.mark.parametrize(
    "call, kind, fragment",
    [
        (lambda m: direct_logit_attribution(m, ids(), answer=ANSWER, wrong=WRONG, position=6), ValueError, "position"),
        (lambda m: direct_logit_attribution(m, "text", answer=ANSWER, wrong=WRONG), TypeError, "ids: expected"),
        (lambda m: direct_logit_attribution(m, ids(), answer=20, wrong=WRONG), ValueError, "answer: expected"),
        (lambda m: logit_lens(m, ids(), answer=ANSWER), ValueError, "wrong: expected given with answer"),
        (lambda m: logit_lens(m, ids(), top=0), ValueError, "top: expected an int in [1, 20]"),
        (lambda m: logit_lens(MultiHeadAttention(8, 2), ids()), TypeError, "model: expected a causal LM"),
    ],
)
def test_bad_arguments_are_named(call, kind, fragment):
    with pytest.raises(kind) as raised:
        call(decoder(tied=True))
    assert is_input_error(raised.value, kind) and fragment in str(raised.value)
