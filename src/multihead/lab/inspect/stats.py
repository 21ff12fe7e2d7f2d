"""Per-head attention statistics over a text or a corpus, and the role each head plays.

Every statistic is an average over query tokens (padding excluded, each real token of each text
counting once), computed from the weights a (i, j) of one head on one text, from query i to key j:

    entropy        -sum_j a_ij log a_ij (nats): high = broad, low = focused
    norm_entropy   entropy / log n, n the keys the query may see: 1 = uniform over them
    distance       sum_j a_ij |i - j|: mean attention distance in positions
    cls, sep       attention to [CLS], to [SEP]; special = both (the "sink" tokens, Clark et al. 2019)
    punct          attention to punctuation tokens
    prev, next, self   a_{i,i-1}, a_{i,i+1}, a_ii
    max_weight     max_j a_ij: Clark et al.'s broad heads put at most ~10% on any token
    learned_sink   1 - sum_j a_ij: the weight on the layer's learned sink (gpt-oss), which its keys leave; 0 in
                   a layer without one
    positional     the share of word tokens whose largest weight falls on the head's most common
                   relative position, and that position (best_offset) (Voita et al. 2019)
    rare           the share of word tokens (outside the rarest word) whose largest weight falls on the
                   text's rarest word, by ``wordfreq``'s frequencies (Voita et al.'s rare-word heads;
                   see :func:`~multihead.lab.inspect.roles.rarest_word_pieces`)

and, per text, the pattern of Kovaleva et al. (2019) (see :func:`kovaleva_pattern`), whose shares
over the corpus are reported per head.

A model's attention is grouped in parts (:func:`~multihead.capture.attention_sites`): "self" in a
one-stack model, "encoder", "decoder" and "cross" in an encoder-decoder; every reader here takes ``part``
(default: the model's first). The queries and keys of a part are the pieces
:meth:`~multihead.lab.models.TextEncoder.part_tokens` names. Self-attention has the same pieces on both axes.
Cross-attention goes from the decoder's input (i) to the source text (j), which may differ in length;
every statistic stays defined:

- positions are counted on each axis from 0, so ``|i - j|``, prev (j = i - 1), self (j = i) and next
  (j = i + 1) name the source positions around the query's own: on a copy or alignment task the diagonal is
  the alignment (with BART's decoder input, the text shifted right after its start token, the source piece
  at i - 1 is the query's own piece, so an aligning head reads "prev");
- [CLS], [SEP] and punctuation are those of the KEY pieces (the source), n is the source's length;
- the positional statistic counts the query's word pieces (not [CLS]/[SEP]);
- Kovaleva's D is the mass on the alignment band ``|i - j| <= 1``, V the mass on the two most attended
  source columns, B the mass on the source sentence with the query's sentence number.

A causal part (:func:`is_causal_part`: a decoder-only model, or an encoder-decoder's "decoder") lets query i
see keys 0..i only: its norm_entropy divides each query's entropy by the log of the keys it may see
(i + 1; at least 2), so a head spreading evenly over what it can see scores 1.

References:
    Voita, Talbot, Moiseev, Sennrich, Titov. Analyzing Multi-Head Self-Attention: Specialized Heads
    Do the Heavy Lifting, the Rest Can Be Pruned. ACL 2019.
    Clark, Khandelwal, Levy, Manning. What Does BERT Look At? An Analysis of BERT's Attention.
    BlackboxNLP 2019.
    Kovaleva, Romanov, Rogers, Rumshisky. Revealing the Dark Secrets of BERT. EMNLP 2019.
"""

from __future__ import annotations

import dataclasses
import functools
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from multihead._errors import bad_argument, describe, items_renamed
from multihead.lab._words import counted
from multihead.lab.inspect.notebook import head_grid_html

# the heads an inspection covers and their recording (stats re-exports them)
from multihead.lab.inspect.recording import (
    GridRecorder,
    HeadGrid,
    _causal,
    head_grid,
    head_numbers,
    is_causal_part,
    record_grid,
)
from multihead.lab.inspect.roles import BEHAVIOUR_STATISTICS, HeadRelation, Role, label_head, rarest_word_pieces
from multihead.lab.inspect.similarity import DivergenceAccumulator, HeadSimilarity
from multihead.lab.models.contract import TextEncoder, evaluating, text_tokenizer
from multihead.lab.models.tokenizer import Pieces

