"""One text through a text model, every head measured and labelled: the :class:`Inspection` (data only).

    inspection = inspect_text(model, "The bank was full of money.", token="bank")
    inspection.top_attended(layer=2, head=5)     # [('money', 6, 0.41), ...]
    inspection.to_dict()                         # what inspect.json holds, and what the HTML page draws
    inspect_text(bart, text, part="cross")       # an encoder-decoder's cross-attention: decoder input -> text

An inspection covers one part of the model's attention (see
:func:`~multihead.capture.attention_sites`): "self" in a one-stack model (BERT, GPT-2, Llama),
"encoder", "decoder" or "cross" in an encoder-decoder (BART). Its ``tokens`` are the query pieces and its
``key_tokens`` the key pieces (:meth:`~multihead.lab.models.TextEncoder.part_pieces`): the same in
self-attention; in cross-attention the decoder's input and the source text. ``pieces`` and ``key_pieces``
group them into words as the tokenizer split the text.

The renderers take an Inspection: :mod:`~multihead.lab.inspect.terminal`, :mod:`~multihead.lab.inspect.html`,
:mod:`~multihead.lab.inspect.plots`; :mod:`~multihead.lab.inspect.write` writes them all (``report()``).
"""

from __future__ import annotations

import base64
import unicodedata
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from multihead._errors import bad_argument, describe, items_renamed
from multihead._userfiles import read_text
from multihead.lab._words import counted
from multihead.lab.inspect.notebook import shorten
from multihead.lab.inspect.recording import HeadGrid, _causal, head_grid, record_grid
from multihead.lab.inspect.roles import HeadRelation
from multihead.lab.inspect.similarity import HeadSimilarity
from multihead.lab.inspect.stats import DECIMALS, HeadStats, head_stats, weight_stats
from multihead.lab.models.contract import TextEncoder, evaluating, text_tokenizer
from multihead.lab.models.tokenizer import Pieces, TokenBatch

__all__ = [
    "Inspection",
    "inspect_text",
    "bundled_corpus",
    "read_corpus",
    "read_corpus_lines",
    "pick_token",
    "compact_weights",
    "weights_from_dict",
    "DENSE_WEIGHTS_LIMIT",
    "COMPACT_WEIGHTS",
    "BUNDLED_CORPUS",
    "SPECIAL_TOKENS",
    "PART_TITLES",
    "CAUSAL_NOTE",
    "set_html_renderer",
]

BUNDLED_CORPUS = Path(__file__).with_name("corpus.txt")
SPECIAL_TOKENS = frozenset({"[CLS]", "[SEP]"})  # the reports set them apart from the words of the text
# What each part's attention goes from and to, as the reports' headers name it ("self" needs no title).
PART_TITLES = {
    "self": "self-attention",
    "encoder": "encoder self-attention: source text -> source text",
    "decoder": "decoder self-attention: decoder input -> decoder input",
    "cross": "cross-attention: decoder input -> source text",
}
CAUSAL_NOTE = "causal: each token attends only to itself and earlier tokens"
# Up to this many weights in all (6 x 12 heads at 120 tokens), to_dict() writes them as nested lists of numbers;
# past it, compactly (COMPACT_WEIGHTS): a 512-token report of MiniLM's 72 heads is 3 MB, not 150 MB of text.
DENSE_WEIGHTS_LIMIT = 1 << 20
# The compact form: every weight as round(255 w), one byte (so to within 1/510 = 0.002), in (layers, heads, i,
# j) order, compressed with zlib (deflate) and written in base64. The page inflates it with the browser's
# DecompressionStream("deflate"); weights_from_dict() reads either form.
COMPACT_WEIGHTS = "uint8 of 255*w, zlib, base64"
# Words that are rarely what a user means by "the token to look at": the default --token skips them.
_FUNCTION_WORDS = frozenset(
    "a an the this that these those of to in on at by for from with into onto about as and or but nor so if "
    "is am are was were be been being has have had do does did will would shall should can could may might "
    "must it its he she they we you i me him her them us my your his their our not no".split()
)


