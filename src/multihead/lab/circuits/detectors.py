"""Head detectors on any model on our kernel (a causal LM, or an encoder): how much each head behaves as a
previous-token, duplicate-token or induction head on repeated random tokens, and how much of its attention sinks
into the first token.

    ids = repeated_random_tokens(vocab_size=50257, half_length=20, batch=4, bos=50256)
    found = detect_heads(model, ids)
    found.induction          # (layers, heads): TransformerLens' induction score
    found.sink_heads()       # [(layer, head), ...] whose first-token share exceeds Gu et al.'s 0.3

The three patterns are TransformerLens' (``transformer_lens.head_detector``): a previous-token head attends from
position i to i - 1; a duplicate-token head from i to every earlier j holding the same token; an induction head
from i to every j whose previous token is token i (the token after an earlier occurrence). A head's score is
TransformerLens' "mul" measure, the share of its attention that falls on the pattern, sum(A * P) / sum(A), per
sequence and averaged over the batch. The sink share is Gu et al.'s (2024, "When Attention Sink Emerges in
Language Models"): the head's weight on the first token averaged over the query positions; a head above 0.3 is
a sink head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from multihead._errors import bad_argument, describe, positive_int
from multihead.capture import capture
from multihead.lab.circuits._runs import checked_ids
from multihead.lab.inspect.recording import head_numbers
from multihead.lab.inspect.roles import ROLE_RULES
from multihead.lab.models.contract import evaluating, text_tokenizer
from multihead.lab.models.tokenizer import TextTokenizer

__all__ = [
    "DETECTORS",
    "SINK_THRESHOLD",
    "HeadDetection",
    "detect_heads",
    "detection_patterns",
    "detector_behaviours",
    "probe_heads",
    "repeated_random_tokens",
]

DETECTORS = ("previous_token", "duplicate_token", "induction")
# Gu et al. (2024): the first-token share above which a head counts as a sink (set with the other role thresholds)
SINK_THRESHOLD = ROLE_RULES["sink"].threshold
# each score as the statistic the roles read (multihead.lab.inspect.roles): TransformerLens' induction score is
# prefix matching, the first half of Olsson et al.'s induction (the other, copying, is not measured here)
BEHAVIOUR_NAMES = {
    "previous_token": "previous_token",
    "duplicate_token": "duplicate_token",
    "induction": "prefix_matching",
    "sink": "sink",
}
HALF_LENGTH = 20  # random tokens per half, where the model's positions hold 2 x 20 (+ BOS): TransformerLens' demos
ROLE_LABELS = {"previous_token": "prev-tok", "duplicate_token": "dup-tok", "induction": "prefix", "sink": "sink"}


def repeated_random_tokens(
    vocab_size: int, half_length: int, *, batch: int = 4, seed: int = 0, bos: int | None = None, low: int = 0
) -> torch.Tensor:
    """Random tokens repeated once: (batch, [1 +] 2 half_length) int64, each row ``[bos] x_1 .. x_L x_1 .. x_L``
    with x drawn uniformly from [low, vocab_size) by a generator seeded with ``seed`` (the same ids on every
    machine). ``bos``: a token put first (a model trained with one expects it), or None."""
    for name, value in (("vocab_size", vocab_size), ("half_length", half_length), ("batch", batch)):
        positive_int(name, value)
    if not isinstance(low, int) or not 0 <= low < vocab_size:
        raise bad_argument("low", f"an int in [0, {vocab_size})", describe(low), "pass e.g. low=0")
    if bos is not None and (not isinstance(bos, int) or not 0 <= bos < vocab_size):
        raise bad_argument("bos", f"None or a token id in [0, {vocab_size})", describe(bos), "pass the BOS token id")
    generator = torch.Generator().manual_seed(seed)
    half = torch.randint(low, vocab_size, (batch, half_length), generator=generator)
    ids = torch.cat([half, half], dim=1)
    return ids if bos is None else torch.cat([torch.full((batch, 1), bos), ids], dim=1)


def detection_patterns(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """TransformerLens' detection patterns of ``ids`` (b, n): {name: (b, n, n) float32}, lower triangular:
    previous_token 1 at (i, i - 1); duplicate_token 1 at (i, j < i) where token j is token i; induction 1 at
    (i, j <= i) where token j - 1 is token i."""
    n = ids.shape[-1]
    same = ids[:, :, None] == ids[:, None, :]  # (b, i, j)
    below = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril(-1)
    previous = torch.zeros(n, n, dtype=torch.bool, device=ids.device)
    previous[1:, :-1] = torch.eye(n - 1, dtype=torch.bool, device=ids.device)
    duplicate = same & below
    induction = torch.zeros_like(duplicate)
    induction[:, :, 1:] = duplicate[:, :, :-1]  # shifted one key to the right: the token after the duplicate
    induction &= torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    return {
        "previous_token": previous.expand_as(same).float(),
        "duplicate_token": duplicate.float(),
        "induction": induction.float(),
    }


@dataclass(frozen=True)
class HeadDetection:
    """Each detector's score per head and the sink share, (layers, heads), in float32 (float64 for a float64
    model); the heads by their checkpoint numbers, NaN where a pruned layer no longer has one. ``ids``: the (b, n)
    token ids scored (None when built by hand)."""

    part: str
    previous_token: torch.Tensor
    duplicate_token: torch.Tensor
    induction: torch.Tensor
    sink: torch.Tensor
    ids: torch.Tensor | None = None

    def sink_heads(self, threshold: float = SINK_THRESHOLD) -> list[tuple[int, int]]:
        """(layer, head) of every head whose first-token share exceeds ``threshold``."""
        return [(int(layer), int(head)) for layer, head in (self.sink > threshold).nonzero().tolist()]

    def named_heads(self) -> list[dict]:
        """Every head a detector names, by layer and head: ``{"layer", "head", "role", "score"}``, the role the
        label :mod:`multihead.lab.inspect.roles` gives a score at or above its rule's threshold (prev-tok, dup-tok,
        prefix, sink; see ``ROLE_RULES``); a head named by several detectors is listed once per role, its
        strongest evidence first."""
        named = []
        for layer in range(self.sink.shape[0]):
            for head in range(self.sink.shape[1]):
                passing = []
                for name, label in ROLE_LABELS.items():
                    score = float(getattr(self, name)[layer, head])
                    evidence = score / ROLE_RULES[label].threshold
                    if evidence >= 1.0:  # NaN (a pruned head) never passes
                        passing.append((evidence, {"layer": layer, "head": head, "role": label, "score": score}))
                named += [entry for _, entry in sorted(passing, key=lambda pair: -pair[0])]
        return named

    def to_dict(self) -> dict:
        """JSON-ready: each score as (layers, heads) nested lists (null for a pruned head)."""
        fields = {name: getattr(self, name) for name in (*DETECTORS, "sink")}
        return {
            "part": self.part,
            **{
                name: [[None if v != v else v for v in row] for row in values.tolist()]
                for name, values in fields.items()
            },
        }

    def behaviours(self) -> dict[str, torch.Tensor]:
        """The scores as the behaviour measures the roles weigh, {statistic: (layers, heads) float64} (see
        :mod:`multihead.lab.inspect.roles`: prefix_matching, previous_token, duplicate_token and sink), for
        :func:`multihead.lab.inspect.inspect_text`'s ``behaviours``."""
        return {statistic: getattr(self, name).double() for name, statistic in BEHAVIOUR_NAMES.items()}