__all__ = [
    "HeadGrid",
    "head_grid",
    "head_numbers",
    "record_grid",
    "GridRecorder",
    "HeadStats",
    "is_causal_part",
    "Role",
    "PRUNED",
    "TokenInfo",
    "head_stats",
    "weight_stats",
    "token_info",
    "kovaleva_pattern",
    "label_head",
    "STAT_NAMES",
    "DECIMALS",
    "PATTERNS",
]

DECIMALS = 6  # every number the reports write (inspect.json, the HTML page, syntax.json) is rounded to this

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
    "learned_sink": "to its learned sink",
    "positional": "argmax at best offset",
    "best_offset": "best offset",
    "rare": "argmax on rarest word",
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
    "learned_sink",
)
_SENTENCE_ENDS = {".", "!", "?"}
PRUNED = "pruned"  # the role label (and pattern) of a head a layer no longer has


@dataclass
class TokenInfo:
    """Per-token facts the statistics need, for a padded batch of texts; all (b, n) bool unless noted."""

    real: torch.Tensor  # not padding
    cls: torch.Tensor
    sep: torch.Tensor
    punct: torch.Tensor  # punctuation word pieces
    rare: torch.Tensor  # pieces of the text's rarest word (roles.rarest_word_pieces)
    segment: torch.Tensor  # (b, n) int64: sentence number (a new one after . ! ? or an inner [SEP])

    @property
    def special(self) -> torch.Tensor:
        return self.cls | self.sep


