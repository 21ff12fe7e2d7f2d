"""Which heads track syntax: dependency relations found by attention, after Clark et al. (2019).

For a dependency relation r (a Universal Dependencies ``deprel`` such as ``det`` or ``nmod:poss``)
and one head, over the dependents d of relation r in a treebank (words attached to the root are
left out):

    dependent_to_head   share of dependents whose most-attended word is their syntactic head
    head_to_dependent   share of dependents whose head word's most-attended word is the dependent

"Most-attended" is the argmax over all words of the sentence (the word itself included) of the
word-level attention (:func:`word_attention`: attention TO a word sums over its word pieces,
attention FROM a word averages over its pieces; [CLS]/[SEP] are dropped, not renormalised).
The baseline per relation is the best fixed relative offset: the share of dependents whose head
sits k words away, for the most common k. A head "tracks" a relation when its score clears that
baseline (Clark et al. report e.g. determiners, direct objects, possessives and passive
auxiliaries found by single BERT heads well above the offset baseline).

    scores = syntax_scores(model, bundled_treebank())      # UD English EWT dev, 2,001 sentences
    scores.best("det")    # {'layer': ..., 'head': ..., 'direction': ..., 'score': ..., 'margin': ...}
    scores.table()        # one row per relation

The bundled treebank is the development split of the Universal Dependencies English Web Treebank
(v2.15), CC BY-SA 4.0; see ``data/ud-english-ewt/README.md`` and ``LICENSE.txt`` beside it.

References:
    Clark, Khandelwal, Levy, Manning. What Does BERT Look At? An Analysis of BERT's Attention.
    BlackboxNLP 2019. (Section 4.2: dependency syntax, per-relation best heads vs fixed-offset
    baselines.)
    Silveira et al. A Gold Standard Dependency Corpus for English. LREC 2014 (UD English EWT).
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from multihead._errors import bad_argument, describe
from multihead._userfiles import MissingFileError, read_text
from multihead.lab.inspect.recording import HeadGrid, head_grid, record_grid
from multihead.lab.inspect.roles import HeadRelation
from multihead.lab.inspect.stats import DECIMALS
from multihead.lab.models.contract import TextEncoder, evaluating, text_tokenizer
from multihead.lab.models.tokenizer import TextTokenizer

__all__ = [
    "head_relations",
    "relations_by_head",
    "MIN_RELATION_COUNT",
    "TREEBANK",
    "RELATIONS",
    "DIRECTIONS",
    "Sentence",
    "SyntaxScores",
    "bundled_treebank",
    "read_conllu",
    "word_attention",
    "syntax_scores",
]

TREEBANK = Path(__file__).resolve().parent.parent / "data" / "ud-english-ewt" / "en_ewt-ud-dev.conllu"

# The default relations: frequent ones with a clear head, Clark et al.'s Figure 5 set in UD names.
RELATIONS = ("nsubj", "obj", "det", "amod", "advmod", "aux", "case", "nmod:poss", "compound", "mark")
DIRECTIONS = ("dependent_to_head", "head_to_dependent")

# At most 9 digits: no sentence is longer, and Python refuses int() of a few thousand digits.
_ID_WORD = re.compile(r"[1-9][0-9]{0,8}")
_ID_RANGE = re.compile(r"[1-9][0-9]{0,8}-[1-9][0-9]{0,8}")
_ID_EMPTY = re.compile(r"[0-9]{1,9}\.[1-9][0-9]{0,8}")
_HEAD = re.compile(r"0|[1-9][0-9]{0,8}")


@dataclass
class Sentence:
    """One dependency-parsed sentence: per word its form, its head and the relation to it.

    words: the word forms (syntactic words: a multiword token such as "don't" gives "do", "n't").
    heads: per word, the 1-based index of its head word; 0 for the root.
    relations: per word, the UD ``deprel`` with its subtype kept (``nmod:poss``, ``compound:prt``).
    text, sent_id: the ``# text`` and ``# sent_id`` comments, when the file has them.
    """

    words: list[str]
    heads: list[int]
    relations: list[str]
    text: str | None = None
    sent_id: str | None = None

    def __post_init__(self) -> None:
        name = f"Sentence {self.sent_id}" if self.sent_id else "Sentence"
        if not (len(self.words) == len(self.heads) == len(self.relations)):
            raise bad_argument(
                name,
                "words, heads and relations of equal length",
                f"{len(self.words)}, {len(self.heads)} and {len(self.relations)}",
                "give one head and one relation per word",
            )
        for index, head in enumerate(self.heads):
            if (
                not isinstance(head, int)
                or isinstance(head, bool)
                or not 0 <= head <= len(self.words)
                or head == index + 1
            ):
                raise bad_argument(
                    f"{name} heads[{index}]",
                    f"a word number in 0..{len(self.words)} (0 = root) other than the word's own {index + 1}",
                    describe(head),
                    "heads are 1-based word indices, as in CoNLL-U's HEAD column",
                )


# ----------------------------------------------------------------------------------- reading CoNLL-U


def _validate_conllu(text: str, source: str) -> None:
    """Raise ValueError naming the 1-based line of the first malformed token line of ``text``."""

    def fail(number: int, expected: str, got: object, fix: str) -> Exception:
        return bad_argument(f"{source} line {number}", expected, got, fix)

    words: list[tuple[int, int]] = []  # (line number, HEAD) of the current sentence's words

    def end_sentence() -> None:
        for number, head in words:
            if head > len(words):
                raise fail(
                    number,
                    f"a HEAD in 0..{len(words)} (the sentence has {len(words)} words)",
                    head,
                    "point HEAD at a word of the same sentence (0 for the root)",
                )
        words.clear()

    for number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            end_sentence()
            continue
        if line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 10:
            raise fail(
                number,
                "10 tab-separated fields (ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS MISC)",
                len(fields),
                "separate the ten columns with single tabs; write _ for an empty field",
            )
        if any("  " in value for value in fields):
            raise fail(
                number,
                "fields without two spaces in a row",
                repr(line),
                "the conllu parser splits columns on two spaces: use one space, or tabs between columns",
            )
        token_id, head = fields[0], fields[6]
        if _ID_WORD.fullmatch(token_id):
            if int(token_id) != len(words) + 1:
                raise fail(
                    number,
                    f"word ID {len(words) + 1} (IDs run 1, 2, 3, ... in each sentence)",
                    repr(token_id),
                    "number the words of a sentence from 1 in order; separate sentences with a blank line",
                )
            if not _HEAD.fullmatch(head):
                raise fail(number, "an integer HEAD (0 for the root)", repr(head), "put the head word's ID in column 7")
            if int(head) == int(token_id):
                raise fail(
                    number,
                    "a HEAD other than the word's own ID",
                    repr(head),
                    "point HEAD at the word this one depends on (0 for the root)",
                )
            words.append((number, int(head)))
        elif _ID_RANGE.fullmatch(token_id) or _ID_EMPTY.fullmatch(token_id):
            if head != "_" and not _HEAD.fullmatch(head):
                raise fail(
                    number,
                    "HEAD _ (or an integer) on a multiword token or empty node",
                    repr(head),
                    "write _ in column 7 of ranges (3-4) and empty nodes (5.1)",
                )
        else:
            raise fail(
                number,
                "an ID that is an integer (3), a range (3-4) or a decimal (5.1)",
                repr(token_id),
                "put the token's ID in column 1",
            )
    end_sentence()


def read_conllu(path_or_text: str | Path, *, argument: str = "path") -> list[Sentence]:
    """The sentences of a CoNLL-U file (a path) or string, parsed with the ``conllu`` package.

    Multiword-token ranges (IDs like 3-4) and empty nodes (IDs like 5.1) are skipped, so ``words``
    are the syntactic words the heads refer to. Every token line is checked first: ten
    tab-separated fields, an integer/range/decimal ID, an integer HEAD on words (``_`` allowed on
    ranges and empty nodes), word IDs 1, 2, ... in order and heads inside the sentence.

    Args:
        path_or_text: a :class:`~pathlib.Path`, a path string, or CoNLL-U text (a string with a
            newline or a tab in it is taken as text).
        argument: the name of the path in errors (the CLI passes "--treebank").

    Returns:
        list of :class:`Sentence`, in file order (sentences without words left out).

    Raises:
        ValueError: a malformed line, naming it: ``"conllu line 17: expected 10 tab-separated
            fields ..., got 3. Fix: ..."`` (``"<path> line 17"`` for a file).
        FileNotFoundError: the path does not exist (ValueError: a folder, unreadable, not UTF-8).

    Example:
        >>> from multihead.lab.inspect.syntax import read_conllu
        >>> row = "{}\\t{}\\t_\\t_\\t_\\t_\\t{}\\t{}\\t_\\t_"          # ID FORM ... HEAD DEPREL ...
        >>> text = "\\n".join([row.format(1, "The", 2, "det"), row.format(2, "end", 0, "root")])
        >>> sentence = read_conllu(text)[0]
        >>> sentence.words, sentence.heads, sentence.relations
        (['The', 'end'], [2, 0], ['det', 'root'])
    """
    import conllu  # imported here: only reading treebanks needs it

    if isinstance(path_or_text, str) and ("\n" in path_or_text or "\t" in path_or_text):
        text, source = path_or_text, "conllu"
    elif isinstance(path_or_text, (str, Path)):
        text = read_text(
            argument,
            path_or_text,
            what="an existing CoNLL-U file",
            fix="pass the path of a UTF-8 .conllu file (or CoNLL-U text), or use bundled_treebank()",
        )
        source = str(path_or_text) if argument == "path" else f"{argument} {path_or_text}"
    else:
        raise bad_argument(
            "path_or_text",
            "a path or CoNLL-U text (str or Path)",
            describe(path_or_text),
            "pass e.g. multihead.lab.inspect.syntax.TREEBANK",
            kind=TypeError,
        )
    _validate_conllu(text, source)
    raw = {name: (lambda line, i: line[i]) for name in ("feats", "deps", "misc")}  # unused: keep as text
    sentences = []
    for tokens in conllu.parse(text, field_parsers=raw):
        words = [token for token in tokens if isinstance(token["id"], int)]
        if not words:
            continue
        sentences.append(
            Sentence(
                [token["form"] for token in words],
                [token["head"] for token in words],
                [token["deprel"] for token in words],
                text=tokens.metadata.get("text"),
                sent_id=tokens.metadata.get("sent_id"),
            )
        )
    return sentences


@functools.lru_cache(maxsize=1)
def _bundled() -> tuple[Sentence, ...]:
    if not TREEBANK.is_file():
        raise bad_argument(
            "treebank",
            "the bundled UD English EWT dev split",
            f"no file at {TREEBANK}",
            "reinstall multihead (the .conllu ships as package data)",
            kind=MissingFileError,
        )
    return tuple(read_conllu(TREEBANK))


def bundled_treebank() -> list[Sentence]:
    """The bundled UD English EWT dev split (2,001 sentences, 25,147 words), parsed (a fresh copy).

    Example:
        >>> from multihead.lab.inspect.syntax import bundled_treebank
        >>> sentences = bundled_treebank()
        >>> len(sentences), sentences[0].words
        (2001, ['From', 'the', 'AP', 'comes', 'this', 'story', ':'])
    """
    return [Sentence(list(s.words), list(s.heads), list(s.relations), s.text, s.sent_id) for s in _bundled()]


# ----------------------------------------------------------------------------------- word attention


def _pooling(
    word_ids: Sequence[int | None], num_words: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, n) key pooling (1 where piece p belongs to word w) and query pooling (1 / pieces of w)."""
    n = len(word_ids)
    pieces = torch.tensor([-1 if w is None else w for w in word_ids], device=device)  # (n,)
    keys = (pieces[None, :] == torch.arange(num_words, device=device)[:, None]).to(dtype)  # (W, n)
    queries = keys / keys.sum(dim=1, keepdim=True).clamp(min=1)
    assert keys.shape == (num_words, n)
    return keys, queries