# The notebook view of an Inspection is the HTML report's scoped fragment. The renderer lives a layer above
# (multihead.lab.inspect.html, imported with multihead.lab.inspect) and registers itself here, so this module never
# imports it.
_html_renderer: Callable[[Inspection], str] | None = None


def set_html_renderer(render: Callable[[Inspection], str]) -> None:
    """Register the function that renders an Inspection as an HTML fragment (``Inspection._repr_html_``)."""
    global _html_renderer
    _html_renderer = render


def read_corpus(path: str | Path, *, argument: str = "corpus") -> list[str]:
    """The texts of a corpus file: one per line, blank lines and lines starting with '# ' skipped.

    ``argument`` names the path in errors (the CLI passes "--corpus"). A missing file raises
    FileNotFoundError; a folder, an unreadable or non-UTF-8 file, or one without a text, ValueError.
    """
    return [text for _, text in read_corpus_lines(path, argument=argument)]


def read_corpus_lines(path: str | Path, *, argument: str = "corpus") -> list[tuple[int, str]]:
    """:func:`read_corpus`'s texts, each with its line number in the file (from 1), for errors about a line."""
    text = read_text(
        argument,
        path,
        what="a text file with one sentence per line",
        fix="pass an existing UTF-8 text file, or --corpus alone for the bundled corpus",
    )
    lines = [(number, line.strip()) for number, line in enumerate(text.splitlines(), start=1)]
    lines = [(number, line) for number, line in lines if line and not line.startswith("# ")]
    if not lines:
        raise bad_argument(
            argument, "at least one non-empty line", f"none in {str(path)!r}", "put one sentence per line in the file"
        )
    return lines


def bundled_corpus() -> list[str]:
    """The project's corpus of varied English sentences (written for multihead; MIT licence)."""
    return read_corpus(BUNDLED_CORPUS)


def _folded(word: str) -> str:
    """``word`` as uncased tokenizers read it: case folded, accents dropped ("Café" -> "cafe")."""
    decomposed = unicodedata.normalize("NFKD", word.strip())
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch)).casefold()


def _occurrences(pieces: Pieces, word: str, *, causal: bool) -> list[int]:
    """The query pieces where ``word`` occurs: as a word of the text, the piece that stands for it
    (:meth:`~multihead.lab.models.Pieces.query_piece`), else as a piece ("##bank"); either match is made as the
    tokenizer folds text (case, accents)."""
    wanted = _folded(word)
    found = [
        pieces.query_piece(index, causal=causal)
        for index in pieces.present_words()
        if _folded(pieces.words[index]) == wanted
    ]
    return found or [index for index, piece in enumerate(pieces.tokens) if _folded(piece) == wanted]


def pick_token(
    tokens: Pieces | Sequence[str], token: str | int | tuple[str, int] | None, *, causal: bool = False
) -> int:
    """The index of the query token to show.

    ``tokens``: the query pieces, a :class:`~multihead.lab.models.Pieces` with their words (or bare pieces,
    grouped by their markers). ``token``: a word of the text, else a piece ("##bank"), matched as the tokenizer
    folds text (case, accents: "café" finds "Café" and an uncased tokenizer's "cafe"; its first occurrence),
    ``(word, n)`` for its n-th occurrence counted from 1, an int index, or None for the default: the first
    content word (not special, punctuation or a function word), or, when ``causal``, the last one. A causal
    query sees only what comes before it: the first word sees almost nothing (an induction head there shows
    only <bos>), the last sees the whole text.

    A word of several pieces ("b an k") is its query piece (:meth:`~multihead.lab.models.Pieces.query_piece`):
    its first piece, or in a ``causal`` part its last, the one that has read the whole word; the reports then
    name the word and its pieces (:attr:`Inspection.query`).
    """
    pieces = Pieces.of(tokens)
    tokens = pieces.tokens
    if token is None:
        words = pieces.present_words()
        for candidate in reversed(words) if causal else words:
            text = pieces.words[candidate]
            if text.isalnum() and text.lower() not in _FUNCTION_WORDS:
                return pieces.query_piece(candidate, causal=causal)
        if causal:  # no content word: the last piece of a word, else the last piece
            return next((k for k in reversed(range(len(tokens))) if pieces.word_ids[k] is not None), len(tokens) - 1)
        return 1 if len(tokens) > 2 else 0
    if isinstance(token, int) and not isinstance(token, bool):
        if not 0 <= token < len(tokens):
            raise bad_argument(
                "token", f"a token index in 0..{len(tokens) - 1}", token, "pick one of the text's tokens"
            )
        return token
    word: object = token  # checked below
    nth: object = 1
    if isinstance(token, tuple) and len(token) == 2:
        word, nth = token
    if not isinstance(word, str) or isinstance(nth, bool) or not isinstance(nth, int):
        raise bad_argument(
            "token",
            "a word of the text (str), (word, occurrence) or a token index (int)",
            describe(token),
            "pass e.g. token='bank', token=('bank', 2) or token=3",
            kind=TypeError,
        )
    found = _occurrences(pieces, word, causal=causal)
    if not found:
        shown = " ".join(tokens if len(tokens) <= 40 else list(tokens[:40]) + ["..."])
        raise bad_argument("token", "a word of the text", repr(word), f"pick one of its tokens: {shown}")
    if not 1 <= nth <= len(found):
        times = "once" if len(found) == 1 else f"{len(found)} times"
        raise bad_argument(
            "token",
            f"an occurrence 1..{len(found)} of {word!r}",
            nth,
            f"{word!r} occurs {times} in the text: pass token=({word!r}, {len(found)}) or a lower occurrence, or a "
            f"token index 0..{len(tokens) - 1}",
        )
    return found[nth - 1]