def token_info(tokens: Sequence[Pieces | Sequence[str]], length: int) -> TokenInfo:
    """:class:`TokenInfo` for word pieces ``tokens`` (one :class:`~multihead.lab.models.Pieces`, or one list of
    pieces, per text) padded to ``length``."""
    b = len(tokens)
    flags = {name: torch.zeros(b, length, dtype=torch.bool) for name in ("real", "cls", "sep", "punct", "rare")}
    segment = torch.zeros(b, length, dtype=torch.long)
    for row, text in enumerate(tokens):
        sentence = 0
        pieces = Pieces.of(text).tokens
        flags["rare"][row, : len(pieces)] = torch.tensor(rarest_word_pieces(text), dtype=torch.bool)
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
    """Running sums of per-query statistics for one layer's recorded heads, over batches of texts.

    Relative positions j - i are counted in ``offset_counts`` over -span..span, grown to the longest text
    seen (at most ``max_offset``; an offset beyond it counts at the edge), so no table has the model's
    position limit as its width.
    """

    def __init__(self, heads: int, max_offset: int):
        self.sums = {name: torch.zeros(heads, dtype=torch.float64) for name in _AVERAGED}
        self.queries = 0  # real query tokens seen
        self.max_offset = max_offset
        self.offset_counts = torch.zeros(heads, 1, dtype=torch.float64)  # (heads, 2 * span + 1): offsets -span..span
        self.word_queries = 0  # non-special real query tokens seen (the positional statistic's base)
        self.rare_hits = torch.zeros(heads, dtype=torch.float64)  # word queries whose argmax is on the rarest word
        self.rare_queries = 0  # word queries outside the rarest word, in texts that have one
        self.pattern_counts = torch.zeros(heads, len(PATTERNS), dtype=torch.float64)
        self.texts = 0

    @property
    def span(self) -> int:
        return (self.offset_counts.shape[1] - 1) // 2

    def _cover(self, span: int) -> None:
        """Widen ``offset_counts`` to offsets -span..span (at most max_offset), keeping the counts."""
        span = min(span, self.max_offset)
        grow = span - self.span
        if grow > 0:
            self.offset_counts = torch.nn.functional.pad(self.offset_counts, (grow, grow))

    def add(
        self, weights: torch.Tensor, info: TokenInfo, keys: TokenInfo | None = None, *, causal: bool = False
    ) -> None:
        """weights (b, heads, i, j) of one layer, from the query pieces ``info`` describes (b, i) to the key
        pieces ``keys`` describes (b, j; default ``info``: self-attention). ``causal``: query i may see keys
        0..i only (bottom-right aligned when the lengths differ); only the normalised entropy uses it."""
        keys = info if keys is None else keys
        a = weights.detach().to(torch.float64)
        b, _, nq, nk = a.shape
        real = info.real[:, :nq]  # (b, i)
        key_real = keys.real[:, :nk]  # (b, j)
        query_real = real[:, None, :, None].to(a.dtype)  # (b, 1, i, 1): rows of padded queries count for 0
        positions = torch.arange(nq)
        offset = torch.arange(nk)[None, :] - positions[:, None]  # (i, j): j - i
        key_lengths = key_real.sum(dim=1).to(a.dtype)  # (b,)

        def to_keys(key_mask: torch.Tensor) -> torch.Tensor:  # (b, j) key flags -> (b, h, i) mass per query
            return (a * key_mask[:, None, None, :nk].to(a.dtype)).sum(-1)

        def at_offset(k: int) -> torch.Tensor:  # (b, h, i): the weight on key i + k (0 where there is none)
            return (a * (offset == k).to(a.dtype)).sum(-1)

        per_query = {
            "entropy": -torch.special.xlogy(a, a).sum(-1),
            "distance": (a * offset.abs().to(a.dtype)).sum(-1),
            "cls": to_keys(keys.cls),
            "sep": to_keys(keys.sep),
            "special": to_keys(keys.special),
            "punct": to_keys(keys.punct & ~keys.special),
            "prev": at_offset(-1),
            "next": at_offset(1),
            "self": at_offset(0),
            "max_weight": a.amax(-1),
            "learned_sink": (1.0 - a.sum(-1)).clamp_min(0.0),  # the weights are those applied, over the keys
        }
        if causal:  # query i sees keys 0 .. i + (keys - queries) of its text
            query_lengths = real.sum(dim=1).to(a.dtype)  # (b,)
            seen = positions[None, :].to(a.dtype) + 1 + (key_lengths - query_lengths)[:, None]  # (b, i)
            visible = torch.minimum(seen, key_lengths[:, None])[:, None, :]  # (b, 1, i)
        else:
            visible = key_lengths[:, None, None]  # (b, 1, 1)
        per_query["norm_entropy"] = per_query["entropy"] / visible.clamp(min=2).log()
        q_mask = query_real[..., 0]  # (b, 1, i)
        for name, values in per_query.items():
            self.sums[name] += (values * q_mask).sum(dim=(0, 2))
        self.queries += int(real.sum())

        # Voita et al.: where does each word token's largest weight fall, relative to the token?
        words = real & ~info.special[:, :nq]  # (b, i)
        self._cover(max(nq, nk) - 1)
        span = self.span
        argmax_offset = a.argmax(-1) - positions  # (b, h, i)
        shifted = (argmax_offset + span).clamp(0, 2 * span)
        counts = torch.zeros_like(self.offset_counts).expand(b, -1, -1).clone()  # (b, h, offsets)
        counts.scatter_add_(2, shifted, words[:, None, :].expand_as(shifted).to(a.dtype))
        self.offset_counts += counts.sum(0)
        self.word_queries += int(words.sum())

        # Voita et al.'s rare-word heads: the largest weight on the text's rarest word (its own pieces excepted).
        key_rare = keys.rare[:, :nk]  # (b, j)
        asking = words & ~info.rare[:, :nq] & key_rare.any(dim=1, keepdim=True)  # (b, i)
        on_rare = key_rare.gather(1, a.argmax(-1).flatten(1)).view(b, -1, nq)  # (b, h, i)
        self.rare_hits += (on_rare & asking[:, None, :]).sum(dim=(0, 2)).to(a.dtype)
        self.rare_queries += int(asking.sum())

        # Kovaleva et al.: one pattern per text and head.
        rows = q_mask.sum(-1).clamp(min=1)  # (b, 1) real queries per text
        band = (offset.abs() <= 1)[None, None]  # (1, 1, i, j): the diagonal (the alignment, in cross-attention)
        column_mass = (a * query_real).sum(2)  # (b, h, j)
        top = column_mass.topk(min(2, nk), dim=-1).indices  # (b, h, 2)
        top_columns = torch.zeros_like(column_mass, dtype=torch.bool).scatter_(-1, top, True)[:, :, None, :]
        segment = info.segment[:, :nq]  # (b, i) the query's sentence number
        same_sentence = (segment[:, :, None] == keys.segment[:, None, :nk])[:, None]  # (b, 1, i, j)
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
        best = self.offset_counts.argmax(-1)  # (heads,): the most negative offset among ties
        values["positional"] = self.offset_counts.gather(-1, best[:, None])[:, 0] / max(self.word_queries, 1)
        values["best_offset"] = (best - self.span).to(torch.float64)
        if not self.word_queries:  # no word token (only [CLS]/[SEP]): no offset is anyone's best
            values["best_offset"].zero_()
        values["rare"] = self.rare_hits / max(self.rare_queries, 1)
        values["patterns"] = self.pattern_counts / max(self.texts, 1)  # (heads, len(PATTERNS))
        return values