def word_attention(
    weights: torch.Tensor, word_ids: Sequence[int | None], *, num_words: int | None = None
) -> torch.Tensor:
    """Word-level attention of one sentence from its word-piece attention (Clark et al. 2019, 4.2).

    Attention TO a word is the sum over its pieces (the key axis); attention FROM a word is the
    mean over its pieces (the query axis). [CLS]/[SEP] (``None`` in ``word_ids``) are dropped,
    rows are not renormalised (only the argmax is used downstream). Computed as
    ``Q @ weights @ K.T`` with pooling matrices Q, K of shape (W, n).

    Args:
        weights: (..., n, n) attention over the n word pieces of one sentence (no padding),
            e.g. (heads, n, n).
        word_ids: n entries: the word index of each piece, None for special tokens
            (:attr:`multihead.lab.models.TokenBatch.word_ids`).
        num_words: W (default: the largest word index + 1); words with no piece get zero rows
            and columns.

    Returns:
        (..., W, W), in ``weights``' dtype: [h, i, j] is how much word i attends to word j.

    Example:
        >>> from multihead.lab.inspect.syntax import word_attention
        >>> weights = torch.full((1, 4, 4), 0.25)          # [CLS] new ##ly [SEP]: 2 pieces, 1 word
        >>> word_attention(weights, [None, 0, 0, None])
        tensor([[[0.5000]]])
    """
    if not isinstance(weights, torch.Tensor) or weights.dim() < 2 or weights.shape[-1] != weights.shape[-2]:
        raise bad_argument(
            "weights",
            "a tensor (..., n, n) of one sentence's attention",
            describe(weights),
            "pass e.g. rec.weights(layer)[i, :, :n, :n] for sentence i of n pieces",
            kind=TypeError,
        )
    try:
        ids = list(word_ids)
    except TypeError:
        raise bad_argument(
            "word_ids",
            "a list of word indices (None for special tokens)",
            describe(word_ids),
            "pass TokenBatch.word_ids[i]",
            kind=TypeError,
        ) from None
    n = weights.shape[-1]
    if len(ids) != n:
        raise bad_argument(
            "word_ids",
            f"{n} entries, one per word piece of weights",
            f"{len(ids)} entries",
            "pass the word ids of the same sentence, without padding",
        )
    if not all(w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 0) for w in ids):
        raise bad_argument(
            "word_ids", "non-negative ints or None", describe(ids), "pass TokenBatch.word_ids[i]", kind=TypeError
        )
    largest = max((w for w in ids if w is not None), default=-1) + 1
    if num_words is None:
        num_words = largest
    elif not isinstance(num_words, int) or isinstance(num_words, bool) or num_words < largest:
        raise bad_argument(
            "num_words",
            f"an int >= {largest} (the largest word index + 1)",
            describe(num_words),
            "pass the sentence's word count, or leave it out",
        )
    dtype = weights.dtype if weights.is_floating_point() else torch.float32
    keys, queries = _pooling(ids, num_words, dtype, weights.device)
    return queries @ weights.to(dtype) @ keys.T