def _measured(value: float | None) -> float | None:
    """``value``, or None for a NaN (JSON and the HTML report have no NaN)."""
    return None if value is None or value != value else value


@dataclass(frozen=True)
class Inspection:
    """Every recorded head's weights on one text, with statistics and roles.

    ``tokens``: the query pieces (rows of every head's weights); ``key_tokens``: the key pieces (columns),
    equal to ``tokens`` in self-attention (left empty, it is filled with ``tokens``). ``layers``: layer indices
    of the part (rows); ``heads``: head numbers of the checkpoint (columns), which a pruned model's heads keep
    (``Encoder.head_ids``). ``weights``: (len(layers), len(heads), i, j) float32 with i = len(tokens),
    j = len(key_tokens), weights[l, h, i, j] from query piece i to key piece j; all 0 in the cell of a head
    pruned from that layer (:attr:`present` says which cells hold a head). ``stats``: statistics of this
    text; ``role_stats``: those the roles were labelled from (the corpus when one was given, else this
    text); ``corpus``: corpus statistics or None; ``token``: the index of the selected query token
    (:attr:`query`: the word it stands for).
    ``part``: the model's part ("self", "encoder", "decoder" or "cross"); ``causal``: True when query i sees
    keys 0..i only (a decoder: the weights above the diagonal are 0 because they are masked).
    ``pieces``, ``key_pieces``: the words of each axis as the tokenizer made them
    (:class:`~multihead.lab.models.Pieces`); left out, they are read from the pieces' markers.
    ``truncated_from``: the text's piece count before truncation cut it (None when it was read whole; ``text``
    is then the part analysed). ``layer_modules``: each row's module path in the model (``model.layers.3.self_attn``:
    a hybrid's attention layers are numbered 0..n-1 in order, their paths say where they are); empty when the
    weights were not taken from a model.
    """

    model_name: str
    text: str
    tokens: list[str]
    layers: list[int]
    heads: list[int]
    weights: torch.Tensor
    stats: HeadStats
    role_stats: HeadStats
    corpus: HeadStats | None
    token: int
    part: str = "self"
    key_tokens: list[str] = field(default_factory=list)
    causal: bool = False
    pieces: Pieces | None = None
    key_pieces: Pieces | None = None
    truncated_from: int | None = None
    layer_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.key_tokens:  # self-attention: the queries' pieces on both axes
            object.__setattr__(self, "key_tokens", list(self.tokens))
        # the words of each axis: as the tokenizer made them, else read from the pieces' markers
        for name, tokens, default in (
            ("pieces", self.tokens, None),
            ("key_pieces", self.key_tokens, self.pieces if self.key_tokens == self.tokens else None),
        ):
            pieces = getattr(self, name) or default or Pieces.from_markers(tokens)
            if pieces.tokens != list(tokens):
                raise bad_argument(
                    name,
                    f"the words of the {len(tokens)} pieces of {'tokens' if name == 'pieces' else 'key_tokens'}",
                    f"those of {len(pieces.tokens)} other pieces",
                    "pass the Pieces the tokenizer made for these pieces (model.part_pieces), or None to read the "
                    "words from the pieces' markers",
                )
            object.__setattr__(self, name, pieces)

    def __repr__(self) -> str:
        """One line (the weights are in ``.weights``): model, part, text, sizes, the selected token, where the
        roles come from."""
        part = "" if self.part == "self" else f", part={self.part!r}"
        return (
            f"Inspection(model={self.model_name!r}{part}, text={shorten(self.text)!r}, "
            f"{counted(len(self.tokens), 'token')}, "
            f"{counted(len(self.layers), 'layer')} x {counted(len(self.heads), 'head')}, {self._query_repr}, "
            f"roles from {self.role_stats.roles_source})"
        )

    def _repr_html_(self) -> str | None:
        """The interactive HTML report, scoped so any number sit in one notebook (None, and the notebook
        shows ``repr``, if the renderer is not loaded)."""
        return None if _html_renderer is None else _html_renderer(self)

    @property
    def similarity(self) -> HeadSimilarity | None:
        """The heads' pairwise divergence on the texts the roles come from (the corpus when one was given)."""
        return self.role_stats.similarity

    @property
    def notes(self) -> list[str]:
        """What the reports' headers say about the attention shown: the part's title unless it is a
        one-stack model's "self", :data:`CAUSAL_NOTE` for a causal part (none for a BERT-like encoder), and
        what truncation cut off."""
        lines = [] if self.part == "self" else [PART_TITLES.get(self.part, f"{self.part} attention")]
        if self.truncated_from is not None:
            kept = counted(len(self.key_tokens if self.part == "cross" else self.tokens), "token")
            lines.append(f"truncated to {kept} of {self.truncated_from}: the text shown is the part analysed")
        return lines + ([CAUSAL_NOTE] if self.causal else [])

    @property
    def words(self) -> tuple[Pieces, Pieces]:
        """The pieces of the query and of the key axis with their words (``pieces``, ``key_pieces``)."""
        assert self.pieces is not None and self.key_pieces is not None  # both set on construction
        return self.pieces, self.key_pieces

    @property
    def query(self) -> tuple[str, int, int]:
        """What the selected query token stands for (:meth:`query_of` of ``token``)."""
        return self.query_of(self.token)

    def query_of(self, index: int) -> tuple[str, int, int]:
        """What query piece ``index`` stands for: (its word as it stands in the text, the word's first piece,
        its last) when it is the word's query piece (:meth:`~multihead.lab.models.Pieces.query_piece`: its first
        piece, or in a causal part its last), else (the piece, ``index``, ``index``): a special piece, or a piece
        inside a word picked by its index. Every report names the query so: "'bank' (tokens 1-3)"."""
        pieces = self.words[0]
        word = pieces.word_ids[index]
        if word is None or pieces.query_piece(word, causal=self.causal) != index:
            return self.tokens[index], index, index
        return (pieces.words[word], *pieces.span(word))

    @property
    def _query_repr(self) -> str:
        text, first, last = self.query
        return f"token {first} {text!r}" if first == last else f"tokens {first}-{last} {text!r}"

    @property
    def query_title(self) -> str:
        """The selected query as the reports' titles name it: "'bank' (token 2)", "'bank' (tokens 1-3)"."""
        text, first, last = self.query
        return f"'{text}' (token {first})" if first == last else f"'{text}' (tokens {first}-{last})"

    @property
    def masked(self) -> torch.Tensor | None:
        """(i, j) bool: True where a causal part masks the key (a key after the query, aligned bottom-right
        when the axes differ in length); None when nothing is masked."""
        if not self.causal:
            return None
        i, j = len(self.tokens), len(self.key_tokens)
        return torch.ones(i, j, dtype=torch.bool).triu(diagonal=1 + j - i)

    @property
    def same_axes(self) -> bool:
        """True when queries and keys are the same pieces (self-attention), False for cross-attention."""
        return self.part != "cross" and self.key_tokens == self.tokens

    @property
    def present(self) -> torch.Tensor:
        """(layers, heads) bool: True where the layer has the head, False where it was pruned."""
        return self.stats.present

    @property
    def layer_heads(self) -> list[list[int]]:
        """Each recorded layer's heads (checkpoint numbers, in column order): ``heads`` unless pruned."""
        return self.stats.grid.layer_heads

    @property
    def pruned(self) -> bool:
        """True when some recorded layer lacks one of ``heads`` (a pruned model)."""
        return self.stats.layer_heads is not None

    def head_columns(
        self, columns: Mapping[str, Sequence[Sequence[float | None]] | torch.Tensor]
    ) -> dict[str, list[list[float | None]]]:
        """Per-head scores cut to the heads this inspection shows: the ``extra_columns`` of
        :func:`~multihead.lab.inspect.write_reports`.

        ``columns``: ``{name: (layers, heads)}`` nested lists or a tensor over every layer of the part and the
        checkpoint's head numbers (:func:`~multihead.lab.inspect.headreport.report_columns`,
        :meth:`~multihead.lab.inspect.SavedModelExtras.probe_columns`). Returns ``{name: (len(layers),
        len(heads))}`` nested lists, rows ``self.layers`` and columns ``self.heads``, NaN as None (an empty cell: a
        pruned head, a head a probe did not measure). A grid too small for them
        raises ValueError naming ``columns``.
        """
        shown = {}
        for name, values in columns.items():
            grid = values.tolist() if isinstance(values, torch.Tensor) else values
            if len(grid) <= max(self.layers, default=-1) or any(
                len(grid[layer]) <= max(self.heads, default=-1) for layer in self.layers
            ):
                raise bad_argument(
                    "columns",
                    f"{name!r}: a (layers, heads) grid with rows for layers {self.layers} and columns for heads "
                    f"{self.heads}",
                    f"{len(grid)} rows of {sorted({len(row) for row in grid})} columns",
                    "pass scores over every layer of the part and the checkpoint's head numbers",
                )
            # a head nobody measured (NaN: a pruned head, a probe that skipped it) is an empty cell (None)
            shown[name] = [[_measured(grid[layer][head]) for head in self.heads] for layer in self.layers]
        return shown

    def head_weights(self, layer: int, head: int) -> torch.Tensor:
        """(i, j) weights of layer ``layer``, head ``head`` (its checkpoint number); a head pruned from the
        layer raises ValueError."""
        row, col = self.stats._position(layer, head)
        return self.weights[row, col]

    def top_attended(self, layer: int, head: int, token: int | None = None, k: int = 3) -> list[tuple[str, int, float]]:
        """The ``k`` key pieces query ``token`` (default: the selected one) attends to most, among those it
        sees (a causal part's later keys are masked, never listed): (key piece, its index in ``key_tokens``,
        weight)."""
        query = self.token if token is None else token
        row = self.head_weights(layer, head)[query]  # (j,)
        if self.causal:  # the keys it sees: 0 .. query + j - i, as :attr:`masked` aligns them (never a later key)
            row = row[: max(0, min(row.numel(), query + 1 + len(self.key_tokens) - len(self.tokens)))]
        values, indices = row.topk(min(k, row.numel()))
        return [(self.key_tokens[j], j, float(w)) for w, j in zip(values.tolist(), indices.tolist(), strict=True)]

    def most_attended(self, layer: int, head: int) -> list[tuple[str, str, float]]:
        """For every query piece, the key piece it attends to most: (query piece, key piece, weight), in
        text order."""
        weights = self.head_weights(layer, head)  # (i, j)
        best, keys = weights.max(dim=-1)
        pairs = zip(best.tolist(), keys.tolist(), strict=True)
        return [(self.tokens[i], self.key_tokens[j], float(w)) for i, (w, j) in enumerate(pairs)]

    def to_dict(self) -> dict:
        """Everything measured, as plain JSON values (numbers rounded to ``DECIMALS`` places): the part and
        whether it is causal, the query and key pieces, weights, statistics, roles, each head's top keys for
        the selected token. ``inspect.json`` holds it, and the HTML page draws it.

        "token" is the selected query piece and "query" what it stands for (:attr:`query`): {"text": its word,
        "pieces": [the word's first piece, its last]}, or the piece alone (both indices ``token``).

        "part", "causal" and "key_tokens" are always there (for a BERT-like encoder: "self", false, and the
        same pieces as "tokens"). "weights" is (layers, heads, i, j) and "most_attended" (layers, heads, i),
        indices into "key_tokens". Past :data:`DENSE_WEIGHTS_LIMIT` weights in all, "weights" is their compact
        form (:func:`compact_weights`: a byte each, compressed); :func:`weights_from_dict` reads either.

        Of a pruned model, "layer_heads" lists each layer's heads, and a head pruned from a layer has empty
        lists for its weights, top_attended and most_attended, null statistics and the role "pruned".
        """
        present = self.present.tolist()

        def cells(grid: list) -> list:  # (layers, heads, ...) nested lists, the cells of pruned heads emptied
            if not self.pruned:
                return grid
            return [[value if present[r][c] else [] for c, value in enumerate(row)] for r, row in enumerate(grid)]

        data: dict = {
            "model": self.model_name,
            "text": self.text,
            "part": self.part,
            "causal": self.causal,
            "truncated_from": self.truncated_from,
            "tokens": self.tokens,
            "key_tokens": self.key_tokens,
            # the words: each piece's word (null for a special token) and each word as it stands in the text
            "word_ids": self.words[0].word_ids,
            "words": self.words[0].words,
            "key_word_ids": self.words[1].word_ids,
            "key_words": self.words[1].words,
            "layers": self.layers,
            "layer_modules": self.layer_modules,
            "heads": self.heads,
        }
        if self.pruned:
            data["layer_heads"] = self.layer_heads
        roles = self.role_stats.as_dict()
        query, first, last = self.query
        data.update(
            {
                "token": self.token,
                # what the selected query piece stands for: its word (as the text has it) and the word's pieces
                "query": {"text": query, "pieces": [first, last]},
                "weights": (
                    cells(self.weights.to(torch.float64).round(decimals=DECIMALS).tolist())
                    if self.weights.numel() <= DENSE_WEIGHTS_LIMIT
                    else compact_weights(self.weights, self.present)
                ),
                "text_stats": self.stats.as_dict(),
                "roles_from": self.role_stats.source,
                "roles": roles["roles"],
                "behaviours": roles.get("behaviours"),
                "similarity": None if self.similarity is None else self.similarity.as_dict(DECIMALS),
                "corpus_stats": None if self.corpus is None else self.corpus.as_dict(),
                "top_attended": [
                    [
                        [
                            {"token": piece, "index": index, "weight": round(weight, DECIMALS)}
                            for piece, index, weight in self.top_attended(layer, head)
                        ]
                        if present[row][col]
                        else []
                        for col, head in enumerate(self.heads)
                    ]
                    for row, layer in enumerate(self.layers)
                ],
                # for every head and query, the index of the key it attends to most: (layers, heads, i)
                "most_attended": cells(self.weights.argmax(dim=-1).tolist()),
            }
        )
        return data