def detect_heads(model: nn.Module, ids: torch.Tensor, *, part: str | None = None) -> HeadDetection:
    """Score every head of ``model`` (any model on our kernel whose ``forward(ids)`` runs: a causal LM, or an
    encoder, whose heads also see later tokens) on ``ids`` (b, n) (typically
    :func:`repeated_random_tokens`): the three detectors and the sink share (see the module docstring).

    Records each layer's weights through :func:`~multihead.capture` while the model runs in eval mode without
    autograd (its mode comes back). Raises TypeError naming ``ids`` for anything but an int tensor (n,) or (b, n)
    of at least two tokens.
    """
    ids = checked_ids("ids", ids, "pass repeated_random_tokens(...)")
    if ids.shape[1] < 2:
        raise bad_argument("ids", "at least two tokens per row", tuple(ids.shape), "pass longer sequences")
    numbers, checkpoint_heads = head_numbers(model, part=part)  # a pruned layer's heads keep their numbers
    with evaluating(model), capture(model, part=part) as recorder:
        model(ids)  # only the weights are read: an encoder serves as well as a causal LM
    patterns = {name: pattern.to(ids.device) for name, pattern in detection_patterns(ids).items()}
    scores: dict[str, torch.Tensor] = {}
    for layer in recorder.layers:
        weights = recorder.weights(layer)  # (b, h, i, j)
        weights = weights.to(torch.promote_types(weights.dtype, torch.float32))
        total = weights.sum((-2, -1))  # (b, h): n for rows that each sum to 1
        found = {
            name: ((weights * pattern[:, None].to(weights)).sum((-2, -1)) / total).mean(0)
            for name, pattern in patterns.items()
        }
        found["sink"] = weights[..., 0].mean(-1).mean(0)
        for name, values in found.items():
            grid = scores.setdefault(name, torch.full((len(numbers), checkpoint_heads), torch.nan, dtype=values.dtype))
            grid[layer, numbers[layer]] = values.cpu()
    return HeadDetection(part=recorder.part, **scores, ids=ids)


