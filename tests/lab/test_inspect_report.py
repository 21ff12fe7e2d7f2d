"""multihead.lab.inspect.inspection: the Inspection (data only, one to_dict) and inspect_text on the real model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from multihead.lab.inspect import capture, head_stats
from multihead.lab.inspect.inspection import Inspection, bundled_corpus, inspect_text, pick_token, read_corpus
from multihead.lab.inspect.stats import DECIMALS
from multihead.lab.models import Encoder, EncoderConfig, load_minilm
from support_inspect import HEADS, LAYERS, TOKENS, synthetic_inspection

TEXT = "The bank was full of money."


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()[0]


# --------------------------------------------------------------------------- the Inspection


def test_an_inspection_is_frozen_data():
    inspection = synthetic_inspection()
    with pytest.raises(dataclasses.FrozenInstanceError):
        inspection.token = 3  # type: ignore[misc]
    assert [field.name for field in dataclasses.fields(Inspection)] == [
        "model_name",
        "text",
        "tokens",
        "layers",
        "heads",
        "weights",
        "stats",
        "role_stats",
        "corpus",
        "token",
        "part",
        "key_tokens",
        "causal",
        "pieces",
        "key_pieces",
        "truncated_from",
        "layer_modules",
    ]


def test_to_dict_is_plain_json_rounded_once():
    inspection = synthetic_inspection(corpus=True)
    data = inspection.to_dict()
    assert json.loads(json.dumps(data, allow_nan=False)) == data  # plain values only
    assert (data["model"], data["text"], data["tokens"], data["token"]) == (
        "all-MiniLM-L6-v2",
        inspection.text,
        TOKENS,
        2,
    )
    assert (data["layers"], data["heads"]) == (LAYERS, HEADS)
    weights = torch.tensor(data["weights"], dtype=torch.float64)
    assert weights.shape == (len(LAYERS), len(HEADS), len(TOKENS), len(TOKENS))
    torch.testing.assert_close(weights, inspection.weights.double().round(decimals=DECIMALS), rtol=0, atol=0)
    assert data["text_stats"] == inspection.stats.as_dict()
    assert data["corpus_stats"] == inspection.corpus.as_dict()
    assert data["roles_from"] == "bundled corpus (150 sentences)"
    assert data["roles"] == inspection.role_stats.as_dict()["roles"]
    assert data["roles"][0][0]["label"] == "prev" and data["roles"][1][2]["label"] == "[CLS]"
    assert data["most_attended"] == inspection.weights.argmax(dim=-1).tolist()
    for r, layer in enumerate(LAYERS):
        for c, head in enumerate(HEADS):
            assert data["top_attended"][r][c] == [
                {"token": piece, "index": index, "weight": round(weight, DECIMALS)}
                for piece, index, weight in inspection.top_attended(layer, head)
            ]
    assert synthetic_inspection().to_dict()["corpus_stats"] is None


def test_head_weights_top_and_most_attended_use_model_indices():
    inspection = synthetic_inspection()
    torch.testing.assert_close(inspection.head_weights(5, 7), inspection.weights[1, 2])
    assert inspection.top_attended(2, 0)[0] == ("the", 1, 1.0)  # the previous-token head, from "bank"
    assert [key for _, key, _ in inspection.most_attended(2, 0)] == [TOKENS[0], *TOKENS[:-1]]
    assert [key for _, key, _ in inspection.most_attended(5, 7)] == ["[CLS]"] * len(TOKENS)
    with pytest.raises(ValueError, match=r"layer: expected one of \[2, 5\], got 0"):
        inspection.head_weights(0, 0)
    with pytest.raises(ValueError, match=r"head: expected one of \[0, 3, 7\], got 1"):
        inspection.top_attended(2, 1)


# --------------------------------------------------------------------------- inspect_text


def test_inspect_text_records_the_chosen_heads(minilm):
    inspection = inspect_text(minilm, TEXT, layers=[1, 4], heads=[0, 7], token="money")
    assert (inspection.model_name, inspection.tokens[inspection.token]) == ("all-MiniLM-L6-v2", "money")
    assert (inspection.layers, inspection.heads, inspection.corpus) == ([1, 4], [0, 7], None)
    assert inspection.role_stats is inspection.stats and inspection.stats.source == "this text"
    with torch.no_grad(), capture(minilm, layers=[1, 4], heads=[0, 7]) as rec:
        minilm.encode(TEXT)
    for row, layer in enumerate([1, 4]):
        for col, head in enumerate([0, 7]):
            torch.testing.assert_close(inspection.weights[row, col], rec.weights(layer, head)[0], rtol=0, atol=0)


def test_inspect_text_with_a_corpus_labels_roles_from_it(minilm):
    done = []
    texts = bundled_corpus()[:4]
    inspection = inspect_text(
        minilm, TEXT, layers=[0], heads=[2], corpus=texts, corpus_source="four texts", progress=done.append
    )
    assert done == [4] and inspection.corpus is inspection.role_stats
    assert inspection.corpus.source == "four texts" and inspection.corpus.texts == 4
    assert inspection.role_stats.roles()[0][0].label == "prev"


def test_inspect_text_keeps_the_training_mode(minilm):
    minilm.train()
    try:
        first = inspect_text(minilm, TEXT, layers=[3], heads=[5])
        assert minilm.training
        torch.testing.assert_close(first.weights, inspect_text(minilm, TEXT, layers=[3], heads=[5]).weights)
    finally:
        minilm.eval()


def test_inspect_text_bad_inputs(minilm):
    with pytest.raises(TypeError, match="text: expected a string"):
        inspect_text(minilm, 42)
    with pytest.raises(ValueError, match="text: expected a non-empty text"):
        inspect_text(minilm, "  \n")
    with pytest.raises(TypeError, match="model: expected a text encoder with its tokenizer"):
        inspect_text(torch.nn.Linear(2, 2), TEXT)
    bare = Encoder(EncoderConfig(vocab_size=11, hidden_size=12, num_layers=1, num_heads=3, intermediate_size=7))
    with pytest.raises(ValueError, match=r"model\.tokenizer: expected a Tokenizer"):
        inspect_text(bare, TEXT)
    with pytest.raises(ValueError, match="token: expected a word of the text, got 'river'"):
        inspect_text(minilm, TEXT, token="river")


# --------------------------------------------------------------------------- the token and the corpus


def test_pick_token_by_occurrence():
    pieces = ["[CLS]", "the", "river", "##bank", "by", "the", "river", "##bank", "[SEP]"]
    assert pick_token(pieces, ("the", 2)) == 5
    assert pick_token(pieces, ("RIVERBANK", 2)) == 6  # a whole word: the index of its first piece
    assert pick_token(pieces, ("##bank", 1)) == 3 and pick_token(pieces, "riverbank") == 2
    with pytest.raises(ValueError, match=r"token: expected an occurrence 1..2 of 'the', got 3"):
        pick_token(pieces, ("the", 3))
    with pytest.raises(ValueError, match=r"expected an occurrence 1..2 of 'the', got 0"):
        pick_token(pieces, ("the", 0))
    with pytest.raises(TypeError, match=r"token: expected a word of the text \(str\), \(word, occurrence\)"):
        pick_token(pieces, ("the", "2"))


def test_pick_token_reads_words_as_the_roles_and_the_page_do():
    """GPT-2's pieces mark word starts with "\u0120": its words are found, and the default skips "the"."""
    pieces = ["The", "\u0120bank", "\u0120by", "\u0120the", "\u0120river", "bank"]
    assert pick_token(pieces, None) == 1
    assert pick_token(pieces, "by") == 2 and pick_token(pieces, "riverbank") == 4
    assert pick_token(["[CLS]", "##x", "##y", "[SEP]"], "##xy") == 1  # a "##" piece never joins [CLS]