# ----------------------------------------------------------------------------------- scoring


@dataclass
class SyntaxScores:
    """How well each head finds each dependency relation (Clark et al. 2019), with baselines.

    layers, heads: the model layer indices and checkpoint head numbers the rows and columns stand for.
    layer_heads: each row's heads when some layer lacks a column (a pruned model: its cells are NaN),
        None when every layer has every column.
    relations: the relations scored, in the order asked.
    counts[r]: dependents of relation r scored (root attachments never count).
    dependent_to_head[r], head_to_dependent[r]: (layers, heads) float64 shares in [0, 1]
        (NaN where counts[r] is 0).
    baseline[r]: (offset, share): the fixed relative offset k = head - dependent (in words) that
        is right most often, and how often.
    sentences: sentences scored; skipped: sentences left out (over the model's positions, or a
        word the tokenizer drops entirely).
    left_out: default relations (:data:`RELATIONS`) not scored because no sentence has them (a few sentences:
        ``max_sentences=2``); relations asked for by name are never left out.
    """

    layers: list[int]
    heads: list[int]
    relations: list[str]
    counts: dict[str, int]
    dependent_to_head: dict[str, torch.Tensor]
    head_to_dependent: dict[str, torch.Tensor]
    baseline: dict[str, tuple[int, float]]
    sentences: int
    skipped: int = 0
    source: str = field(default="sentences")
    layer_heads: list[list[int]] | None = None
    left_out: list[str] = field(default_factory=list)

    def _check(self, relation: str) -> None:
        if relation not in self.relations:
            raise bad_argument(
                "relation",
                f"one of the scored relations ({', '.join(self.relations)})",
                repr(relation),
                "pass relations=[...] including it to syntax_scores",
            )

    def best(self, relation: str) -> dict:
        """The head that finds ``relation`` best, in either direction, against the offset baseline.

        Returns a dict: relation, count, layer, head, direction (``"dependent_to_head"`` or
        ``"head_to_dependent"``; the former on a tie), score, baseline_offset, baseline_score,
        margin (= score - baseline_score). layer/head/direction are None when count is 0.
        """
        self._check(relation)
        offset, share = self.baseline[relation]
        row = {
            "relation": relation,
            "count": self.counts[relation],
            "layer": None,
            "head": None,
            "direction": None,
            "score": math.nan,
            "baseline_offset": offset,
            "baseline_score": share,
            "margin": math.nan,
        }
        if self.counts[relation] == 0:
            return row
        best_score = -math.inf
        for direction in DIRECTIONS:
            scores = torch.nan_to_num(getattr(self, direction)[relation], nan=-math.inf)  # pruned heads: never best
            index = int(scores.flatten().argmax())
            score = float(scores.flatten()[index])
            if score > best_score or row["direction"] is None:
                best_score = score
                layer, head = divmod(index, len(self.heads))
                row.update(
                    layer=self.layers[layer],
                    head=self.heads[head],
                    direction=direction,
                    score=score,
                    margin=score - share,
                )
        return row

    def table(self) -> list[dict]:
        """:meth:`best` for every relation, in the order of ``relations``."""
        return [self.best(relation) for relation in self.relations]

    def head_relations(self) -> list[list[HeadRelation | None]]:
        """Per head ([row][col] over ``layers`` x ``heads``), the relation it finds best relative to that
        relation's best fixed offset (the largest margin, either direction), among relations with at least
        ``MIN_RELATION_COUNT`` dependents that it finds more often than the offset does; None for a pruned
        head or when no relation qualifies. The roles
        weigh it with the head's other signals (:meth:`multihead.lab.inspect.stats.HeadStats.with_relations`)."""
        return head_relations(self.as_dict())

    def per_head_best(self) -> torch.Tensor:
        """(layers, heads): each head's best score over relations and both directions (0 if none; NaN for a
        head pruned from the layer)."""
        best = torch.zeros(len(self.layers), len(self.heads), dtype=torch.float64)
        for relation in self.relations:
            if self.counts[relation]:
                best = torch.maximum(
                    best, torch.maximum(self.dependent_to_head[relation], self.head_to_dependent[relation])
                )
        if self.layer_heads is not None:
            best[~HeadGrid(self.layers, self.heads, self.layer_heads).present] = math.nan
        return best

    def per_head_relation(self) -> list[list[str | None]]:
        """The relation behind each :meth:`per_head_best` score: [row][col] (None if no relation scored)."""
        best = torch.full((len(self.layers), len(self.heads)), -1.0, dtype=torch.float64)
        names: list[list[str | None]] = [[None] * len(self.heads) for _ in self.layers]
        for relation in self.relations:
            if not self.counts[relation]:
                continue
            scores = torch.maximum(self.dependent_to_head[relation], self.head_to_dependent[relation])
            for row, col in (scores > best).nonzero().tolist():
                names[row][col] = relation
            best = torch.maximum(best, scores)
        return names

    def as_dict(self) -> dict:
        """Plain values for JSON: shares per relation as nested lists (layers x heads), the table."""

        def plain(value: float) -> float | None:
            return None if math.isnan(value) else round(value, DECIMALS)

        def grid(tensor: torch.Tensor) -> list[list[float | None]]:
            return [[plain(x) for x in row] for row in tensor.tolist()]

        layer_heads = {} if self.layer_heads is None else {"layer_heads": self.layer_heads}
        return {
            "source": self.source,
            "sentences": self.sentences,
            "skipped": self.skipped,
            "layers": self.layers,
            "heads": self.heads,
            **layer_heads,
            "relations": self.relations,
            "left_out": self.left_out,
            "counts": dict(self.counts),
            "baseline": {r: {"offset": o, "score": plain(s)} for r, (o, s) in self.baseline.items()},
            "dependent_to_head": {r: grid(t) for r, t in self.dependent_to_head.items()},
            "head_to_dependent": {r: grid(t) for r, t in self.head_to_dependent.items()},
            "best": [{k: plain(v) if isinstance(v, float) else v for k, v in row.items()} for row in self.table()],
        }


