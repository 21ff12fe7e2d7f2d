"""Roles' inputs that are not attention: the words of a text, their frequencies (wordfreq), the rare-word
statistic (Voita et al. 2019) on hand-built heads, and syntax relations folded into roles."""

from __future__ import annotations

import pytest
import torch
import wordfreq

from multihead.lab.inspect.roles import rarest_word_pieces, word_frequency
from multihead.lab.inspect.stats import _Accumulator, token_info
from multihead.lab.inspect.syntax import MIN_RELATION_COUNT, head_relations
from multihead.lab.models import Pieces

TEXT = ["[CLS]", "the", "aardvark", "sat", "on", "the", "mat", ".", "[SEP]"]


@pytest.mark.parametrize(
    "tokens, expected",
    [
        (["[CLS]", "un", "##believ", "##able", "news", "[SEP]"], [None, 0, 0, 0, 1, None]),
        (["The", "\u0120un", "believ", "able", "\u0120news"], [0, 1, 1, 1, 2]),  # GPT-2 byte-level
        (["<s>", "\u2581The", "\u2581un", "believ", "able", "</s>"], [None, 0, 1, 1, 1, None]),  # SentencePiece
        (["[CLS]", "##odd", "start", "[SEP]"], [None, 0, 1, None]),  # a continuation with nothing to continue
    ],
)
def test_bare_pieces_join_words_by_their_markers(tokens, expected):
    assert Pieces.from_markers(tokens).word_ids == expected


def test_frequencies_come_from_wordfreq():
    assert word_frequency("Bank") == wordfreq.zipf_frequency("bank", "en") > 4
    assert word_frequency("aardvark") < word_frequency("mat") < word_frequency("the")


def test_the_rarest_word_is_marked_on_all_its_pieces_and_never_punctuation_or_numbers():
    assert rarest_word_pieces(TEXT) == [False, False, True, False, False, False, False, False, False]
    pieces = ["[CLS]", "an", "aard", "##vark", "ate", "42", "!", "[SEP]"]
    assert rarest_word_pieces(pieces) == [False, False, True, True, False, False, False, False]
    assert rarest_word_pieces(["[CLS]", "42", "!", "[SEP]"]) == [False] * 4  # no word with a letter


def rare_statistic(pick_key) -> float:
    """The rare statistic of one head whose every query puts all its weight on ``pick_key(query)``."""
    n = len(TEXT)
    weights = torch.zeros(1, 1, n, n, dtype=torch.float64)
    for query in range(n):
        weights[0, 0, query, pick_key(query)] = 1.0
    accumulator = _Accumulator(1, 16)
    accumulator.add(weights, token_info([TEXT], n))
    return float(accumulator.result()["rare"][0])


def test_the_rare_statistic_counts_word_queries_whose_maximum_is_the_rarest_word():
    rarest = TEXT.index("aardvark")
    assert rare_statistic(lambda query: rarest) == 1.0
    assert rare_statistic(lambda query: query) == 0.0  # a self head: the rarest word's own query is not counted
    # a previous-token head hits the rarest word from "sat" only: 1 of the 6 non-special queries outside it
    assert rare_statistic(lambda query: max(query - 1, 0)) == pytest.approx(1 / 6)


def syntax_dict(dep_scores, baselines, counts):
    return {
        "layers": [0],
        "heads": [0, 1],
        "relations": list(dep_scores),
        "counts": counts,
        "baseline": {r: {"offset": -1, "score": b} for r, b in baselines.items()},
        "dependent_to_head": {r: [row] for r, row in dep_scores.items()},
        "head_to_dependent": {r: [[None, None]] for r in dep_scores},
    }


def test_each_head_gets_the_relation_it_beats_its_baseline_by_most():
    scores = syntax_dict(
        {"det": [0.9, 0.5], "nsubj": [0.5, 0.45]},
        {"det": 0.85, "nsubj": 0.2},
        {"det": 100, "nsubj": 100},
    )
    relations = head_relations(scores)[0]
    # head 0: det 0.9 is its best score, but nsubj 0.5 beats its 0.2 baseline by more
    assert (relations[0].name, relations[0].score, relations[0].margin) == ("nsubj", 0.5, pytest.approx(0.3))
    assert relations[1].name == "nsubj"
    below = syntax_dict({"det": [0.9, 0.5]}, {"det": 0.6}, {"det": 100})
    assert [r and r.name for r in head_relations(below)[0]] == ["det", None]  # head 1 never beats the offset
    rare_relation = syntax_dict({"det": [0.9, 0.5]}, {"det": 0.1}, {"det": MIN_RELATION_COUNT - 1})
    assert head_relations(rare_relation) == [[None, None]]  # too few dependents to name a head after
