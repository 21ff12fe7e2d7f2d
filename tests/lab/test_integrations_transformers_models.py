"""Local transformers checkpoints as text models on our kernel: multihead.integrations.transformers_models."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from hf_checkpoints import ARCHITECTURES, SENTENCES, save
from multihead.integrations.transformers_models import TransformersModel, load_model
from multihead.lab.inspect import attention_sites


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: save(name, root / name) for name in ARCHITECTURES}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_states_equal_the_checkpoint_run_by_transformers_eager(name, folders):
    ours = load_model(folders[name])
    assert isinstance(ours, TransformersModel) and ours.name == name and not ours.training
    theirs = transformers.AutoModel.from_pretrained(folders[name], attn_implementation="eager").eval()
    batch = ours.tokenizer.batch(SENTENCES[:3])  # padded: the rows have different lengths
    assert batch.attention_mask.eq(0).any()
    with torch.no_grad():
        got = ours(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        expected = theirs(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    real = batch.attention_mask.bool() if name != "bart" else torch.ones_like(batch.attention_mask, dtype=torch.bool)
    torch.testing.assert_close(got[real], expected[real], atol=2e-5, rtol=2e-5)


def test_parts_causality_and_pieces_follow_the_architecture(folders):
    gpt2, bert, bart = (load_model(folders[name]) for name in ("gpt2", "bert", "bart"))
    assert gpt2.is_causal and not bert.is_causal and not bart.is_causal and bart.is_encoder_decoder
    assert [(site.part, site.index) for site in attention_sites(gpt2)] == [("self", 0), ("self", 1)]
    assert {site.part for site in attention_sites(bart)} == {"encoder", "decoder", "cross"}
    # byte-level pieces are shown as text ("bank", not "Ġbank"); WordPiece keeps [CLS] ... [SEP]
    pieces = gpt2.tokenizer.tokenize("The bank was full of money.")
    assert pieces[:3] == ["The", "bank", "was"] and not any(p.startswith("Ġ") and len(p) > 1 for p in pieces)
    pieces = bert.tokenizer.tokenize("The bank was full of money.")
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]" and "bank" in pieces
    with pytest.raises(TypeError, match=r"use multihead\.lab\.inspect\.attention_sites\(model\)"):
        _ = bert.attention_layers


def test_a_long_text_raises_or_is_cut_keeping_the_closing_token(folders):
    bert = load_model(folders["bert"])
    text = " ".join(["money"] * 80)  # over the 64 positions
    with pytest.raises(ValueError, match=r"text: expected at most 64 tokens .* Fix: shorten the text, or truncate"):
        bert.tokenizer.batch([text])
    cut = bert.tokenizer.batch([text], truncate=True)
    assert cut.input_ids.shape == (1, 64) and cut.tokens[0][-1] == "[SEP]" and len(cut.word_ids[0]) == 64


def test_a_folder_that_is_not_a_checkpoint_we_can_serve_is_one_clear_error(folders, tmp_path):
    with pytest.raises(FileNotFoundError, match="model"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="model: expected a checkpoint folder with a config.json"):
        load_model(tmp_path)
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(
        ValueError, match=r"config.json: expected a model_type this transformers knows .*'no-such"
    ) as info:
        load_model(unknown)
    # transformers' own reason in whole sentences (it was cut mid-sentence at a line break and at 160 characters)
    assert "does not recognize this architecture. This could be because" in str(info.value)
    assert "or because your version of Transformers is out of date.)" in str(info.value)
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for file in ("config.json", "model.safetensors"):
        shutil.copy(folders["gpt2"] / file, no_tokenizer / file)
    with pytest.raises(ValueError, match="model: expected a checkpoint folder with its tokenizer files"):
        load_model(no_tokenizer)


def test_a_masked_lm_save_loads_on_our_own_encoder_too(folders):
    """BertForMaskedLM writes its pre-training head (cls.predictions.*): our encoder leaves it, as the pooler."""
    from multihead.lab.models import Encoder, load_encoder

    ours = load_encoder(folders["bert"])
    assert isinstance(ours, Encoder)
    theirs = transformers.AutoModel.from_pretrained(folders["bert"], attn_implementation="eager").eval()
    batch = ours.tokenizer.batch(SENTENCES[:3])
    with torch.no_grad():
        got = ours(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        expected = theirs(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, token_type_ids=batch.token_type_ids
        ).last_hidden_state
    real = batch.attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=2e-5, rtol=2e-5)


def test_embeddings_of_the_wrapped_model_equal_our_encoders(folders):
    """Both read the same BERT save: transformers' modules on our kernel, and our own encoder."""
    from multihead.lab.models import load_encoder

    wrapped, ours = load_model(folders["bert"]), load_encoder(folders["bert"])
    got, expected = wrapped.encode(SENTENCES), ours.encode(SENTENCES)
    assert got.shape == (len(SENTENCES), 24)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_an_encoder_decoder_reads_the_text_shifted_right_and_names_each_parts_tokens(folders):
    from multihead.lab.inspect import capture

    bart = load_model(folders["bart"])
    batch = bart.tokenizer.batch(SENTENCES[:1])
    source = batch.tokens[0]
    assert source[0] == "<s>" and source[-1] == "</s>"
    queries, keys = bart.part_tokens(batch, "cross")
    assert queries[0] == ["</s>", *source[:-1]] and keys[0] == source  # BART's decoder starts with </s>
    assert bart.part_tokens(batch, "decoder") == (queries, queries)
    assert bart.part_tokens(batch, "encoder") == (batch.tokens, batch.tokens)
    recorders = {part: capture(bart, part=part, layers=[1]) for part in ("encoder", "decoder", "cross")}
    with torch.no_grad(), recorders["encoder"], recorders["decoder"], recorders["cross"]:
        states = bart(batch.input_ids, batch.attention_mask)
    n = len(source)
    assert states.shape == (1, n, 24)
    for part in ("encoder", "decoder", "cross"):
        assert recorders[part].weights(1).shape == (1, 4, n, n)
    decoder = recorders["decoder"].weights(1)[0]
    assert (decoder.triu(1) == 0).all()  # the decoder is causal over its own input
    # BartModel, given no decoder input, shifts the text itself: the same states
    expected = bart.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    torch.testing.assert_close(states, expected, atol=0, rtol=0)
