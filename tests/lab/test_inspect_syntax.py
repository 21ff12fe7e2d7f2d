"""multihead.lab.inspect.syntax: CoNLL-U reading, word-level attention, Clark et al. (2019) syntax scores."""

from __future__ import annotations

import doctest
import json
import re

import pytest
import torch

import multihead
from multihead.lab.inspect import syntax
from multihead.lab.inspect.syntax import (
    RELATIONS,
    TREEBANK,
    Sentence,
    SyntaxScores,
    _score,
    bundled_treebank,
    read_conllu,
    syntax_scores,
    word_attention,
)

ROW = "{id}\t{form}\t{form}\tX\tX\t_\t{head}\t{rel}\t_\t_"

SAMPLE = "\n".join(
    [
        "# sent_id = s1",
        "# text = They don't know.",
        ROW.format(id=1, form="They", head=4, rel="nsubj"),
        "2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_",
        ROW.format(id=2, form="do", head=4, rel="aux"),
        ROW.format(id=3, form="n't", head=4, rel="advmod"),
        ROW.format(id=4, form="know", head=0, rel="root"),
        "4.1\tknows\tknow\tVERB\tVBZ\t_\t_\t_\t4:conj\t_",
        ROW.format(id=5, form=".", head=4, rel="punct"),
        "",
        "# sent_id = s2",
        ROW.format(id=1, form="her", head=2, rel="nmod:poss"),
        ROW.format(id=2, form="cat", head=3, rel="nsubj"),
        ROW.format(id=3, form="gave", head=0, rel="root"),
        ROW.format(id=4, form="up", head=3, rel="compound:prt"),
        "",
    ]
)


# ----------------------------------------------------------------------------------- read_conllu


def test_read_conllu_skips_ranges_and_empty_nodes():
    first, second = read_conllu(SAMPLE)
    assert first.words == ["They", "do", "n't", "know", "."]
    assert first.heads == [4, 4, 4, 0, 4]
    assert first.relations == ["nsubj", "aux", "advmod", "root", "punct"]
    assert (first.sent_id, first.text) == ("s1", "They don't know.")
    assert second.words == ["her", "cat", "gave", "up"]
    assert second.heads == [2, 3, 0, 3]
    assert second.relations == ["nmod:poss", "nsubj", "root", "compound:prt"]  # subtypes kept
    assert second.text is None


def _break_line(number: int, replacement: str) -> str:
    lines = SAMPLE.split("\n")
    lines[number - 1] = replacement
    return "\n".join(lines)


def test_read_conllu_wrong_field_count_names_the_line():
    text = _break_line(5, "2\tdo\tdo")
    with pytest.raises(ValueError, match=r"^conllu line 5: expected 10 tab-separated fields.*got 3\. Fix: "):
        read_conllu(text)


def test_read_conllu_non_integer_head_names_the_line():
    text = _break_line(12, ROW.format(id=1, form="her", head="x", rel="nmod:poss"))
    with pytest.raises(ValueError, match=r"^conllu line 12: expected an integer HEAD"):
        read_conllu(text)


def test_read_conllu_bad_id_and_head_outside_sentence():
    with pytest.raises(ValueError, match=r"^conllu line 3: expected an ID that is an integer"):
        read_conllu(_break_line(3, ROW.format(id="a", form="They", head=4, rel="nsubj")))
    with pytest.raises(ValueError, match=r"^conllu line 14: expected a HEAD in 0\.\.4"):
        read_conllu(_break_line(14, ROW.format(id=3, form="gave", head=9, rel="root")))


