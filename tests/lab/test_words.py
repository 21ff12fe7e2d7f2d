"""Words as each tokenizer family makes them (issue 31, row 1): BERT's WordPiece, GPT-2's byte-level BPE,
Llama-2's SentencePiece BPE with byte fallback and T5's Unigram, on texts with double spaces, emoji, numbers
and accents; the word view, the rare-word statistic and ``--token`` all read these words."""

from __future__ import annotations

import json

import pytest
import torch

from hf_checkpoints import TOKENIZER_FAMILIES, save, tokenizer
from multihead.cli import main
from multihead.integrations.transformers_models import TransformersTokenizer, load_model
from multihead.lab.inspect import inspect_text
from multihead.lab.inspect.roles import rarest_word_pieces
from multihead.lab.models import Pieces, load_minilm

TEXTS = [
    "The  bank paid 2024 dollars 😀 to José.",
    "Café  au lait, 3.5 euros!  ",
    "  well-known   naïve résumé 🎉🎉",
]
# WordPiece and GPT-2 pre-tokenize punctuation apart; SentencePiece's words are the white-space ones
SPLIT_PUNCTUATION = [
    ["The", "bank", "paid", "2024", "dollars", "😀", "to", "José", "."],
    ["Café", "au", "lait", ",", "3", ".", "5", "euros", "!"],
    ["well", "-", "known", "naïve", "résumé", "🎉🎉"],
]
WHITE_SPACE_WORDS = [
    ["The", "bank", "paid", "2024", "dollars", "😀", "to", "José."],
    ["Café", "au", "lait,", "3.5", "euros!"],
    ["well-known", "naïve", "résumé", "🎉🎉"],
]
EXPECTED = {
    "wordpiece": SPLIT_PUNCTUATION,
    "byte_bpe": SPLIT_PUNCTUATION,
    "sentencepiece_bpe": WHITE_SPACE_WORDS,
    "unigram": WHITE_SPACE_WORDS,
}


@pytest.fixture(scope="module")
def tokenizers():
    return {family: TransformersTokenizer(tokenizer(family), max_length=128) for family in TOKENIZER_FAMILIES}


@pytest.mark.parametrize("family", TOKENIZER_FAMILIES)
def test_every_family_gives_the_words_of_the_text_as_typed(family, tokenizers):
    batch = tokenizers[family].batch(TEXTS)
    for text, pieces, expected in zip(TEXTS, batch.pieces, EXPECTED[family], strict=True):
        assert pieces.words == expected, (family, text, pieces)
        # every word's pieces are one run, numbered in text order; special pieces belong to none
        runs = [word for k, word in enumerate(pieces.word_ids) if word is not None and word != pieces.word_ids[k - 1]]
        assert runs == list(range(len(expected))), pieces
        assert "".join(pieces.words) == "".join(text.split())


def test_a_lone_space_piece_joins_the_word_it_precedes(tokenizers):
    """GPT-2 writes a double space as a lone "Ġ" piece and Llama a number as "▁" then digits: shown stripped,
    those pieces used to join the whole sentence into two or three words."""
    gpt2 = tokenizers["byte_bpe"].batch(["The  bank paid 2024 dollars."]).pieces[0]
    assert gpt2.tokens[:3] == ["The", "\u0120", "bank"] and gpt2.word_ids[:3] == [0, 1, 1]
    llama = tokenizers["sentencepiece_bpe"].batch(["paid 2024 dollars."]).pieces[0]
    lone = llama.tokens.index("\u2581", 2)
    assert llama.tokens[lone + 1 : lone + 5] == ["2", "0", "2", "4"]
    assert len(set(llama.word_ids[lone : lone + 5])) == 1 and llama.words == ["paid", "2024", "dollars."]


def test_the_rarest_word_is_one_word_on_byte_level_pieces(tokenizers):
    pieces = tokenizers["byte_bpe"].batch(["The  bank paid the aardvark money."]).pieces[0]
    rare = rarest_word_pieces(pieces)
    assert {pieces.words[pieces.word_ids[k]] for k, flag in enumerate(rare) if flag} == {"aardvark"}


def test_wordpiece_of_our_own_tokenizer_keeps_accents_and_case():
    _, minilm = load_minilm()
    pieces = minilm.batch(["I met  José at the Café 😀 in 2024, didn't I?"]).pieces[0]
    assert pieces.tokens[3] == "jose" and pieces.tokens[6] == "cafe" and pieces.tokens[7] == "[UNK]"
    expected = ["I", "met", "José", "at", "the", "Café", "😀", "in", "2024", ",", "didn", "'", "t", "I", "?"]
    assert pieces.words == expected


def test_words_given_as_a_list_are_kept(tokenizers):
    _, minilm = load_minilm()
    for words_of in (minilm, tokenizers["wordpiece"]):
        pieces = words_of.batch([["Ein", "naïver", "Satz"]]).pieces[0]
        assert pieces.words == ["Ein", "naïver", "Satz"] and max(w for w in pieces.word_ids if w is not None) == 2


def test_bare_pieces_still_group_by_their_markers():
    assert Pieces.from_markers(["<s>", "\u2581paid", "\u2581", "2", "0", "</s>"]).words == ["paid", "20"]
    assert Pieces.from_markers(["[CLS]", "una", "##ff", "[SEP]"]).groups() == (
        [0, 1, 1, 2],
        ["[CLS]", "unaff", "[SEP]"],
        [True, False, True],
    )
    with pytest.raises(ValueError, match="word_ids: expected one entry per piece"):
        Pieces(["a", "b"], [0], ["a"])


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return load_model(save("gpt2", tmp_path_factory.mktemp("gpt2") / "gpt2"))


def test_an_inspection_of_a_byte_level_model_shows_its_words(gpt2):
    torch.manual_seed(0)
    text = "The  bank paid  the aardvark 2024 dollars."
    inspection = inspect_text(gpt2, text)
    assert inspection.words[0].words == ["The", "bank", "paid", "the", "aardvark", "2024", "dollars", "."]
    report = inspection.to_dict()
    assert report["words"] == inspection.words[0].words and len(report["word_ids"]) == len(report["tokens"])
    # random heads: the rarest word (aardvark) is one of 8 words, not a sentence-long "word" every head finds
    assert float(inspection.stats.values["rare"].max()) < 1.0
    assert not any(role.label == "rare" and role.strength == 1.0 for row in inspection.stats.roles() for role in row)


def test_the_token_is_found_as_typed_and_as_the_tokenizer_folds_it(tmp_path):
    """MiniLM lowercases and strips accents ("Café" -> "cafe"): the word is found as typed, in any case."""
    text = "We drank coffee at the Café near the bank."
    for typed in ("café", "Café", "cafe", "CAFÉ"):
        argv = ["inspect", text, "--token", typed, "--format", "json", "--layers", "0", "--out", str(tmp_path)]
        assert main(argv) == 0
        report = json.loads((tmp_path / "inspect.json").read_text())
        assert report["tokens"][report["token"]] == "cafe" and "Café" in report["words"]