class _Scorer:
    """Running hit counts of every head (rows of a flat (L*H) axis) for each relation."""

    def __init__(self, relations: Sequence[str], rows: int):
        self.relations = list(relations)
        self.index = {relation: i for i, relation in enumerate(self.relations)}
        self.to_head = torch.zeros(rows, len(self.relations), dtype=torch.float64)
        self.to_dependent = torch.zeros(rows, len(self.relations), dtype=torch.float64)
        self.counts = torch.zeros(len(self.relations), dtype=torch.float64)
        self.offsets: list[Counter] = [Counter() for _ in self.relations]
        self.sentences = 0

    def add(self, attention: torch.Tensor, sentence: Sentence) -> None:
        """attention (rows, W, W) word-level for ``sentence`` of W words."""
        self.sentences += 1
        found = [
            (d, h - 1, self.index[r])
            for d, (h, r) in enumerate(zip(sentence.heads, sentence.relations, strict=True))
            if h > 0 and r in self.index
        ]
        if not found:
            return
        dependents, heads, relations = (torch.tensor(column) for column in zip(*found, strict=True))
        for d, h, r in found:
            self.offsets[r][h - d] += 1
        self.counts += torch.bincount(relations, minlength=len(self.relations)).to(torch.float64)
        target = attention.argmax(dim=-1)  # (rows, W): each word's most attended word, itself included
        to_head = (target[:, dependents] == heads).to(torch.float64)  # (rows, m)
        to_dependent = (target[:, heads] == dependents).to(torch.float64)
        self.to_head.index_add_(1, relations, to_head)
        self.to_dependent.index_add_(1, relations, to_dependent)

    def result(
        self,
        layers: list[int],
        heads: list[int],
        *,
        skipped: int = 0,
        source: str = "sentences",
        layer_heads: list[list[int]] | None = None,
    ) -> SyntaxScores:
        shape = (len(layers), len(heads))
        pruned = None if layer_heads is None else ~HeadGrid(layers, heads, layer_heads).present
        counts = {r: int(self.counts[i]) for i, r in enumerate(self.relations)}
        to_head, to_dependent, baseline = {}, {}, {}
        for i, relation in enumerate(self.relations):
            total = self.counts[i]
            to_head[relation] = (self.to_head[:, i] / total).reshape(shape)  # NaN when no dependent
            to_dependent[relation] = (self.to_dependent[:, i] / total).reshape(shape)
            if pruned is not None:  # a head pruned from a layer has no score there
                to_head[relation][pruned] = math.nan
                to_dependent[relation][pruned] = math.nan
            if self.offsets[i]:  # the most common offset; ties: nearer first, then the left one
                offset = min(self.offsets[i], key=lambda k: (-self.offsets[i][k], abs(k), k))
                baseline[relation] = (offset, self.offsets[i][offset] / counts[relation])
            else:
                baseline[relation] = (0, math.nan)
        return SyntaxScores(
            list(layers),
            list(heads),
            list(self.relations),
            counts,
            to_head,
            to_dependent,
            baseline,
            sentences=self.sentences,
            skipped=skipped,
            source=source,
            layer_heads=layer_heads,
        )