def test_read_conllu_file_and_errors(tmp_path):
    path = tmp_path / "sample.conllu"
    path.write_text(SAMPLE, encoding="utf-8")
    assert [s.words for s in read_conllu(path)] == [s.words for s in read_conllu(SAMPLE)]
    assert len(read_conllu(str(path))) == 2
    path.write_text(_break_line(7, "4\tknow"), encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{path} line 7: expected 10 tab-separated fields")):
        read_conllu(path)
    with pytest.raises(FileNotFoundError, match="does not exist.*Fix: "):
        read_conllu(tmp_path / "missing.conllu")


# ----------------------------------------------------------------------------------- bundled treebank


def test_bundled_treebank():
    sentences = bundled_treebank()
    assert len(sentences) == 2001
    first = sentences[0]
    assert first.words == ["From", "the", "AP", "comes", "this", "story", ":"]
    assert first.heads == [3, 3, 4, 0, 6, 4, 4]
    assert first.relations == ["case", "det", "obl", "root", "det", "nsubj", "punct"]
    assert first.text == "From the AP comes this story :"
    # every syntactic word line of the file, and nothing else (no ranges, no empty nodes)
    word_lines = re.findall(r"^[0-9]+\t", TREEBANK.read_text(encoding="utf-8"), flags=re.M)
    assert sum(len(s.words) for s in sentences) == len(word_lines) == 25147
    present = {r for s in sentences for r in s.relations}
    assert set(RELATIONS) <= present
    assert (TREEBANK.parent / "README.md").is_file() and (TREEBANK.parent / "LICENSE.txt").is_file()
    sentences[0].words.append("changed")  # a fresh copy each call
    assert bundled_treebank()[0].words[-1] == ":"


# ----------------------------------------------------------------------------------- word_attention


def test_word_attention_sums_keys_and_averages_queries():
    # [CLS] w0 w1 w1 w1 w2 [SEP]: word 1 has three pieces
    word_ids = [None, 0, 1, 1, 1, 2, None]
    weights = torch.rand(2, 7, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    result = word_attention(weights, word_ids)
    assert result.shape == (2, 3, 3) and result.dtype == torch.float64
    pieces = {0: [1], 1: [2, 3, 4], 2: [5]}
    for h in range(2):
        for i in range(3):
            for j in range(3):
                expected = sum(weights[h, p, q] for p in pieces[i] for q in pieces[j]) / len(pieces[i])
                assert abs(result[h, i, j] - expected) < 1e-12, (h, i, j)
    # by hand: from word 1 (mean of rows 2..4) to word 2 (column 5), and from word 0 to word 1 (sum of 3 columns)
    assert torch.isclose(result[1, 1, 2], weights[1, 2:5, 5].mean())
    assert torch.isclose(result[0, 0, 1], weights[0, 1, 2:5].sum())
    assert word_attention(weights, word_ids, num_words=4).shape == (2, 4, 4)  # a word with no piece: zeros
    with pytest.raises(ValueError, match="word_ids: expected 7 entries"):
        word_attention(weights, word_ids[:-1])


# ----------------------------------------------------------------------------------- scoring core


def _synthetic():
    """Three sentences; det heads at +1, +2, +1, +1 (baseline +1 = 3/4); nsubj heads always at +1."""
    sentences = [
        Sentence(["the", "cat", "sat"], [2, 3, 0], ["det", "nsubj", "root"]),
        Sentence(["a", "big", "dog", "barked"], [3, 3, 4, 0], ["det", "amod", "nsubj", "root"]),
        Sentence(["the", "dog", "saw", "the", "cat"], [2, 3, 0, 5, 3], ["det", "nsubj", "root", "det", "obj"]),
    ]
    attentions = []
    for s in sentences:
        w = len(s.words)
        syntactic = torch.zeros(w, w)
        for d, h in enumerate(s.heads):
            syntactic[d, h - 1 if h else d] = 1.0  # the root attends to itself
        previous = torch.zeros(w, w)
        previous[torch.arange(w), (torch.arange(w) - 1).clamp(min=0)] = 1.0
        following = torch.zeros(w, w)
        following[torch.arange(w), (torch.arange(w) + 1).clamp(max=w - 1)] = 1.0
        attentions.append(torch.stack([syntactic, previous, following])[None])  # (1 layer, 3 heads, W, W)
    return sentences, attentions


def test_score_on_synthetic_attention():
    sentences, attentions = _synthetic()
    scores = _score(attentions, sentences, ["det", "nsubj", "obj"])
    assert scores.counts == {"det": 4, "nsubj": 3, "obj": 1}
    assert scores.baseline["det"] == (1, 0.75)
    assert scores.baseline["nsubj"] == (1, 1.0)
    assert scores.baseline["obj"] == (-2, 1.0)  # "saw ... cat": the head two words back
    det_d2h, det_h2d = scores.dependent_to_head["det"], scores.head_to_dependent["det"]
    assert det_d2h.shape == (1, 3)
    # the syntactic head always finds the head; the next-word head scores the +1 baseline exactly
    assert det_d2h.tolist() == [[1.0, 0.0, 0.75]]
    # from the head word: the previous-word head finds the det exactly when it sits at -1 (offset +1)
    assert det_h2d.tolist() == [[0.0, 0.75, 0.0]]
    assert scores.dependent_to_head["obj"].tolist() == [[1.0, 0.0, 0.0]]
    best = scores.best("det")
    assert (best["layer"], best["head"], best["direction"], best["score"]) == (0, 0, "dependent_to_head", 1.0)
    assert best["baseline_offset"] == 1 and best["margin"] == pytest.approx(0.25)
    assert [row["relation"] for row in scores.table()] == ["det", "nsubj", "obj"]
    # nsubj heads are always the next word: the previous-word head finds every nsubj from its head
    assert scores.head_to_dependent["nsubj"].tolist() == [[0.0, 1.0, 0.0]]
    assert scores.per_head_best().tolist() == [[1.0, 1.0, 1.0]]
    assert scores.per_head_relation() == [["det", "nsubj", "nsubj"]]  # ties go to the first relation
    json.dumps(scores.as_dict())
    with pytest.raises(ValueError, match="relation: expected one of the scored relations"):
        scores.best("amod")


def test_score_baseline_is_the_most_common_offset_and_root_never_counts():
    # amod heads at +2, +2, +1 (and one amod-labelled root, which must not count)
    sentences = [
        Sentence(["big", "red", "car"], [3, 3, 0], ["amod", "amod", "root"]),
        Sentence(["old", "very", "man"], [3, 3, 0], ["amod", "advmod", "root"]),
        Sentence(["odd", "one"], [2, 0], ["dep", "amod"]),
    ]
    attentions = [torch.zeros(1, 1, len(s.words), len(s.words)) for s in sentences]
    scores = _score(attentions, sentences, ["amod"])
    assert scores.counts == {"amod": 3}
    assert scores.baseline["amod"] == (2, pytest.approx(2 / 3))


# ----------------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def model():
    return multihead.lab.models.load_minilm()[0]


@pytest.fixture(scope="module")
def scores(model) -> SyntaxScores:
    return syntax_scores(model, bundled_treebank(), max_sentences=200)


def test_syntax_scores_on_minilm(scores):
    assert (scores.sentences, scores.skipped) == (200, 0)
    assert scores.relations == list(RELATIONS)
    for relation in RELATIONS:
        assert scores.counts[relation] > 0
        for table in (scores.dependent_to_head, scores.head_to_dependent):
            assert table[relation].shape == (6, 12)
            assert ((table[relation] >= 0) & (table[relation] <= 1)).all()
    best = scores.best("det")
    # measured: layer 2 head 8, dependent -> head, 0.78 against 0.56 for "head at +1" (200 sentences)
    assert best["baseline_offset"] == 1
    assert best["score"] > best["baseline_score"] + 0.1
    assert scores.per_head_best().shape == (6, 12)


def test_syntax_scores_subset_matches_full_run(model, scores):
    sub = syntax_scores(model, bundled_treebank(), max_sentences=200, layers=[0], heads=[1, 2])
    assert (sub.layers, sub.heads) == ([0], [1, 2])
    for relation in RELATIONS:
        assert sub.counts[relation] == scores.counts[relation]
        assert sub.baseline[relation] == scores.baseline[relation]
        for direction in syntax.DIRECTIONS:
            part = getattr(sub, direction)[relation]
            assert part.shape == (1, 2)
            assert torch.equal(part, getattr(scores, direction)[relation][0:1, 1:3]), (relation, direction)


def test_syntax_scores_unknown_relation_lists_available(model):
    with pytest.raises(
        ValueError,
        match=r"relations: expected relations present in the sentences: .*\bdet\b.*"
        r"\bnsubj\b.*got 'foo'",
    ):
        syntax_scores(model, bundled_treebank(), relations=["det", "foo"], max_sentences=20)
    with pytest.raises(ValueError, match="got 'root'"):  # root attachments are never scored
        syntax_scores(model, bundled_treebank(), relations="root", max_sentences=20)


def test_default_relations_absent_from_a_few_sentences_are_left_out_and_named(model):
    """max_sentences=2 (a valid value) failed with an error about relations the two sentences lack; the defaults
    they have are scored and the others named in left_out (and syntax.json)."""
    sentences = bundled_treebank()[:2]
    present = {r for s in sentences for h, r in zip(s.heads, s.relations, strict=True) if h > 0}
    scores = syntax_scores(model, bundled_treebank(), max_sentences=2)
    assert scores.relations == [r for r in RELATIONS if r in present]
    assert scores.left_out == [r for r in RELATIONS if r not in present] == ["advmod", "aux", "nmod:poss"]
    assert scores.as_dict()["left_out"] == scores.left_out
    assert syntax_scores(model, bundled_treebank(), max_sentences=200).left_out == []
    nothing = [Sentence(["Hi", "!"], [0, 1], ["root", "punct"])]  # no default relation at all
    with pytest.raises(ValueError, match=r"sentences: expected sentences with at least one of the default"):
        syntax_scores(model, nothing)


def test_syntax_scores_skips_overlong_sentences_and_reports_progress(model):
    sentences = bundled_treebank()[:5]
    long = Sentence(["word"] * 600, [0] + [1] * 599, ["root"] + ["dep"] * 599)
    done = []
    result = syntax_scores(
        model, sentences + [long], relations=["det"], layers=[2], heads=[8], batch_size=2, progress=done.append
    )
    assert (result.sentences, result.skipped) == (5, 1)
    assert done == sorted(done) and done[-1] == 6
    # the long sentence's relation is not counted (it was skipped)
    assert result.counts["det"] == sum(r == "det" for s in sentences for r in s.relations)


def test_docstring_examples():
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    examples = 0
    for test in doctest.DocTestFinder().find(syntax, globs={"multihead": multihead, "torch": torch}):
        examples += len(test.examples)
        runner.run(test)
    assert examples > 0 and runner.failures == 0