def compact_weights(weights: torch.Tensor, present: torch.Tensor) -> dict:
    """(layers, heads, i, j) weights in [0, 1] and their (layers, heads) bool presence -> the compact form of
    ``to_dict()["weights"]`` (see :data:`COMPACT_WEIGHTS`)."""
    quantized = (weights.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu().contiguous()
    return {
        "encoding": COMPACT_WEIGHTS,
        "shape": list(weights.shape),
        "present": present.tolist(),  # (layers, heads) bools
        "data": base64.b64encode(zlib.compress(quantized.numpy().tobytes(), 6)).decode("ascii"),
    }


def weights_from_dict(weights: list | dict) -> torch.Tensor:
    """``to_dict()["weights"]`` (of inspect.json, or the page's data) as a (layers, heads, i, j) float32 tensor,
    whichever form it is in: nested lists (a pruned head's cell empty: zeros) or :data:`COMPACT_WEIGHTS`."""
    if isinstance(weights, dict):
        if weights.get("encoding") != COMPACT_WEIGHTS:
            raise bad_argument(
                "weights",
                f"nested lists or the encoding {COMPACT_WEIGHTS!r}",
                repr(weights.get("encoding")),
                "pass to_dict()['weights'] of this version of multihead",
            )
        raw = bytearray(zlib.decompress(base64.b64decode(weights["data"])))
        return torch.frombuffer(raw, dtype=torch.uint8).reshape(weights["shape"]).float() / 255
    rows, cols = len(weights), len(weights[0]) if weights else 0
    cells = [cell for row in weights for cell in row if cell]
    i, j = (len(cells[0]), len(cells[0][0])) if cells else (0, 0)
    dense = torch.zeros(rows, cols, i, j)
    for r, row in enumerate(weights):
        for c, cell in enumerate(row):
            if cell:
                dense[r, c] = torch.tensor(cell)
    return dense


def inspect_text(
    model: TextEncoder,
    text: str,
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    part: str | None = None,
    token: str | int | tuple[str, int] | None = None,
    corpus: Sequence[str] | None = None,
    corpus_source: str | None = None,
    truncate: bool = False,
    progress: Callable[[int], None] | None = None,
    relations: Mapping[tuple[int, int], HeadRelation] | None = None,
    behaviours: Mapping[str, torch.Tensor] | None = None,
) -> Inspection:
    """Run ``text`` through ``model`` recording the chosen heads, and measure and label them.

    Args:
        model: a :class:`multihead.lab.models.TextEncoder` with its tokenizer (``load_minilm()``, or any
            transformers checkpoint through ``multihead.integrations.transformers_models.load_model``).
        text: the text (non-empty).
        layers, heads: which heads to record (default all): layer indices of the part, and head numbers of
            the checkpoint, which a pruned model's heads keep (``Encoder.head_ids``). A head pruned from a
            chosen layer is an empty cell of the grid ("pruned"); a head no chosen layer has raises.
        part: which attention (default: the model's first part): "self" for a one-stack model, "encoder",
            "decoder" or "cross" for an encoder-decoder; a part the model lacks raises ValueError naming its
            parts. The decoder reads the text shifted right after its start token
            (:meth:`~multihead.lab.models.TextEncoder.part_tokens`).
        token: the query token to show, among the query pieces (see :func:`pick_token`).
        corpus: texts for corpus statistics (of the same part); roles are then labelled from the corpus.
        truncate: cut a text over the model's positions instead of raising.
        progress: called with texts done, over the corpus.
        relations: the syntactic relation each head tracks best, by (layer, head)
            (:func:`multihead.lab.inspect.syntax.relations_by_head` of a syntax.json, or
            ``SyntaxScores.head_relations``): weighed into the roles.
        behaviours: behaviour probe measures of the part's heads, {name: (layers, heads)} over all its layers
            and the checkpoint's head numbers ("prefix_matching", "copying", "alignment"; ``multihead train``
            saves them with its checkpoint): weighed into the roles (see :mod:`multihead.lab.inspect.roles`).

    Returns:
        :class:`Inspection` with (layers, heads, i, j) weights (0 in the cells of pruned heads; 0 above the
        diagonal of a causal part): i query pieces (``tokens``), j key pieces (``key_tokens``).
    """
    _check_text(text)
    tokenizer = text_tokenizer(model)
    grid = head_grid(model, layers, heads, part=part)  # resolves the part's sites once for the whole call
    chosen = grid.part or "self"
    causal = _causal(model, grid.part)
    batch = tokenizer.batch([text], truncate=truncate)
    queries, keys = model.part_pieces(batch, chosen)
    pieces, key_pieces = queries[0], keys[0]
    tokens, key_tokens = list(pieces.tokens), list(key_pieces.tokens)
    selected = pick_token(pieces, token, causal=causal)
    weights, stats = _recorded_text(
        model, grid, batch, pieces, key_pieces, causal=causal, max_offset=tokenizer.max_length
    )
    corpus_stats = None
    if corpus is not None:
        with items_renamed("texts", lambda index: f"corpus[{index}]"):
            corpus_stats = head_stats(
                model,
                list(corpus),
                grid=grid,
                truncate=truncate,
                source=corpus_source or f"{len(corpus)} corpus texts",
                progress=progress,
            )
    role_stats = _role_stats(corpus_stats or stats, grid, relations, behaviours)
    return Inspection(
        model_name=model.name,
        text=batch.analysed[0],
        tokens=tokens,
        layers=grid.layers,
        heads=grid.heads,
        weights=weights,
        layer_modules=[] if grid.sites is None else [grid.sites[layer].name for layer in grid.layers],
        stats=stats,
        role_stats=role_stats,
        corpus=corpus_stats,
        token=selected,
        part=chosen,
        key_tokens=key_tokens,
        causal=causal,
        pieces=pieces,
        key_pieces=key_pieces,
        truncated_from=batch.full_lengths[0] if batch.truncated[0] else None,
    )


def _check_text(text: object) -> None:
    """Refuse what :func:`inspect_text` cannot read: anything but a string (TypeError), or a blank one."""
    if not isinstance(text, str):
        raise bad_argument(
            "text", "a string", describe(text), 'pass e.g. "The bank was full of money."', kind=TypeError
        )
    if not text.strip():
        raise bad_argument("text", "a non-empty text", repr(text), 'pass e.g. "The bank was full of money."')


def _recorded_text(
    model: TextEncoder,
    grid: HeadGrid,
    batch: TokenBatch,
    pieces: Pieces,
    key_pieces: Pieces,
    *,
    causal: bool,
    max_offset: int,
) -> tuple[torch.Tensor, HeadStats]:
    """One text's ``batch`` through ``model``, the grid's heads recorded: returns their weights (layers, heads, i,
    j), 0 in the cells of pruned heads, for the i query ``pieces`` and j ``key_pieces``, and the text's statistics
    of them."""
    with evaluating(model), record_grid(model, grid) as rec:
        model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
    recorded = rec.weights()  # per layer (1, its heads, i, j); None for a layer with none of the heads
    weights = grid.pad([None if w is None else w[0].float() for w in recorded])  # (layers, heads, i, j)
    stats = weight_stats(
        [torch.zeros(1, 0, len(pieces.tokens), len(key_pieces.tokens)) if w is None else w for w in recorded],
        [pieces],
        layers=grid.layers,
        heads=grid.heads,
        layer_heads=grid.layer_heads if grid.ragged else None,
        max_offset=max_offset,
        source="this text",
        key_tokens=[key_pieces],
        causal=causal,
    )
    return weights, stats


def _role_stats(
    stats: HeadStats,
    grid: HeadGrid,
    relations: Mapping[tuple[int, int], HeadRelation] | None,
    behaviours: Mapping[str, torch.Tensor] | None,
) -> HeadStats:
    """The statistics the roles are labelled from (the corpus's, else the text's ``stats``), with the grid's heads'
    syntactic ``relations`` and ``behaviours`` weighed in when given (see :func:`inspect_text`)."""
    if relations is not None:
        stats = stats.with_relations([[relations.get((layer, head)) for head in grid.heads] for layer in grid.layers])
    if behaviours is not None:
        stats = stats.with_behaviours(_chosen_behaviours(behaviours, grid))
    return stats


def _chosen_behaviours(behaviours: Mapping[str, torch.Tensor], grid: HeadGrid) -> dict[str, torch.Tensor]:
    """Each behaviour measure {name: (layers, heads)}, over every layer of the part and the checkpoint's head
    numbers, cut to the grid's cells: {name: (chosen layers, chosen heads)}."""
    rows, cols = torch.tensor(grid.layers), torch.tensor(grid.heads)
    chosen = {}
    for name, values in behaviours.items():
        if (
            not isinstance(values, torch.Tensor)
            or values.ndim != 2
            or values.shape[0] <= max(grid.layers)
            or (values.shape[1] <= max(grid.heads))
        ):
            raise bad_argument(
                f"behaviours[{name!r}]",
                "a tensor (layers, heads) over every layer of the part and the checkpoint's head numbers",
                describe(values),
                "pass the probe measures of this model",
            )
        chosen[name] = values[rows][:, cols]  # (chosen layers, chosen heads)
    return chosen