def _score(
    attentions: Iterable[torch.Tensor], sentences: Sequence[Sentence], relations: Sequence[str] = RELATIONS
) -> SyntaxScores:
    """Scores from word-level attention given directly: one (layers, heads, W, W) or (heads, W, W)
    tensor per sentence (the core of :func:`syntax_scores`, for synthetic checks)."""
    scorer, layers, heads = None, 0, 0
    for attention, sentence in zip(attentions, sentences, strict=True):
        if attention.dim() == 3:
            attention = attention[None]
        if scorer is None:
            layers, heads = attention.shape[:2]
            scorer = _Scorer(relations, layers * heads)
        scorer.add(attention.reshape(-1, *attention.shape[-2:]), sentence)
    if scorer is None:
        raise bad_argument("sentences", "at least one sentence", "none", "pass sentences with their attention")
    return scorer.result(list(range(layers)), list(range(heads)))


def _relations(relations: str | Sequence[str] | None, sentences: Sequence[Sentence]) -> tuple[list[str], list[str]]:
    """(validated relation names, defaults left out): each name asked for must label at least one non-root word
    of ``sentences``; None asks for the defaults (:data:`RELATIONS`) those words have, leaving out the others."""
    available = Counter(r for s in sentences for h, r in zip(s.heads, s.relations, strict=True) if h > 0)
    if relations is None:
        present = [r for r in RELATIONS if r in available]
        if not present:
            raise bad_argument(
                "sentences",
                "sentences with at least one of the default relations (" + ", ".join(RELATIONS) + ")",
                "relations " + (", ".join(sorted(available)) or "none"),
                "pass more sentences, or name relations they have",
            )
        return present, [r for r in RELATIONS if r not in available]
    chosen = [relations] if isinstance(relations, str) else relations
    try:
        chosen = list(dict.fromkeys(chosen))
    except TypeError:
        raise bad_argument(
            "relations",
            "a list of UD relation names",
            describe(relations),
            'pass e.g. relations=["det", "nsubj"]',
            kind=TypeError,
        ) from None
    if not chosen or not all(isinstance(r, str) for r in chosen):
        raise bad_argument(
            "relations",
            "a non-empty list of UD relation names (str)",
            describe(relations),
            'pass e.g. relations=["det", "nsubj"]',
            kind=TypeError if chosen else ValueError,
        )
    unknown = [r for r in chosen if r not in available]
    if unknown:
        raise bad_argument(
            "relations",
            "relations present in the sentences: " + ", ".join(sorted(available)),
            ", ".join(map(repr, unknown)),
            "pick relations from that list (UD deprels, subtypes such as nmod:poss written out)",
        )
    return chosen, []


