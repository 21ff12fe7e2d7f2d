"""A synthetic :class:`~multihead.lab.inspect.inspection.Inspection` for the renderer tests (no model run).

2 layers x 3 heads that are non-contiguous subsets ([2, 5] and [0, 3, 7]), so a renderer that confuses a
layer's value with its position in ``inspection.layers`` fails. Weights are random softmax rows; statistics
and roles are computed from them as ``inspect_text`` computes them.
"""

from __future__ import annotations

import torch

from multihead.lab.inspect.inspection import Inspection
from multihead.lab.inspect.stats import HeadStats, weight_stats

TOKENS = ["[CLS]", "the", "bank", "was", "full", "of", "money", ".", "[SEP]"]
TEXT = "The bank was full of money."
LAYERS = [2, 5]
HEADS = [0, 3, 7]
CORPUS_SOURCE = "bundled corpus (150 sentences)"


def synthetic_weights(n: int, seed: int) -> torch.Tensor:
    """(len(LAYERS), len(HEADS), n, n) float32 softmax rows; layer 2 head 0 is a previous-token head (role "prev")
    and layer 5 head 7 puts everything on [CLS] (role "[CLS]"), the others are random."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.5 * torch.randn(len(LAYERS), len(HEADS), n, n, generator=gen, dtype=torch.float64)
    weights = logits.softmax(-1).float()
    previous = torch.arange(n) - 1
    previous[0] = 0
    weights[0, 0] = torch.nn.functional.one_hot(previous, n).float()
    weights[1, 2] = 0.0
    weights[1, 2, :, 0] = 1.0
    return weights


def _stats(weights: torch.Tensor, tokens: list[str], source: str) -> HeadStats:
    return weight_stats(
        [weights[row][None] for row in range(len(LAYERS))], [tokens], layers=LAYERS, heads=HEADS, source=source
    )


def synthetic_inspection(
    *,
    tokens: list[str] | None = None,
    text: str = TEXT,
    model_name: str = "all-MiniLM-L6-v2",
    corpus: bool = False,
    token: int = 2,
    seed: int = 0,
) -> Inspection:
    """An Inspection of ``text`` split into ``tokens`` (default TOKENS); with ``corpus``, roles from a second
    set of weights standing for corpus statistics."""
    tokens = list(TOKENS if tokens is None else tokens)
    weights = synthetic_weights(len(tokens), seed)
    stats = _stats(weights, tokens, "this text")
    corpus_stats = _stats(synthetic_weights(len(tokens), seed + 1), tokens, CORPUS_SOURCE) if corpus else None
    return Inspection(
        model_name=model_name,
        text=text,
        tokens=tokens,
        layers=list(LAYERS),
        heads=list(HEADS),
        weights=weights,
        stats=stats,
        role_stats=corpus_stats or stats,
        corpus=corpus_stats,
        token=token,
    )


def rectangular_inspection() -> Inspection:
    """A synthetic cross-attention inspection: 4 decoder pieces to 7 source pieces (pairwise distinct sizes)."""
    queries = ["</s>", "la", "banque", "."]
    keys = ["[CLS]", "the", "bank", "<b>x</b>", "full", ".", "[SEP]"]
    gen = torch.Generator().manual_seed(3)
    weights = (2 * torch.randn(len(LAYERS), len(HEADS), len(queries), len(keys), generator=gen)).softmax(-1)
    stats = weight_stats(
        [weights[row][None] for row in range(len(LAYERS))], [queries], layers=LAYERS, heads=HEADS, key_tokens=[keys]
    )
    return Inspection(
        model_name="synthetic",
        text="The bank <b>x</b> full.",
        tokens=queries,
        layers=list(LAYERS),
        heads=list(HEADS),
        weights=weights,
        stats=stats,
        role_stats=stats,
        corpus=None,
        token=2,
        part="cross",
        key_tokens=keys,
    )