def test_a_causal_default_is_the_last_content_word():
    """On an induction checkpoint the first content word sees only what comes before it: <bos>."""
    pieces = ["<bos>", "e", "f", "g", "h", "e", "f", "g"]
    assert pick_token(pieces, None, causal=True) == 7 and pick_token(pieces, None) == 1
    assert pick_token(["<bos>", "the", "of"], None, causal=True) == 2  # no content word: the last word's piece


def test_pick_token_defaults_to_the_first_content_word():
    assert pick_token(["[CLS]", "the", "of", ",", "bank", "[SEP]"], None) == 4
    assert pick_token(["[CLS]", "the", "[SEP]"], None) == 1  # no content word: the first real token
    assert pick_token(["[CLS]", "[SEP]"], None) == 0
    with pytest.raises(TypeError, match="token: expected a word of the text"):
        pick_token(TOKENS, 2.5)


def test_read_corpus_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("# a comment\n\n  First text.  \n#not a comment\nSecond text.\n", encoding="utf-8")
    assert read_corpus(path) == ["First text.", "#not a comment", "Second text."]
    path.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match=r"--corpus: expected at least one non-empty line"):
        read_corpus(path, argument="--corpus")
    with pytest.raises(FileNotFoundError, match="corpus: expected a text file"):
        read_corpus(tmp_path / "missing.txt")
    assert len(bundled_corpus()) == 178


def test_an_inspection_walks_the_model_once(minilm, monkeypatch):
    """The part's attention sites are resolved once per call and handed on (they were resolved 19 times: the
    grid, the head numbers, causality, and once per recorded layer, for the text and again for the corpus)."""
    import multihead.capture as capture_module

    walks = []
    find = capture_module.attention_sites
    monkeypatch.setattr(capture_module, "attention_sites", lambda model: walks.append(model) or find(model))
    inspection = inspect_text(minilm, "The bank was full of money.", corpus=["A second text.", "And a third."])
    assert len(walks) == 1 and inspection.corpus is not None
    walks.clear()
    head_stats(minilm, ["One text.", "Two texts."])  # head_stats alone: one walk too
    assert len(walks) == 1
