"""inspect selects words, not pieces, on a byte-level BPE (GPT-2's tokenizer): a word cut into several pieces is read
from the piece that has read it whole, and every report (terminal, JSON, HTML) names the word and its pieces.

The checkpoint is a tiny random GPT-2 whose tokenizer is trained in memory on sentences without "bank" or "money",
so both are cut into several pieces ("\u0120b an k", "\u0120m o n ey"); nothing is downloaded.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from hf_checkpoints import byte_bpe
from multihead.cli import main
from multihead.integrations.transformers_models import load_model
from multihead.lab.inspect.inspection import inspect_text, pick_token
from multihead.lab.inspect.terminal import strongest_links
from multihead.lab.models.tokenizer import Pieces
from test_inspect_html import browser, open_report  # noqa: F401 (fixtures)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = "The bank was full of money."
# none of them has "bank" or "money": the trained merges cut both into pieces
CORPUS = ["The river was full of water.", "The cat was on the mat.", "A bag of corn and a box of keys.", "The man ran."]
PIECES = ["The", "b", "an", "k", "was", "full", "of", "m", "o", "n", "ey", "."]  # as the reports show them
BANK, MONEY = (1, 3), (7, 10)  # each word's first and last piece


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    end = "<|endoftext|>"
    tokenizer = byte_bpe(end, end, end, wrap=False, sentences=CORPUS)  # GPT-2's, trained on CORPUS
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=24,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    path = tmp_path_factory.mktemp("bpe") / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(folder):
    return load_model(folder)


def test_the_checkpoint_cuts_bank_and_money_into_pieces(model):
    """What the other tests stand on: the tokenizer's own pieces, and the words read through their offsets."""
    pieces = model.tokenizer.batch([TEXT]).pieces[0]
    assert pieces.tokens == PIECES
    assert pieces.words == ["The", "bank", "was", "full", "of", "money", "."]
    assert [pieces.span(word) for word in (1, 5)] == [BANK, MONEY]


def test_a_word_is_read_from_its_first_piece_or_in_a_causal_part_its_last():
    pieces = Pieces.from_markers(["The", "\u0120b", "an", "k", "\u0120", "m", "oney"])  # a lone "\u0120" before "m"
    assert pieces.words == ["The", "bank", "money"]
    assert [pieces.query_piece(word, causal=False) for word in (1, 2)] == [1, 5]  # past the lone marker
    assert [pieces.query_piece(word, causal=True) for word in (1, 2)] == [3, 6]  # the piece that read it whole
    assert pick_token(pieces, "bank") == 1 and pick_token(pieces, "bank", causal=True) == 3
    assert pick_token(pieces, None) == 1 and pick_token(pieces, None, causal=True) == 6  # the default: words too
    assert pick_token(pieces, "an") == 2  # a piece that is no word of the text is still a piece
    wordpiece = Pieces.from_markers(["[CLS]", "una", "##ff", "##able", "flat", "[SEP]"])
    assert pick_token(wordpiece, "unaffable") == 1 and pick_token(wordpiece, "unaffable", causal=True) == 3


def test_a_word_of_the_text_comes_before_a_piece_of_another_word():
    """ "bank" inside "riverbank" is a piece that reads "bank" too: --token bank:2 is not it."""
    pieces = Pieces.from_markers(["The", "\u0120bank", "\u0120by", "\u0120the", "\u0120river", "bank"])
    assert pick_token(pieces, "bank") == 1
    with pytest.raises(ValueError, match="occurs once"):
        pick_token(pieces, ("bank", 2))


def test_the_selected_word_is_named_whole(model):
    inspection = inspect_text(model, TEXT, token="bank")
    assert inspection.causal and inspection.token == BANK[1]  # causal: the word's last piece, "k"
    assert inspection.query == ("bank", *BANK)
    assert inspection.query_title == "'bank' (tokens 1-3)"
    assert inspection.to_dict()["query"] == {"text": "bank", "pieces": list(BANK)}
    # the strongest links go to other words: never to "b" or "an", pieces of "bank" itself
    assert all(piece not in ("b", "an", "k") for _, _, piece, _ in strongest_links(inspection, count=8))
    default = inspect_text(model, TEXT)  # the last content word of a causal text, whole
    assert default.token == MONEY[1] and default.query_title == "'money' (tokens 7-10)"
    piece = inspect_text(model, TEXT, token=2)  # an index picks a piece, and names it
    assert piece.query == ("an", 2, 2) and piece.query_title == "'an' (token 2)"


def test_every_report_names_the_word_and_its_pieces(folder, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["inspect", TEXT, "--model", str(folder), "--token", "bank", "--format", "terminal,json,html"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "Where 'bank' (tokens 1-3) attends: top 2 per head" in printed
    assert "Strongest links from 'bank' to another word" in printed
    report = json.loads((out / "inspect.json").read_text())
    assert report["tokens"] == PIECES and report["token"] == BANK[1]
    assert report["query"] == {"text": "bank", "pieces": list(BANK)}
    assert main(["inspect", TEXT, "--model", str(folder), "--format", "terminal"]) == 0
    assert "Where 'money' (tokens 7-10) attends" in " ".join(capsys.readouterr().out.split())


def test_the_page_names_the_word_its_query_piece_stands_for(model, open_report):  # noqa: F811 (the fixture)
    page = open_report(inspect_text(model, TEXT, token="bank"))
    assert page.text_content("#bars-title") == "Where bank (#1-3) attends in layer 0, head 0"
    page.click('.token[data-index="2"]')  # a piece inside the word: itself
    assert page.text_content("#bars-title") == "Where an (#2) attends in layer 0, head 0"
    page.click(f'.token[data-index="{MONEY[1]}"]')  # the piece that stands for "money"
    assert page.text_content("#bars-title") == "Where money (#7-10) attends in layer 0, head 0"