def syntax_scores(
    model: TextEncoder,
    sentences: Sequence[Sentence] | str | Path | None = None,
    *,
    relations: str | Sequence[str] | None = None,
    layers: Sequence[int] | int | None = None,
    heads: Sequence[int] | int | None = None,
    batch_size: int = 16,
    max_sentences: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> SyntaxScores:
    """Per head and relation, how often attention points along the dependency (Clark et al. 2019).

    The sentences' words go through the model (batched by length, padded; weights recorded with
    :func:`multihead.lab.inspect.capture`); each sentence's piece attention becomes word attention
    (:func:`word_attention`); for each dependent d of relation r with head word g, a head scores
    a hit dependent_to_head when argmax_j A[d, j] = g, and head_to_dependent when
    argmax_j A[g, j] = d (argmax over all words, as Clark et al.). Shares are over all dependents
    of r; the baseline is the best fixed offset g - d.

    Args:
        model: a :class:`multihead.lab.models.Encoder` with its tokenizer (``load_minilm()``).
        sentences: :class:`Sentence` list, or a .conllu path; default :func:`bundled_treebank`.
        relations: UD relations to score; each must occur in the sentences (a ValueError lists those that
            do). None (the default): those of :data:`RELATIONS` the sentences have, the others named in
            ``left_out``.
        layers, heads: which to score (default all): model layer indices, and the checkpoint's head numbers
            (a pruned model's heads keep theirs; a head pruned from a layer scores NaN there).
        batch_size: sentences per forward pass.
        max_sentences: score only the first this many sentences (default all).
        progress: called after each batch with the number of sentences done (skipped ones included).

    Returns:
        :class:`SyntaxScores` with (layers, heads) tensors per relation.

    Example:
        >>> from multihead.lab.inspect.syntax import bundled_treebank, syntax_scores
        >>> model, _ = multihead.lab.models.load_minilm()
        >>> scores = syntax_scores(model, bundled_treebank(), relations=["det", "nsubj"], max_sentences=100)
        >>> scores.dependent_to_head["det"].shape           # (layers, heads)
        torch.Size([6, 12])
        >>> best = scores.best("det")
        >>> best["score"] > best["baseline_score"]
        True
    """
    tokenizer = text_tokenizer(model)
    sentences, source = _chosen_sentences(sentences, max_sentences)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise bad_argument("batch_size", "a positive int", describe(batch_size), "pass e.g. batch_size=16")
    chosen, left_out = _relations(relations, sentences)

    # Piece counts first: sentences over the model's positions are skipped, the rest batched by length.
    order = _fitting_by_length(tokenizer, sentences)
    skipped = len(sentences) - len(order)
    grid = head_grid(model, layers, heads)
    scorer = _scored_batches(
        model, tokenizer, grid, sentences, order, chosen, batch_size=batch_size, skipped=skipped, progress=progress
    )
    scores = scorer.result(
        grid.layers,
        grid.heads,
        skipped=skipped,
        source=source,
        layer_heads=grid.layer_heads if grid.ragged else None,
    )
    scores.left_out = left_out
    return scores


def _chosen_sentences(
    sentences: Sequence[Sentence] | str | Path | None, max_sentences: int | None
) -> tuple[Sequence[Sentence], str]:
    """The sentences :func:`syntax_scores` reads (the bundled treebank for None, a .conllu file read for a path;
    the first ``max_sentences`` of them), checked, and the source they came from."""
    if sentences is None:
        sentences, source = bundled_treebank(), "UD English EWT dev"
    elif isinstance(sentences, (str, Path)):
        source = str(sentences)
        sentences = read_conllu(sentences)
    else:
        source = "sentences"
    if not isinstance(sentences, (list, tuple)) or not all(isinstance(s, Sentence) for s in sentences):
        raise bad_argument(
            "sentences",
            "a list of Sentence (read_conllu / bundled_treebank)",
            describe(sentences),
            "pass e.g. bundled_treebank()",
            kind=TypeError,
        )
    if max_sentences is not None:
        if not isinstance(max_sentences, int) or isinstance(max_sentences, bool) or max_sentences < 1:
            raise bad_argument(
                "max_sentences",
                "a positive int or None",
                describe(max_sentences),
                "pass e.g. max_sentences=200",
                kind=TypeError if not isinstance(max_sentences, int) else ValueError,
            )
        sentences = sentences[:max_sentences]
    if not sentences:
        raise bad_argument("sentences", "at least one sentence", "none", "pass e.g. bundled_treebank()")
    return sentences, source


def _fitting_by_length(tokenizer: TextTokenizer, sentences: Sequence[Sentence]) -> list[int]:
    """The indices of the sentences that fit the model's positions with every word given a piece, shortest first
    (in pieces): batched so, a batch pads little. The others are skipped."""
    words = [s.words for s in sentences]
    lengths, keep = [], []
    for start in range(0, len(words), 256):
        encoded = tokenizer.batch(words[start : start + 256], max_length=1 << 62)
        for offset, ids in enumerate(encoded.word_ids):
            index = start + offset
            covered = len({w for w in ids if w is not None}) == len(words[index])
            if len(ids) <= tokenizer.max_length and covered:
                keep.append(index)
                lengths.append(len(ids))
    return [index for _, index in sorted(zip(lengths, keep, strict=True))]


def _scored_batches(
    model: TextEncoder,
    tokenizer: TextTokenizer,
    grid: HeadGrid,
    sentences: Sequence[Sentence],
    order: Sequence[int],
    relations: Sequence[str],
    *,
    batch_size: int,
    skipped: int,
    progress: Callable[[int], None] | None,
) -> _Scorer:
    """The sentences at ``order`` through ``model``, ``batch_size`` a pass, the grid's heads recorded and their
    word attention scored for ``relations``; ``progress`` counts the ``skipped`` sentences as done."""
    with evaluating(model), record_grid(model, grid) as rec:
        scorer = _Scorer(relations, len(grid.layers) * len(grid.heads))
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch = tokenizer.batch([sentences[i].words for i in chunk])
            model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
            # per layer (b, its heads, n, n) -> (L, H, b, n, n), zeros in the cells of pruned heads
            padded = grid.pad([None if w is None else w.transpose(0, 1) for w in rec.weights()])
            weights = padded.movedim(2, 0).flatten(1, 2).float()  # (b, L*H, n, n)
            rec.clear()
            for row, index in enumerate(chunk):
                n = len(batch.word_ids[row])
                words = sentences[index].words
                attention = word_attention(weights[row, :, :n, :n], batch.word_ids[row], num_words=len(words))
                scorer.add(attention, sentences[index])
            if progress is not None:
                progress(skipped + min(start + batch_size, len(order)))
    return scorer


MIN_RELATION_COUNT = 10  # relations with fewer dependents are too noisy to name a head after


def head_relations(scores: dict) -> list[list[HeadRelation | None]]:
    """:meth:`SyntaxScores.head_relations` from its :meth:`SyntaxScores.as_dict` (what syntax.json holds), so a
    saved syntax.json can label the heads of a later ``multihead inspect --scores``."""
    grid: list[list[HeadRelation | None]] = [[None] * len(scores["heads"]) for _ in scores["layers"]]
    margins = [[-math.inf] * len(scores["heads"]) for _ in scores["layers"]]
    for relation in scores["relations"]:
        baseline = scores["baseline"][relation]["score"]
        if scores["counts"][relation] < MIN_RELATION_COUNT or baseline is None:
            continue
        for direction in DIRECTIONS:
            for row, values in enumerate(scores[direction][relation]):
                for col, score in enumerate(values):
                    if score is not None and score - baseline > max(margins[row][col], 0.0):
                        margins[row][col] = score - baseline
                        grid[row][col] = HeadRelation(relation, score, baseline, direction)
    return grid


def relations_by_head(scores: dict) -> dict[tuple[int, int], HeadRelation]:
    """:func:`head_relations` keyed by (layer, head) (heads with no relation left out): what
    ``inspect_text(relations=...)`` takes."""
    grid = head_relations(scores)
    return {
        (layer, head): relation
        for layer, row in zip(scores["layers"], grid, strict=True)
        for head, relation in zip(scores["heads"], row, strict=True)
        if relation is not None
    }