@dataclass
class HeadStats:
    """Statistics of every recorded head: ``values[name]`` is (layers, heads) float64.

    ``layers``/``heads`` are the model layer indices and checkpoint head numbers the rows and columns
    stand for (see :class:`HeadGrid`); ``patterns`` is (layers, heads, len(PATTERNS)), the share of texts
    in each Kovaleva pattern. ``layer_heads``: each row's heads when some layer lacks a column (a pruned
    model; its cells hold NaN and its role is "pruned"), None when every layer has every column.
    ``relations``: per head, the syntactic relation it tracks best (from syntax scores; see
    :meth:`with_relations`), folded into its role; None when no syntax scores were given.
    ``similarity``: the heads' pairwise Jensen-Shannon divergence over the same texts
    (:class:`~multihead.lab.inspect.similarity.HeadSimilarity`).
    ``behaviours``: per-head measures from behaviour probes run on the model, not on these texts
    ({name in :data:`~multihead.lab.inspect.roles.BEHAVIOUR_STATISTICS`: (layers, heads)}, see
    :meth:`with_behaviours`), folded into the roles; None when none were given.
    """

    layers: list[int]
    heads: list[int]
    values: dict[str, torch.Tensor]
    patterns: torch.Tensor
    texts: int
    tokens: int
    source: str = "texts"
    layer_heads: list[list[int]] | None = None
    relations: list[list[HeadRelation | None]] | None = None
    similarity: HeadSimilarity | None = field(default=None, repr=False)
    behaviours: dict[str, torch.Tensor] | None = None
    _roles: list[list[Role]] | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        """One line: the grid, the texts, how many heads carry each role label, the near-duplicate pairs."""
        counts: dict[str, int] = {}
        for row in self.roles():
            for role in row:
                counts[role.label] = counts.get(role.label, 0) + 1
        labels = ", ".join(f"{label} {count}" for label, count in sorted(counts.items(), key=lambda kv: -kv[1]))
        count = 0 if self.similarity is None else len(self.similarity.near_duplicates())
        pairs = "" if self.similarity is None else f"; {count} near-duplicate pair{'' if count == 1 else 's'}"
        return (
            f"HeadStats({counted(len(self.layers), 'layer')} x {counted(len(self.heads), 'head')} on {self.source} "
            f"({counted(self.tokens, 'token')}); roles: {labels}{pairs})"
        )

    def _repr_html_(self) -> str:
        """A notebook's view: every head's role text (e.g. "[CLS] 61% · next 22%"), shaded by its strength."""
        roles = self.roles()
        return head_grid_html(
            f"Head roles on {self.source} ({self.tokens} tokens)",
            self.layers,
            self.heads,
            lambda row, col: None if roles[row][col].label == PRUNED else f"{roles[row][col].text}",
            lambda row, col: roles[row][col].strength,
            note="label: the strongest signal (multihead.lab.inspect.roles); shading: its strength",
        )

    def with_relations(self, relations: list[list[HeadRelation | None]] | None) -> HeadStats:
        """A copy whose roles weigh each head's syntactic relation (``relations[row][col]``, over these
        layers and heads; from :func:`multihead.lab.inspect.syntax.head_relations`) with its other signals."""
        if relations is not None and (
            len(relations) != len(self.layers) or any(len(row) != len(self.heads) for row in relations)
        ):
            raise bad_argument(
                "relations",
                f"{len(self.layers)} rows of {len(self.heads)} heads (the statistics' grid)",
                f"{len(relations)} rows",
                "pass the relations of the same layers and heads",
            )
        return dataclasses.replace(self, relations=relations, _roles=None)

    def with_behaviours(self, behaviours: dict[str, torch.Tensor] | None) -> HeadStats:
        """A copy whose roles weigh behaviour probes: ``behaviours[name]`` is (layers, heads) over these layers
        and heads (NaN: not measured), for names in :data:`~multihead.lab.inspect.roles.BEHAVIOUR_STATISTICS`
        ("prefix_matching", "copying", "alignment"; see :mod:`multihead.lab.inspect.roles`)."""
        checked = None
        if behaviours is not None:
            checked = {}
            for name, values in behaviours.items():
                if name not in BEHAVIOUR_STATISTICS:
                    raise bad_argument(
                        "behaviours",
                        f"measures named {', '.join(BEHAVIOUR_STATISTICS)}",
                        repr(name),
                        "pass the probe measures by those names",
                    )
                if not isinstance(values, torch.Tensor) or tuple(values.shape) != (len(self.layers), len(self.heads)):
                    raise bad_argument(
                        f"behaviours[{name!r}]",
                        f"a tensor ({len(self.layers)}, {len(self.heads)}) over the statistics' layers and heads",
                        describe(values),
                        "pass the rows and columns of the same layers and heads",
                    )
                checked[name] = values.detach().double().cpu()
        return dataclasses.replace(self, behaviours=checked, _roles=None)

    @property
    def roles_source(self) -> str:
        """What the roles were labelled from: ``source``, and the behaviour probes when they were given."""
        return self.source + (" and the model's behaviour probes" if self.behaviours else "")

    def _behaviour(self, row: int, col: int) -> dict[str, float]:
        """One head's behaviour measures (none when not given)."""
        if self.behaviours is None:
            return {}
        return {name: float(values[row, col]) for name, values in self.behaviours.items()}

    @property
    def grid(self) -> HeadGrid:
        """The rows, columns and each row's heads, as a :class:`HeadGrid`."""
        kept = self.layer_heads or [list(self.heads) for _ in self.layers]
        return HeadGrid(list(self.layers), list(self.heads), [list(row) for row in kept])

    @property
    def present(self) -> torch.Tensor:
        """(layers, heads) bool: False in the cells of pruned heads."""
        return self.grid.present

    def stat(self, layer: int, head: int) -> dict[str, float]:
        """One head's statistics by model layer and checkpoint head number."""
        row, col = self._position(layer, head)
        return {name: float(values[row, col]) for name, values in self.values.items()}

    def _position(self, layer: int, head: int) -> tuple[int, int]:
        if layer not in self.layers:
            raise bad_argument("layer", f"one of {self.layers}", layer, "pick a layer the statistics cover")
        if head not in self.heads:
            raise bad_argument("head", f"one of {self.heads}", head, "pick a head the statistics cover")
        row = self.layers.index(layer)
        if self.layer_heads is not None and head not in self.layer_heads[row]:
            raise bad_argument(
                "head",
                f"one of layer {layer}'s heads {self.layer_heads[row]}",
                f"{head}, which was pruned from layer {layer}",
                f"pick a head that layer {layer} still has",
            )
        return row, self.heads.index(head)

    def roles(self) -> list[list[Role]]:
        """:func:`label_head` for every head: roles[row][col] for layers[row], heads[col] (a pruned head's
        label and pattern are "pruned")."""
        if self._roles is None:
            present = self.present.tolist()
            self._roles = [
                [
                    label_head(
                        self.stat(layer, head) | self._behaviour(row, col),
                        dict(zip(PATTERNS, self.patterns[row, col].tolist(), strict=True)),
                        None if self.relations is None else self.relations[row][col],
                    )
                    if present[row][col]
                    else Role(PRUNED, PRUNED, f"head {head} was pruned from layer {layer}")
                    for col, head in enumerate(self.heads)
                ]
                for row, layer in enumerate(self.layers)
            ]
        return self._roles

    def as_dict(self) -> dict:
        """Plain lists for JSON: per-head statistics, pattern shares and roles. A pruned head's statistics
        and patterns are null, and "layer_heads" (each layer's heads) is there only when a layer lacks one
        of ``heads``."""
        roles = self.roles()
        present = self.present.tolist()
        data: dict = {
            "source": self.source,
            "texts": self.texts,
            "tokens": self.tokens,
            "layers": self.layers,
            "heads": self.heads,
        }
        if self.layer_heads is not None:
            data["layer_heads"] = self.layer_heads
        data["stats"] = [
            [
                {name: round(value, DECIMALS) for name, value in self.stat(layer, head).items()}
                if present[row][col]
                else None
                for col, head in enumerate(self.heads)
            ]
            for row, layer in enumerate(self.layers)
        ]
        data["patterns"] = [
            [
                dict(zip(PATTERNS, [round(x, DECIMALS) for x in self.patterns[row, col].tolist()], strict=True))
                if present[row][col]
                else None
                for col in range(len(self.heads))
            ]
            for row in range(len(self.layers))
        ]
        if self.behaviours is not None:
            data["behaviours"] = {
                name: [[None if v != v else round(v, DECIMALS) for v in row] for row in values.tolist()]
                for name, values in self.behaviours.items()
            }
        data["roles"] = [[role.as_dict() for role in row] for row in roles]
        return data


