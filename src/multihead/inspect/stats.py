"""Per-head attention statistics over a text or a corpus, and the role each head plays.

Every statistic is an average over query tokens (padding excluded, each real token of each text
counting once), computed from the weights a (i, j) of one head on one text of n tokens:

    entropy        -sum_j a_ij log a_ij (nats): high = broad, low = focused
    norm_entropy   entropy / log n: 1 = uniform over the text
    distance       sum_j a_ij |i - j|: mean attention distance in tokens
    cls, sep       attention to [CLS], to [SEP]; special = both (the "sink" tokens, Clark et al. 2019)
    punct          attention to punctuation tokens
    prev, next, self   a_{i,i-1}, a_{i,i+1}, a_ii
    max_weight     max_j a_ij: Clark et al.'s broad heads put at most ~10% on any token
    positional     the share of word tokens whose largest weight falls on the head's most common
                   relative position, and that position (best_offset) (Voita et al. 2019)

and, per text, the pattern of Kovaleva et al. (2019) (see :func:`kovaleva_pattern`), whose shares
over the corpus are reported per head.

References:
    Voita, Talbot, Moiseev, Sennrich, Titov. Analyzing Multi-Head Self-Attention: Specialized Heads
    Do the Heavy Lifting, the Rest Can Be Pruned. ACL 2019.
    Clark, Khandelwal, Levy, Manning. What Does BERT Look At? An Analysis of BERT's Attention.
    BlackboxNLP 2019.
    Kovaleva, Romanov, Rogers, Rumshisky. Revealing the Dark Secrets of BERT. EMNLP 2019.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from multihead._errors import bad_argument, describe
from multihead.inspect.capture import capture
from multihead.models.contract import TextEncoder, evaluating, text_tokenizer

__all__ = [
    "HeadStats",
    "Role",
    "TokenInfo",
    "head_stats",
    "weight_stats",
    "token_info",
    "kovaleva_pattern",
    "label_head",
    "STAT_NAMES",
    "DECIMALS",
    "PATTERNS",
    "POSITIONAL_SHARE",
    "SINK_SHARE",
    "PUNCT_SHARE",
    "BROAD_MAX_WEIGHT",
    "BROAD_NORM_ENTROPY",
    "FOCUSED_NORM_ENTROPY",
]

DECIMALS = 6  # every number the reports write (inspect.json, the HTML page, syntax.json) is rounded to this

# Role thresholds (documented in label_head).
POSITIONAL_SHARE = 0.9  # Voita et al.: the maximum falls on one relative position for >= 90% of tokens
SINK_SHARE = 0.5  # Clark et al.: heads putting over half their attention on [CLS]/[SEP]
PUNCT_SHARE = 0.5  # Clark et al.: heads attending mostly to periods and commas
BROAD_MAX_WEIGHT = 0.1  # Clark et al.: broad heads put at most ~10% on any single token
BROAD_NORM_ENTROPY = 0.85  # ... and, for texts under 10 tokens where 10% is impossible, near-uniform rows
FOCUSED_NORM_ENTROPY = 0.3  # focused: low entropy relative to a uniform row

# Kovaleva pattern thresholds (shares of a text's attention mass; see kovaleva_pattern).
PATTERNS = ("vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous")
PATTERN_MAIN_SHARE = 0.5
PATTERN_MIXED_EACH = 0.25
PATTERN_MIXED_TOTAL = 0.6

STAT_NAMES = {
    "entropy": "entropy (nats)",
    "norm_entropy": "entropy / log n",
    "distance": "mean distance (tokens)",
    "cls": "to [CLS]",
    "sep": "to [SEP]",
    "special": "to [CLS]+[SEP]",
    "punct": "to punctuation",
    "prev": "to previous token",
    "next": "to next token",
    "self": "to same token",
    "max_weight": "max weight",
    "positional": "argmax at best offset",
    "best_offset": "best offset",
}
_AVERAGED = (
    "entropy",
    "norm_entropy",
    "distance",
    "cls",
    "sep",
    "special",
    "punct",
    "prev",
    "next",
    "self",
    "max_weight",
)
_SENTENCE_ENDS = {".", "!", "?"}


@dataclass
class TokenInfo:
    """Per-token facts the statistics need, for a padded batch of texts; all (b, n) bool unless noted."""

    real: torch.Tensor  # not padding
    cls: torch.Tensor
    sep: torch.Tensor
    punct: torch.Tensor  # punctuation word pieces
    segment: torch.Tensor  # (b, n) int64: sentence number (a new one after . ! ? or an inner [SEP])

    @property
    def special(self) -> torch.Tensor:
        return self.cls | self.sep


def token_info(tokens: Sequence[Sequence[str]], length: int) -> TokenInfo:
    """:class:`TokenInfo` for word pieces ``tokens`` (one list per text) padded to ``length``."""
    b = len(tokens)
    flags = {name: torch.zeros(b, length, dtype=torch.bool) for name in ("real", "cls", "sep", "punct")}
    segment = torch.zeros(b, length, dtype=torch.long)
    for row, pieces in enumerate(tokens):
        sentence = 0
        for col, piece in enumerate(pieces):
            flags["real"][row, col] = True
            flags["cls"][row, col] = piece == "[CLS]"
            flags["sep"][row, col] = piece == "[SEP]"
            flags["punct"][row, col] = bool(piece) and all(ch in string.punctuation for ch in piece)
            segment[row, col] = sentence
            if piece in _SENTENCE_ENDS or (piece == "[SEP]" and col < len(pieces) - 1):
                sentence += 1
    return TokenInfo(segment=segment, **flags)


def kovaleva_pattern(
    diagonal: torch.Tensor, vertical: torch.Tensor, block: torch.Tensor, segments: torch.Tensor
) -> torch.Tensor:
    """Kovaleva et al. (2019)'s attention pattern class, as an index into :data:`PATTERNS`.

    Kovaleva et al. sorted heatmaps by eye and with a classifier into five types; we use mass
    shares with fixed thresholds instead (all averaged over the text's query tokens):

    - ``diagonal`` (D): mass on the previous, same and next token (|i - j| <= 1);
    - ``vertical`` (V): mass on the text's two most attended key columns, off that band
      (typically [CLS], [SEP] and punctuation);
    - ``block`` (B): mass within the query's own sentence, off the band and those columns.

    vertical+diagonal when V >= 0.25, D >= 0.25 and V + D >= 0.6; else vertical when V >= 0.5;
    diagonal when D >= 0.5; block when the text has two or more sentences and B >= 0.5;
    otherwise heterogeneous. All arguments broadcast; ``segments`` is the sentence count.
    """
    diagonal, vertical, block, segments = torch.broadcast_tensors(diagonal, vertical, block, segments)
    pattern = torch.full(diagonal.shape, PATTERNS.index("heterogeneous"), dtype=torch.long)
    block_like = (segments >= 2) & (block >= PATTERN_MAIN_SHARE)
    pattern[block_like] = PATTERNS.index("block")
    pattern[diagonal >= PATTERN_MAIN_SHARE] = PATTERNS.index("diagonal")
    pattern[vertical >= PATTERN_MAIN_SHARE] = PATTERNS.index("vertical")
    mixed = (
        (vertical >= PATTERN_MIXED_EACH)
        & (diagonal >= PATTERN_MIXED_EACH)
        & (vertical + diagonal >= PATTERN_MIXED_TOTAL)
    )
    pattern[mixed] = PATTERNS.index("vertical+diagonal")
    return pattern


class _Accumulator:
    """Running sums of per-query statistics for one layer's recorded heads, over batches of texts."""

    def __init__(self, heads: int, max_offset: int):
        self.sums = {name: torch.zeros(heads, dtype=torch.float64) for name in _AVERAGED}
        self.queries = 0  # real query tokens seen
        self.max_offset = max_offset
        self.offset_counts = torch.zeros(heads, 2 * max_offset + 1, dtype=torch.float64)
        self.word_queries = 0  # non-special real query tokens seen (the positional statistic's base)
        self.pattern_counts = torch.zeros(heads, len(PATTERNS), dtype=torch.float64)
        self.texts = 0

    def add(self, weights: torch.Tensor, info: TokenInfo) -> None:
        """weights (b, heads, n, n) of one layer, for texts described by ``info`` (b, n)."""
        a = weights.detach().to(torch.float64)
        b, _, n, _ = a.shape
        real = info.real[:, :n]  # (b, n)
        query_real = real[:, None, :, None].to(a.dtype)  # (b, 1, n, 1): rows of padded queries count for 0
        positions = torch.arange(n)
        offset = positions[None, :] - positions[:, None]  # (n, n): j - i
        lengths = real.sum(dim=1).to(a.dtype)  # (b,)

        def to_keys(key_mask: torch.Tensor) -> torch.Tensor:  # (b, n) key flags -> (b, h, n) mass per query
            return (a * key_mask[:, None, None, :n].to(a.dtype)).sum(-1)

        per_query = {
            "entropy": -torch.special.xlogy(a, a).sum(-1),
            "distance": (a * offset.abs().to(a.dtype)).sum(-1),
            "cls": to_keys(info.cls),
            "sep": to_keys(info.sep),
            "special": to_keys(info.special),
            "punct": to_keys(info.punct & ~info.special),
            "prev": (a * (offset == -1).to(a.dtype)).sum(-1),
            "next": (a * (offset == 1).to(a.dtype)).sum(-1),
            "self": a.diagonal(dim1=-2, dim2=-1),
            "max_weight": a.amax(-1),
        }
        per_query["norm_entropy"] = per_query["entropy"] / lengths.clamp(min=2).log()[:, None, None]
        q_mask = query_real[..., 0]  # (b, 1, n)
        for name, values in per_query.items():
            self.sums[name] += (values * q_mask).sum(dim=(0, 2))
        self.queries += int(real.sum())

        # Voita et al.: where does each word token's largest weight fall, relative to the token?
        words = real & ~info.special[:, :n]  # (b, n)
        argmax_offset = a.argmax(-1) - positions  # (b, h, n)
        shifted = (argmax_offset + self.max_offset).clamp(0, 2 * self.max_offset)
        counts = torch.zeros_like(self.offset_counts).expand(b, -1, -1).clone()  # (b, h, offsets)
        counts.scatter_add_(2, shifted, words[:, None, :].expand_as(shifted).to(a.dtype))
        self.offset_counts += counts.sum(0)
        self.word_queries += int(words.sum())

        # Kovaleva et al.: one pattern per text and head.
        rows = q_mask.sum(-1).clamp(min=1)  # (b, 1) real queries per text
        band = (offset.abs() <= 1)[None, None]  # (1, 1, n, n)
        column_mass = (a * query_real).sum(2)  # (b, h, n)
        top = column_mass.topk(min(2, n), dim=-1).indices  # (b, h, 2)
        top_columns = torch.zeros_like(column_mass, dtype=torch.bool).scatter_(-1, top, True)[:, :, None, :]
        segment = info.segment[:, :n]
        same_sentence = (segment[:, :, None] == segment[:, None, :])[:, None]  # (b, 1, n, n)
        diagonal = (a * band * query_real).sum(dim=(-1, -2)) / rows
        vertical = (a * (top_columns & ~band) * query_real).sum(dim=(-1, -2)) / rows
        block = (a * (same_sentence & ~band & ~top_columns) * query_real).sum(dim=(-1, -2)) / rows
        words_segment = torch.where(words, segment, torch.full_like(segment, -1))
        sentences = torch.tensor([len(set(row[row >= 0].tolist())) for row in words_segment])[:, None]  # (b, 1)
        pattern = kovaleva_pattern(diagonal, vertical, block, sentences)  # (b, h)
        self.pattern_counts += torch.nn.functional.one_hot(pattern, len(PATTERNS)).to(a.dtype).sum(0)
        self.texts += b

    def result(self) -> dict[str, torch.Tensor]:
        values = {name: total / max(self.queries, 1) for name, total in self.sums.items()}
        best = self.offset_counts.argmax(-1)  # (heads,)
        values["positional"] = self.offset_counts.gather(-1, best[:, None])[:, 0] / max(self.word_queries, 1)
        values["best_offset"] = (best - self.max_offset).to(torch.float64)
        values["patterns"] = self.pattern_counts / max(self.texts, 1)  # (heads, len(PATTERNS))
        return values


@dataclass(frozen=True)
class Role:
    """A head's role label (<= 8 characters), its Kovaleva pattern, and a one-line reason."""

    label: str
    pattern: str
    summary: str


def label_head(stat: dict[str, float], pattern_shares: dict[str, float]) -> Role:
    """The role of a head from its statistics (one head's values of :class:`HeadStats`).

    In order, the first that applies:

    1. positional ("prev", "next", "self" or "pos+k"): the largest weight falls on one relative
       position for at least ``POSITIONAL_SHARE`` = 90% of word tokens (Voita et al. 2019, who
       found such heads attending to the previous or next token);
    2. "[SEP]" / "[CLS]": at least ``SINK_SHARE`` = 50% of attention on [CLS] and [SEP] (Clark et
       al. 2019: many BERT heads park over half their attention on [SEP] when they have nothing
       to do), named after the larger of the two;
    3. "punct": at least ``PUNCT_SHARE`` = 50% on punctuation (Clark et al.'s period/comma heads);
    4. "broad": the average largest weight is at most ``BROAD_MAX_WEIGHT`` = 10% (Clark et al.'s
       broad heads), or, since short texts cannot go under 10%, the average normalised entropy
       is at least ``BROAD_NORM_ENTROPY`` = 0.85;
    5. "focused": average normalised entropy at most ``FOCUSED_NORM_ENTROPY`` = 0.3 (most of each
       row's mass on one or two tokens that are not a fixed offset or a sink);
    6. "mixed": none of these.

    The pattern is the most frequent Kovaleva et al. (2019) pattern over the texts.
    """
    pattern = max(pattern_shares, key=pattern_shares.__getitem__)
    share = pattern_shares[pattern]
    pattern_note = f"{pattern} in {share:.0%} of texts"
    offset = int(stat["best_offset"])
    if stat["positional"] >= POSITIONAL_SHARE:
        label = {-1: "prev", 0: "self", 1: "next"}.get(offset, f"pos{offset:+d}")
        return Role(
            label, pattern, f"max weight at offset {offset:+d} for {stat['positional']:.0%} of tokens; " + pattern_note
        )
    if stat["special"] >= SINK_SHARE:
        label = "[SEP]" if stat["sep"] >= stat["cls"] else "[CLS]"
        return Role(
            label,
            pattern,
            f"{stat['special']:.0%} of attention on [CLS]/[SEP] ({stat['sep']:.0%} [SEP]); " + pattern_note,
        )
    if stat["punct"] >= PUNCT_SHARE:
        return Role("punct", pattern, f"{stat['punct']:.0%} of attention on punctuation; " + pattern_note)
    if stat["max_weight"] <= BROAD_MAX_WEIGHT or stat["norm_entropy"] >= BROAD_NORM_ENTROPY:
        return Role(
            "broad",
            pattern,
            f"largest weight {stat['max_weight']:.0%} on average, entropy "
            f"{stat['norm_entropy']:.2f} of uniform; " + pattern_note,
        )
    if stat["norm_entropy"] <= FOCUSED_NORM_ENTROPY:
        return Role(
            "focused",
            pattern,
            f"entropy {stat['norm_entropy']:.2f} of uniform, largest weight {stat['max_weight']:.0%}; " + pattern_note,
        )
    return Role(
        "mixed",
        pattern,
        f"entropy {stat['norm_entropy']:.2f} of uniform, distance {stat['distance']:.1f} tokens; " + pattern_note,
    )


@dataclass
class HeadStats:
    """Statistics of every recorded head: ``values[name]`` is (layers, heads) float64.

    ``layers``/``heads`` are the model indices the rows and columns stand for; ``patterns`` is
    (layers, heads, len(PATTERNS)), the share of texts in each Kovaleva pattern.
    """

    layers: list[int]
    heads: list[int]
    values: dict[str, torch.Tensor]
    patterns: torch.Tensor
    texts: int
    tokens: int
    source: str = "texts"
    _roles: list[list[Role]] | None = field(default=None, repr=False)

    def stat(self, layer: int, head: int) -> dict[str, float]:
        """One head's statistics by model layer and head index."""
        row, col = self._position(layer, head)
        return {name: float(values[row, col]) for name, values in self.values.items()}

    def _position(self, layer: int, head: int) -> tuple[int, int]:
        if layer not in self.layers:
            raise bad_argument("layer", f"one of {self.layers}", layer, "pick a layer the statistics cover")
        if head not in self.heads:
            raise bad_argument("head", f"one of {self.heads}", head, "pick a head the statistics cover")
        return self.layers.index(layer), self.heads.index(head)

    def roles(self) -> list[list[Role]]:
        """:func:`label_head` for every head: roles[row][col] for layers[row], heads[col]."""
        if self._roles is None:
            self._roles = [
                [
                    label_head(
                        self.stat(layer, head), dict(zip(PATTERNS, self.patterns[row, col].tolist(), strict=True))
                    )
                    for col, head in enumerate(self.heads)
                ]
                for row, layer in enumerate(self.layers)
            ]
        return self._roles

    def as_dict(self) -> dict:
        """Plain lists for JSON: per-head statistics, pattern shares and roles."""
        roles = self.roles()
        return {
            "source": self.source,
            "texts": self.texts,
            "tokens": self.tokens,
            "layers": self.layers,
            "heads": self.heads,
            "stats": [
                [
                    {name: round(value, DECIMALS) for name, value in self.stat(layer, head).items()}
                    for head in self.heads
                ]
                for layer in self.layers
            ],
            "patterns": [
                [
                    dict(zip(PATTERNS, [round(x, DECIMALS) for x in self.patterns[row, col].tolist()], strict=True))
                    for col in range(len(self.heads))
                ]
                for row in range(len(self.layers))
            ],
            "roles": [[{"label": r.label, "pattern": r.pattern, "summary": r.summary} for r in row] for row in roles],
        }


def head_stats(
    model: TextEncoder,
    texts: str | Sequence[str],
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    batch_size: int = 16,
    truncate: bool = False,
    source: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> HeadStats:
    """Per-head statistics of an encoder over one text or a corpus (padding masked out).

    Args:
        model: a :class:`multihead.models.Encoder` with its tokenizer (``load_minilm()``).
        texts: a string or a list of strings.
        layers, heads: which to measure (default all).
        batch_size: texts per forward pass.
        truncate: cut texts over the model's positions instead of raising.
        source: a description stored with the result (default: "N texts").
        progress: called with the number of texts done after each batch (a progress bar's update).

    Returns:
        :class:`HeadStats` with (layers, heads) tensors; ``.roles()`` labels each head.

    Example:
        >>> model, _ = multihead.models.load_minilm()
        >>> stats = multihead.inspect.head_stats(model, ["The bank was full of money.", "It rained."])
        >>> stats.values["entropy"].shape                      # (layers, heads)
        torch.Size([6, 12])
    """
    batch_texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(batch_texts, (list, tuple)) or not all(isinstance(t, str) for t in batch_texts):
        raise bad_argument(
            "texts",
            "a string or a list of strings",
            describe(texts),
            "pass e.g. ['first text', 'second text']",
            kind=TypeError,
        )
    batch_texts = [t for t in batch_texts if t.strip()]
    if not batch_texts:
        raise bad_argument("texts", "at least one non-empty text", "none", "pass text with words in it")
    tokenizer = text_tokenizer(model)
    accumulators: dict[int, _Accumulator] = {}
    tokens_seen = 0
    with evaluating(model), capture(model, layers=layers, heads=heads) as rec:
        for start in range(0, len(batch_texts), batch_size):
            batch = tokenizer.batch(list(batch_texts[start : start + batch_size]), truncate=truncate)
            model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
            info = token_info(batch.tokens, batch.input_ids.shape[1])
            for layer in rec.layers:
                if layer not in accumulators:
                    accumulators[layer] = _Accumulator(len(rec.heads(layer)), tokenizer.max_length)
                accumulators[layer].add(rec.weights(layer), info)
            tokens_seen += int(batch.attention_mask.sum())
            rec.clear()
            if progress is not None:
                progress(min(start + batch_size, len(batch_texts)))
        recorded_heads = rec.heads(rec.layers[0])
        recorded_layers = rec.layers
    return _finish(
        accumulators,
        recorded_layers,
        recorded_heads,
        texts=len(batch_texts),
        tokens=tokens_seen,
        source=source or f"{len(batch_texts)} text{'s' if len(batch_texts) != 1 else ''}",
    )


def weight_stats(
    weights: Sequence[torch.Tensor],
    tokens: Sequence[Sequence[str]],
    *,
    layers: Sequence[int],
    heads: Sequence[int],
    max_offset: int = 512,
    source: str = "this text",
) -> HeadStats:
    """:class:`HeadStats` of weights already recorded, without running the model again.

    ``weights[k]``: (b, len(heads), n, n) of model layer ``layers[k]``, for texts whose word pieces
    are ``tokens`` (one list per text, padded to n in the weights).
    """
    n = weights[0].shape[-1]
    info = token_info(tokens, n)
    accumulators = {}
    for layer, layer_weights in zip(layers, weights, strict=True):
        accumulators[layer] = _Accumulator(len(heads), max_offset)
        accumulators[layer].add(layer_weights, info)
    return _finish(
        accumulators,
        list(layers),
        list(heads),
        texts=len(tokens),
        tokens=sum(len(pieces) for pieces in tokens),
        source=source,
    )


def _finish(
    accumulators: dict[int, _Accumulator], layers: list[int], heads: list[int], *, texts: int, tokens: int, source: str
) -> HeadStats:
    results = [accumulators[layer].result() for layer in layers]
    values = {name: torch.stack([r[name] for r in results]) for name in results[0] if name != "patterns"}
    patterns = torch.stack([r["patterns"] for r in results])
    return HeadStats(layers, heads, values, patterns, texts=texts, tokens=tokens, source=source)
