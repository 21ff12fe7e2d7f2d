"""What each head does, in words: its measured signals, the dominant one as its role, and how sure that is.

Every head is measured against each behaviour the literature names, with the measure of the paper that
named it (the rules, their thresholds and citations live in :data:`ROLE_RULES`, the one place they are set):

=============  ==========================================================  =========  ==========================
signal         measure (averaged over the texts' query tokens)              threshold  source
=============  ==========================================================  =========  ==========================
positional     share of word tokens whose largest weight falls on the       0.90       Voita et al. 2019
               head's most common relative position (named prev, self,
               next or pos+k)
[CLS], [SEP]   attention mass on the token                                  0.50       Clark et al. 2019
punct          attention mass on punctuation                                0.50       Clark et al. 2019
rare           share of word tokens whose largest weight falls on the       0.50       Voita et al. 2019
               sentence's rarest word (word frequencies: ``wordfreq``)
broad          normalised entropy (1 = uniform over the keys a query sees)  0.85       Clark et al. 2019
focused        1 - normalised entropy                                       0.70       (ours)
relation       with syntax scores: the share of dependents whose most-      baseline   Clark et al. 2019
               attended word is their head (or the reverse), for the        + 0.15
               relation the head beats the best fixed offset by most
prefix         with behaviour probes: on a random segment repeated twice,   0.40       Olsson et al. 2022
               attention from a token of the second copy to the token
               after its first occurrence (prefix matching; TransformerLens'
               "induction score")
induction      prefix matching as above, and copying: on those positions    0.40 and   Olsson et al. 2022
               the head's own contribution to the logits (its direct path   0.25
               through W^O, the final LayerNorm and the unembedding)
               ranks the correct next token first
alignment      with behaviour probes, cross-attention: the share of target   0.50       (ours, after Bahdanau
               positions whose largest weight falls on the source token                 et al. 2015)
               they are aligned with
prev-tok       with the head detectors: on random tokens repeated once,     0.40       TransformerLens' detector
               the share of attention from each token to the one before
               it
dup-tok        with the head detectors: on those tokens, the share of       0.40       TransformerLens' detector
               attention to earlier copies of the same token
sink           with the head detectors: on those tokens, the weight on      0.30       Gu et al. 2024
               the first token, averaged over the queries
learned sink   the weight on the layer's learned sink logit (gpt-oss'         0.50       gpt-oss (OpenAI 2025)
               ``sinks``), 1 - the row's weight on its keys; a head whose
               share stays under 0.001 has no such signal
=============  ==========================================================  =========  ==========================

Each signal's **evidence** is its measure over its threshold. The head's label is its strongest signal
by evidence, with the measure as its **strength** ("[CLS] 61%"); :attr:`Role.text` adds the next places it
looks ("[CLS] 61% · next 22%": positional, sink, punctuation, rare-word and relation signals with at least
0.2 evidence). The **confidence** says how far the label stands out:

- high: the evidence is at least 1 (the measure passes its paper's threshold) and the runner-up's is
  below ``CLEAR_MARGIN`` = 0.8 times it;
- medium: the evidence is at least 1 but a second signal is close, or it is at least ``MEDIUM_EVIDENCE``
  = 0.75 (near the threshold);
- low: the evidence is under 0.75: no behaviour we measure describes the head well; the label is only
  its strongest signal.

"focused" says a head concentrates on something none of the named signals covers, so it is left out when a
named signal (positional, a sink, punctuation, the rare word, a relation) reaches 0.75 evidence: a head
focused on [CLS] is a [CLS] head.

The behaviour signals (prefix, induction, alignment, prev-tok, dup-tok, sink) are not measured on the text: they
come from probes run on the model and reach the roles through
:meth:`~multihead.lab.inspect.stats.HeadStats.with_behaviours`. ``multihead train`` measures prefix matching, copying
and alignment on its task and saves them beside its checkpoint (see docs/train.md); the head detectors
(:func:`multihead.lab.circuits.probe_heads`, TransformerLens' definitions and Gu et al.'s sink share) measure
prefix matching (TransformerLens' "induction score"), prev-tok, dup-tok and sink on random tokens repeated once,
on any model; ``multihead inspect`` runs them on every causal model. An induction head is a head that
does both prefix matching and copying (Olsson et al.'s definition). Copying is read on the head's direct path to
the logits (Elhage et al. 2021), not by ablating it: heads that share the work (four induction heads in one
layer) each cost little when removed alone, yet each copies. A head that matches prefixes without raising the
right logit is labelled "prefix", not "induction".

References:
    Voita, Talbot, Moiseev, Sennrich, Titov. Analyzing Multi-Head Self-Attention: Specialized Heads
    Do the Heavy Lifting, the Rest Can Be Pruned. ACL 2019. (positional and rare-word heads)
    Clark, Khandelwal, Levy, Manning. What Does BERT Look At? An Analysis of BERT's Attention.
    BlackboxNLP 2019. (sinks, punctuation, broad heads, syntactic heads)
    Olsson, Elhage, Nanda, Joseph, et al. In-context Learning and Induction Heads. Transformer Circuits
    Thread, 2022. (prefix matching, copying, induction heads)
    Elhage, Nanda, Olsson, et al. A Mathematical Framework for Transformer Circuits. Transformer Circuits
    Thread, 2021. (a head's direct path to the logits)
    Bahdanau, Cho, Bengio. Neural Machine Translation by Jointly Learning to Align and Translate. ICLR 2015.
    (attention as alignment between target and source positions)
    Gu, Pang, Du, Liu, Zhang, Du, Wang, Lin. When Attention Sink Emerges in Language Models: An Empirical
    View. ICLR 2025 (arXiv 2410.10781, 2024). (the first-token share and its threshold 0.3)
    Nanda, Bloom, et al. TransformerLens, ``transformer_lens.head_detector``. (the previous-token,
    duplicate-token and induction detection patterns)
    Speer. wordfreq (v3), https://github.com/rspeer/wordfreq: Zipf word frequencies from several corpora.
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Sequence
from dataclasses import dataclass

from multihead.lab.models.tokenizer import Pieces

__all__ = [
    "Role",
    "Signal",
    "RoleRule",
    "HeadRelation",
    "ROLE_RULES",
    "BEHAVIOUR_STATISTICS",
    "CLEAR_MARGIN",
    "MEDIUM_EVIDENCE",
    "CONFIDENCES",
    "label_head",
    "word_groups",
    "rarest_word_pieces",
    "word_frequency",
]


@dataclass(frozen=True)
class RoleRule:
    """One behaviour a head can show: the statistic measuring it, the threshold, and who defined it."""

    name: str
    statistic: str  # the key of the head's statistics (see stats.STAT_NAMES); "relation" comes from syntax scores
    threshold: float
    measure: str
    source: str


# The one place the role thresholds are set (documented in the module docstring and docs/inspect.md).
ROLE_RULES: dict[str, RoleRule] = {
    rule.name: rule
    for rule in (
        RoleRule(
            "positional",
            "positional",
            0.9,
            "largest weight at one relative position, share of word tokens",
            "Voita et al. 2019",
        ),
        RoleRule("[CLS]", "cls", 0.5, "attention on [CLS]", "Clark et al. 2019"),
        RoleRule("[SEP]", "sep", 0.5, "attention on [SEP]", "Clark et al. 2019"),
        RoleRule("punct", "punct", 0.5, "attention on punctuation", "Clark et al. 2019"),
        RoleRule(
            "rare", "rare", 0.5, "largest weight on the sentence's rarest word, share of words", "Voita et al. 2019"
        ),
        RoleRule("broad", "norm_entropy", 0.85, "entropy / log n (1 = uniform)", "Clark et al. 2019"),
        RoleRule("focused", "norm_entropy", 0.7, "1 - entropy / log n", "multihead"),
        RoleRule(
            "relation",
            "relation",
            0.15,
            "dependents whose most-attended word is their head, margin over the best fixed offset",
            "Clark et al. 2019",
        ),
        RoleRule(
            "prefix",
            "prefix_matching",
            0.4,
            "attention from a repeated token to the token after its earlier occurrence",
            "Olsson et al. 2022",
        ),
        RoleRule(
            "induction",
            "prefix_matching",
            0.4,
            "prefix matching by a head that also copies (the copying rule)",
            "Olsson et al. 2022",
        ),
        RoleRule(
            "copying",
            "copying",
            0.25,
            "positions where the head's direct logits rank the correct next token first",
            "Olsson et al. 2022; Elhage et al. 2021",
        ),
        RoleRule(
            "prev-tok",
            "previous_token",
            0.4,
            "on repeated random tokens, attention from each token to the one before it",
            "TransformerLens' detector; threshold multihead's, as prefix's",
        ),
        RoleRule(
            "dup-tok",
            "duplicate_token",
            0.4,
            "on repeated random tokens, attention to earlier copies of the same token",
            "TransformerLens' detector; threshold multihead's, as prefix's",
        ),
        RoleRule("sink", "sink", 0.3, "attention on the first token, on repeated random tokens", "Gu et al. 2024"),
        RoleRule(
            "learned sink",
            "learned_sink",
            0.5,
            "weight on the layer's learned sink logit (1 - the weight on the keys)",
            "gpt-oss (OpenAI 2025)",
        ),
        RoleRule(
            "alignment",
            "alignment",
            0.5,
            "target positions whose largest cross-attention weight is on their aligned source token",
            "multihead, after Bahdanau et al. 2015",
        ),
    )
}
# The statistics the behaviour probes give (HeadStats.with_behaviours); the rest are measured on the texts.
BEHAVIOUR_STATISTICS = ("prefix_matching", "copying", "alignment", "previous_token", "duplicate_token", "sink")
# the detectors' rules (multihead.lab.circuits.probe_heads measures them on repeated random tokens), by label
_DETECTOR_RULES = ("prev-tok", "dup-tok", "sink")
NO_LEARNED_SINK = 1e-3  # below this share on its learned sink a head is taken to have none
CLEAR_MARGIN = 0.8  # high confidence: the runner-up's evidence is under 0.8 x the label's
MEDIUM_EVIDENCE = 0.75  # below this share of its threshold, a label is low confidence
CONFIDENCES = ("high", "medium", "low")
SIGNALS_SHOWN = 3  # Role.text lists at most this many signals
SHOWN_EVIDENCE = 0.2  # ... each at least this share of its threshold
_SHAPE_RULES = ("broad", "focused")  # how spread a head is, not where it looks


@dataclass(frozen=True)
class HeadRelation:
    """The dependency relation a head tracks best (from :class:`~multihead.lab.inspect.syntax.SyntaxScores`):
    its score (share of dependents found), the best fixed offset's score on the same relation, and the
    direction ("dependent_to_head" or "head_to_dependent")."""

    name: str
    score: float
    baseline: float
    direction: str = "dependent_to_head"

    @property
    def margin(self) -> float:
        return self.score - self.baseline


@dataclass(frozen=True)
class Signal:
    """One measured behaviour of a head: its name as a label ("[CLS]", "prev", "rare", "nsubj"), the
    rule it answers to (a key of :data:`ROLE_RULES`), the measure (a share in [0, 1]) and its evidence
    (the measure over the rule's threshold; >= 1 passes)."""

    name: str
    rule: str
    value: float
    evidence: float

    @property
    def text(self) -> str:
        return f"{self.name} {self.value:.0%}"


@dataclass(frozen=True)
class Role:
    """A head's role: ``label`` (its strongest signal's name, at most 9 characters: "nmod:poss"), its
    Kovaleva ``pattern``, a one-line ``summary``; ``strength`` (the label's measure), ``confidence`` (one of
    :data:`CONFIDENCES`), ``signals`` (every measured signal, strongest evidence first) and ``relation`` (the
    syntactic relation it tracks best, when syntax scores were given). A pruned head has only label, pattern
    and summary."""

    label: str
    pattern: str
    summary: str
    strength: float | None = None
    confidence: str | None = None
    signals: tuple[Signal, ...] = ()
    relation: HeadRelation | None = None

    @property
    def text(self) -> str:
        """The label's signal, then up to two more places the head looks with at least ``SHOWN_EVIDENCE`` of
        their threshold, e.g. "[CLS] 61% · next 22%" (the label alone for a pruned head). How spread a head is
        (broad, focused) shows only as a label: it is not a place."""
        if not self.signals:
            return self.label
        first, *rest = self.signals
        more = [s for s in rest if s.rule not in _SHAPE_RULES and s.evidence >= SHOWN_EVIDENCE]
        return " \u00b7 ".join(signal.text for signal in [first, *more][:SIGNALS_SHOWN])

    @property
    def short(self) -> str:
        """The label with its strength, e.g. "[CLS] 61%" (the label alone for a pruned head)."""
        return self.label if self.strength is None else f"{self.label} {self.strength:.0%}"

    @property
    def cell(self) -> str:
        """The role as every grid and table of roles prints it (``multihead inspect``'s, ``multihead train``'s):
        :attr:`short`, ending in "?" when the confidence is low (no behaviour measured near its threshold: the
        label is only the strongest guess)."""
        return self.short + ("?" if self.confidence == "low" else "")

    def as_dict(self) -> dict:
        """Plain values for JSON (numbers rounded to 6 places)."""
        return {
            "label": self.label,
            "pattern": self.pattern,
            "summary": self.summary,
            "text": self.text,
            "strength": None if self.strength is None else round(self.strength, 6),
            "confidence": self.confidence,
            "signals": [
                {"name": s.name, "rule": s.rule, "share": round(s.value, 6), "evidence": round(s.evidence, 6)}
                for s in self.signals
            ],
            "relation": None
            if self.relation is None
            else {
                "name": self.relation.name,
                "score": round(self.relation.score, 6),
                "baseline": round(self.relation.baseline, 6),
                "direction": self.relation.direction,
            },
        }


def _signals(stat: dict[str, float], relation: HeadRelation | None) -> list[Signal]:
    """Every rule's signal for one head's statistics, strongest evidence first."""
    offset = int(stat["best_offset"])
    named = {
        "positional": {-1: "prev", 0: "self", 1: "next"}.get(offset, f"pos{offset:+d}"),
        "[CLS]": "[CLS]",
        "[SEP]": "[SEP]",
        "punct": "punct",
        "rare": "rare",
        "broad": "broad",
        "focused": "focused",
        "learned sink": "learned sink",
        **{rule: rule for rule in _DETECTOR_RULES},
    }
    signals = []
    for rule_name, name in named.items():
        rule = ROLE_RULES[rule_name]
        if rule.statistic not in stat or stat[rule.statistic] != stat[rule.statistic]:  # absent or NaN
            continue
        value = stat[rule.statistic] if rule_name != "focused" else 1.0 - stat[rule.statistic]
        if rule_name == "learned sink" and value < NO_LEARNED_SINK:
            continue  # a layer without sinks (its rows sum to 1 but for rounding): no evidence either way
        signals.append(Signal(name, rule_name, value, value / rule.threshold))
    prefix = stat.get("prefix_matching", math.nan)
    if prefix == prefix:  # an induction head matches prefixes and copies; without copying it only matches
        copying = stat.get("copying", math.nan)
        copies = copying == copying and copying >= ROLE_RULES["copying"].threshold
        rule_name = "induction" if copies else "prefix"
        signals.append(Signal(rule_name, rule_name, prefix, prefix / ROLE_RULES[rule_name].threshold))
    alignment = stat.get("alignment", math.nan)
    if alignment == alignment:
        signals.append(Signal("aligned", "alignment", alignment, alignment / ROLE_RULES["alignment"].threshold))
    if relation is not None:
        rule = ROLE_RULES["relation"]
        threshold = min(1.0, relation.baseline + rule.threshold)
        signals.append(Signal(relation.name, "relation", relation.score, relation.score / threshold))
    # Focus on a named target is that target's signal: "focused" names only a head concentrated elsewhere.
    if any(s.rule not in _SHAPE_RULES and s.evidence >= MEDIUM_EVIDENCE for s in signals):
        signals = [s for s in signals if s.rule != "focused"]
    return sorted(signals, key=lambda signal: -signal.evidence)


def _confidence(signals: Sequence[Signal]) -> str:
    top = signals[0].evidence
    runner_up = signals[1].evidence if len(signals) > 1 else 0.0
    if top >= 1.0 and runner_up < CLEAR_MARGIN * top:
        return "high"
    if top >= MEDIUM_EVIDENCE:
        return "medium"
    return "low"


_DETECTOR_WHERE = {
    "prev-tok": "on the previous token",
    "dup-tok": "on earlier copies of the same token",
    "sink": "on the first token",
}


def label_head(stat: dict[str, float], pattern_shares: dict[str, float], relation: HeadRelation | None = None) -> Role:
    """The role of a head from its statistics (one head's values of :class:`~multihead.lab.inspect.stats.HeadStats`)
    and the shares of texts in each Kovaleva pattern; ``relation``: the syntactic relation it tracks best.

    See the module docstring for the signals, the label (the strongest evidence) and its confidence.
    """
    pattern = max(pattern_shares, key=pattern_shares.__getitem__)
    pattern_note = f"{pattern} in {pattern_shares[pattern]:.0%} of texts"
    signals = _signals(stat, relation)
    top = signals[0]
    confidence = _confidence(signals)
    rule = ROLE_RULES[top.rule]
    if top.rule == "relation" and relation is not None:
        what = (
            f"finds the {relation.name} relation for {relation.score:.0%} of dependents "
            f"(best fixed offset {relation.baseline:.0%})"
        )
    elif top.rule == "positional":
        what = f"largest weight at offset {int(stat['best_offset']):+d} for {top.value:.0%} of tokens"
    elif top.rule in ("prefix", "induction"):
        copying = stat.get("copying", math.nan)
        what = f"{top.value:.0%} of attention from repeated tokens to the token after their earlier occurrence"
        if copying == copying:
            what += f"; its own logits rank the next token first at {copying:.0%} of them"
    elif top.rule == "alignment":
        what = f"largest cross-attention weight on the aligned source token for {top.value:.0%} of target positions"
    elif top.rule in _DETECTOR_RULES:
        what = f"{top.value:.0%} of attention {_DETECTOR_WHERE[top.rule]}, on repeated random tokens"
    elif top.rule == "learned sink":
        what = f"{top.value:.0%} of attention on its learned sink, off every key"
    elif top.rule == "rare":
        what = f"largest weight on the sentence's rarest word for {top.value:.0%} of words"
    elif top.rule in ("broad", "focused"):
        what = f"entropy {stat['norm_entropy']:.2f} of uniform, largest weight {stat['max_weight']:.0%}"
    else:
        what = f"{top.value:.0%} of attention on {'punctuation' if top.rule == 'punct' else top.name}"
    passes = "passes" if top.evidence >= 1.0 else "under"
    bar = f"the baseline + {rule.threshold:.0%}" if top.rule == "relation" else f"{rule.threshold:.0%}"
    summary = f"{what} ({passes} {bar}, {rule.source}; {confidence} confidence); {pattern_note}"
    return Role(top.name, pattern, summary, top.value, confidence, tuple(signals), relation)


# ------------------------------------------------------------------ words and their frequencies


def word_groups(pieces: Pieces | Sequence[str]) -> tuple[list[int], list[str], list[bool]]:
    """The words of ``pieces`` as groups: (each piece's group, each group's label, whether it is special).

    ``pieces``: a :class:`~multihead.lab.models.Pieces` (the words its tokenizer made, as every batch carries), or
    bare pieces, grouped by their markers (:meth:`~multihead.lab.models.Pieces.from_markers`). A special piece
    ([CLS], <s>, ...) is a group of its own.

        >>> word_groups(["[CLS]", "una", "##ff", "##ord", "##able", "flat", "[SEP]"])
        ([0, 1, 1, 1, 1, 2, 3], ['[CLS]', 'unaffordable', 'flat', '[SEP]'], [True, False, False, True])
    """
    return Pieces.of(pieces).groups()


@functools.lru_cache(maxsize=65536)
def word_frequency(word: str) -> float:
    """The Zipf frequency of an English word (log10 of occurrences per billion words; 0 when unknown), from
    the ``wordfreq`` package's lists (shipped inside it: no download)."""
    import wordfreq  # imported on first use: its lists take ~0.3 s to load

    return float(wordfreq.zipf_frequency(word.lower(), "en"))


def rarest_word_pieces(pieces: Pieces | Sequence[str]) -> list[bool]:
    """Per piece: True when it belongs to the text's rarest word (the lowest :func:`word_frequency` among
    words with a letter; every word tied at that frequency counts). Special pieces, punctuation and numbers
    are never rare words. ``pieces``: as :func:`word_groups` takes them."""
    text = Pieces.of(pieces)
    candidates = {
        word: word_frequency(spelled)
        for word, spelled in enumerate(text.words)
        if word in text.word_ids
        and any(ch.isalpha() for ch in spelled)
        and not all(ch in string.punctuation for ch in spelled)
    }
    if not candidates:
        return [False] * len(text.tokens)
    lowest = min(candidates.values())
    rarest = {word for word, frequency in candidates.items() if frequency == lowest}
    return [word in rarest for word in text.word_ids]