def head_stats(
    model: TextEncoder,
    texts: str | Sequence[str],
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    part: str | None = None,
    batch_size: int = 16,
    truncate: bool = False,
    source: str | None = None,
    progress: Callable[[int], None] | None = None,
    grid: HeadGrid | None = None,
) -> HeadStats:
    """Per-head statistics of a text model over one text or a corpus (padding masked out).

    Args:
        model: a :class:`multihead.lab.models.TextEncoder` with its tokenizer (``load_minilm()``, or a
            transformers checkpoint through ``multihead.integrations.transformers_models.load_model``).
        texts: a string or a list of strings.
        layers, heads: which to measure (default all): layer indices of the part, and head numbers of the
            checkpoint (a pruned model's heads keep theirs, see :class:`HeadGrid`; a head pruned from a
            layer is left empty there: NaN, role "pruned").
        part: which attention (default: the model's first part): "self", or "encoder", "decoder" or
            "cross" of an encoder-decoder. Queries and keys are the pieces ``model.part_tokens`` names; see
            the module docstring for what each statistic means on cross-attention and on a causal part.
        batch_size: texts per forward pass.
        truncate: cut texts over the model's positions instead of raising.
        source: a description stored with the result (default: "N texts").
        progress: called with the number of texts done after each batch (a progress bar's update).
        grid: the layers and heads as :func:`head_grid` chose them from this model, in place of ``layers``,
            ``heads`` and ``part`` (a caller that has one saves walking the model again).

    Returns:
        :class:`HeadStats` with (layers, heads) tensors; ``.roles()`` labels each head.

    Example:
        >>> model, _ = multihead.lab.models.load_minilm()
        >>> stats = multihead.lab.inspect.head_stats(model, ["The bank was full of money.", "It rained."])
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
    numbers = [index for index, text in enumerate(batch_texts) if text.strip()]  # the caller's, for errors
    batch_texts = [batch_texts[index] for index in numbers]
    if not batch_texts:
        raise bad_argument("texts", "at least one non-empty text", "none", "pass text with words in it")
    tokenizer = text_tokenizer(model)
    if grid is None:
        grid = head_grid(model, layers, heads, part=part)  # resolves the part's sites once for the whole call
    elif grid.sites is None or grid.positions is None:
        raise bad_argument(
            "grid", "a HeadGrid of this model (head_grid(model, ...))", "one without sites", "use head_grid"
        )
    part, causal = grid.part or "self", _causal(model, grid.part)
    accumulators = {
        row: _Accumulator(len(kept), tokenizer.max_length) for row, kept in enumerate(grid.layer_heads) if kept
    }
    tokens_seen = 0
    divergence = DivergenceAccumulator(sum(len(kept) for kept in grid.layer_heads))
    with evaluating(model), record_grid(model, grid) as rec:
        for start in range(0, len(batch_texts), batch_size):
            with items_renamed("texts", functools.partial(_callers_name, numbers, start), single="text"):
                batch = tokenizer.batch(list(batch_texts[start : start + batch_size]), truncate=truncate)
            model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
            queries, keys = model.part_pieces(batch, part)
            recorded = rec.weights()
            nq, nk = next(w for w in recorded if w is not None).shape[-2:]
            query_info, key_info = token_info(queries, nq), token_info(keys, nk)
            for row, weights in enumerate(recorded):
                if weights is not None:
                    accumulators[row].add(weights, query_info, key_info, causal=causal)
            divergence.add(
                torch.cat([w for w in recorded if w is not None], dim=1), query_info.real[:, :nq], key_info.real[:, :nk]
            )
            tokens_seen += sum(len(text.tokens) for text in queries)
            rec.clear()
            if progress is not None:
                progress(min(start + batch_size, len(batch_texts)))
    return _finish(
        accumulators,
        divergence,
        grid,
        texts=len(batch_texts),
        tokens=tokens_seen,
        source=source or f"{len(batch_texts)} text{'s' if len(batch_texts) != 1 else ''}",
    )


def _callers_name(numbers: Sequence[int], start: int, index: int) -> str:
    """Text ``index`` of the batch from ``start``, as the caller numbered it (``numbers``: each kept text's)."""
    return f"texts[{numbers[start + index]}]"


def weight_stats(
    weights: Sequence[torch.Tensor],
    tokens: Sequence[Pieces | Sequence[str]],
    *,
    layers: Sequence[int],
    heads: Sequence[int],
    layer_heads: Sequence[Sequence[int]] | None = None,
    max_offset: int = 512,
    source: str = "this text",
    key_tokens: Sequence[Pieces | Sequence[str]] | None = None,
    causal: bool = False,
) -> HeadStats:
    """:class:`HeadStats` of weights already recorded, without running the model again.

    ``weights[k]``: (b, len(heads), i, j) of model layer ``layers[k]``, from the query pieces ``tokens``
    (one :class:`~multihead.lab.models.Pieces` or list per text, padded to i in the weights) to the key pieces
    ``key_tokens`` (padded to j; default ``tokens``: self-attention). For a pruned model, ``layer_heads[k]``
    are the heads of ``heads`` that layer has, and ``weights[k]`` is (b, len(layer_heads[k]), i, j).
    ``causal``: query i sees keys 0..i only (see the module docstring). ``max_offset``: the largest relative
    position counted apart (the model's positions).
    """
    kept = [list(heads) for _ in layers] if layer_heads is None else [list(row) for row in layer_heads]
    grid = HeadGrid(list(layers), list(heads), kept)
    nq, nk = weights[0].shape[-2:]
    info = token_info(tokens, nq)
    keys = info if key_tokens is None else token_info(key_tokens, nk)
    accumulators = {}
    divergence = DivergenceAccumulator(sum(len(row) for row in grid.layer_heads))
    for row, (row_heads, layer_weights) in enumerate(zip(grid.layer_heads, weights, strict=True)):
        if row_heads:
            accumulators[row] = _Accumulator(len(row_heads), max_offset)
            accumulators[row].add(layer_weights, info, keys, causal=causal)
    recorded = [w for row_heads, w in zip(grid.layer_heads, weights, strict=True) if row_heads]
    divergence.add(torch.cat(recorded, dim=1), info.real[:, :nq], keys.real[:, :nk])
    texts, count = len(tokens), sum(len(Pieces.of(text).tokens) for text in tokens)
    return _finish(accumulators, divergence, grid, texts=texts, tokens=count, source=source)


def _finish(
    accumulators: dict[int, _Accumulator],
    divergence: DivergenceAccumulator,
    grid: HeadGrid,
    *,
    texts: int,
    tokens: int,
    source: str,
) -> HeadStats:
    """The accumulators of the grid's rows (a row with no head has none) as (layers, heads) values, NaN where
    pruned, and the kept heads' pairwise divergence."""
    results = [accumulators[row].result() if row in accumulators else None for row in range(len(grid.layers))]
    names = next(result for result in results if result is not None)

    def column(name: str) -> torch.Tensor:
        return grid.pad([None if result is None else result[name] for result in results], fill=float("nan"))

    values = {name: column(name) for name in names if name != "patterns"}
    return HeadStats(
        list(grid.layers),
        list(grid.heads),
        values,
        column("patterns"),
        texts=texts,
        tokens=tokens,
        source=source,
        layer_heads=grid.layer_heads if grid.ragged else None,
        similarity=HeadSimilarity.from_divergence(
            [(layer, head) for layer, kept in zip(grid.layers, grid.layer_heads, strict=True) for head in kept],
            divergence.result(),
            source,
        ),
    )