def probe_heads(
    model: nn.Module,
    tokenizer: TextTokenizer,
    *,
    part: str | None = None,
    half_length: int | None = None,
    batch: int = 4,
    seed: int = 0,
) -> HeadDetection:
    """:func:`detect_heads` on ``batch`` sequences of ``half_length`` random tokens repeated once
    (:func:`repeated_random_tokens` of the ``tokenizer``'s vocabulary, seeded with ``seed``), after the tokenizer's
    BOS where it has one (TransformerLens prepends one too; a BOS of id 0 is then never drawn among the random
    tokens), on the device of ``model``'s parameters.

    ``half_length``: None for :data:`HALF_LENGTH` (20), or fewer where the model's positions
    (``tokenizer.max_length``) hold fewer: a model trained on short sequences is probed on what it read. A
    ``half_length`` whose sequences exceed those positions raises ValueError naming it.
    """
    bos = tokenizer.bos_id
    longest = (tokenizer.max_length - (0 if bos is None else 1)) // 2
    if half_length is None:
        half_length = min(HALF_LENGTH, longest)
    elif isinstance(half_length, int) and not isinstance(half_length, bool) and half_length > longest:
        raise bad_argument(
            "half_length",
            f"at most {longest}: the sequences, twice it{' after a BOS' if bos is not None else ''}, must fit the "
            f"model's {tokenizer.max_length} positions",
            half_length,
            f"pass half_length={longest} or less",
        )
    ids = repeated_random_tokens(
        tokenizer.vocabulary_size, half_length, batch=batch, seed=seed, bos=bos, low=1 if bos == 0 else 0
    )
    device = next((parameter.device for parameter in model.parameters()), ids.device)
    return detect_heads(model, ids.to(device), part=part)


def detector_behaviours(
    model: nn.Module, *, half_length: int | None = None, batch: int = 4, seed: int = 0
) -> dict[str, torch.Tensor] | None:
    """The head detectors' scores of a causal text model as the behaviour measures its roles weigh: what
    ``multihead inspect`` passes to :func:`~multihead.lab.inspect.inspect_text` as ``behaviours`` for a causal LM::

        behaviours = multihead.lab.circuits.detector_behaviours(model)     # model: load_text_model(folder)
        inspection = multihead.lab.inspect.inspect_text(model, text, behaviours=behaviours)

    ``model``: a :class:`~multihead.lab.models.TextEncoder` with its tokenizer. Returns :meth:`HeadDetection.behaviours`
    of :func:`probe_heads` ({statistic: (layers, heads) float64} over every layer and the checkpoint's head
    numbers) for a one-stack causal model (its ``is_causal`` True: a transformers causal LM, a ``multihead train``
    decoder), None for any other (an encoder's heads see later tokens, for which the detectors' lower-triangular
    patterns are not the question; an encoder-decoder reads two texts)."""
    if getattr(model, "is_causal", False) is not True:
        return None
    return probe_heads(model, text_tokenizer(model), half_length=half_length, batch=batch, seed=seed).behaviours()
