"""Which heads attend alike: the Jensen-Shannon divergence between every pair of heads, clustered.

Many heads learn nearly the same pattern. Clark et al. (2019, section 6) measured it as the distance
between two heads: the Jensen-Shannon divergence between their attention distributions, averaged over
the query tokens of a corpus, and clustered the heads by it. We do the same:

    JSD(p, q) = H((p + q) / 2) - (H(p) + H(q)) / 2         (in bits: 0 = identical rows, 1 = disjoint)

for the rows p, q of two heads on the same query token, averaged over every real query token of every
text (padding excluded; each token counts once). Heads of different layers compare fine: every head of
a part reads the same pieces. The heads are then ordered by average-linkage agglomerative clustering on
the divergence (neighbours in :attr:`HeadSimilarity.order` are near each other), and pairs under
``NEAR_DUPLICATE_JSD`` bits are named near-duplicates.

Reference:
    Clark, Khandelwal, Levy, Manning. What Does BERT Look At? An Analysis of BERT's Attention.
    BlackboxNLP 2019.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from multihead._errors import bad_argument

__all__ = ["HeadSimilarity", "DivergenceAccumulator", "cluster_order", "NEAR_DUPLICATE_JSD", "PAIR_CHUNK_BYTES"]

# Two heads whose rows differ by under this many bits on average are named near-duplicates. Rows of a
# [CLS] sink that put 0.6 and 0.7 on [CLS] (the rest spread alike) differ by about 0.01 bits; a previous-
# token head and a next-token head by 1.
NEAR_DUPLICATE_JSD = 0.05
# At most this many bytes of (pairs, queries, keys) mixtures at a time (a few of each pair's temporaries live
# alongside): enough pairs per step to stay fast on short texts, bounded memory on long ones.
PAIR_CHUNK_BYTES = 64 << 20


def _entropy_bits(p: torch.Tensor) -> torch.Tensor:
    """Entropy in bits over the last axis (0 log 0 = 0: a 0 entry gives 0 x log(tiny))."""
    return -(p * p.clamp_min(1e-30).log()).sum(-1) / math.log(2)


class DivergenceAccumulator:
    """Running sums of the pairwise JSD of N heads over query tokens, fed one batch at a time."""

    def __init__(self, heads: int):
        self.sums = torch.zeros(heads, heads, dtype=torch.float64)
        self.queries = 0
        self._pairs = torch.triu_indices(heads, heads, offset=1)  # (2, N (N - 1) / 2): the pairs a < b

    def add(self, weights: torch.Tensor, real_queries: torch.Tensor, real_keys: torch.Tensor) -> None:
        """``weights``: (b, N, i, j), the N heads' rows from each query piece (i) to each key piece (j);
        ``real_queries``: (b, i) and ``real_keys``: (b, j) bool, False on padding (which counts for nothing).

        Each text's real rows go in many pairs of heads at a time ((pairs, queries, keys) in float32, every
        unordered pair once), ~5x faster than a loop over heads; the pairs go in chunks of at most
        :data:`PAIR_CHUNK_BYTES` of mixtures, so memory stays bounded at any length (all 2,556 pairs of 72 heads at
        512 pieces would be 2.7 GB at once).
        """
        first, second = self._pairs
        for text in range(weights.shape[0]):
            rows = weights[text].detach().float()[:, real_queries[text]][:, :, real_keys[text]]  # (N, q, k)
            entropy = _entropy_bits(rows)  # (N, q)
            chunk = max(1, PAIR_CHUNK_BYTES // max(1, 4 * rows.shape[1] * rows.shape[2]))
            for start in range(0, first.numel(), chunk):
                a, b = first[start : start + chunk], second[start : start + chunk]
                mixture = (rows[a] + rows[b]) / 2  # (chunk, q, k)
                divergence = _entropy_bits(mixture) - (entropy[a] + entropy[b]) / 2  # (chunk, q)
                total = divergence.sum(-1).double()
                self.sums[a, b] += total
                self.sums[b, a] += total
            self.queries += rows.shape[1]

    def result(self) -> torch.Tensor:
        """(N, N) float64: the mean JSD in bits, symmetric, 0 on the diagonal."""
        mean = self.sums / max(self.queries, 1)
        mean = ((mean + mean.T) / 2).clamp(min=0.0)  # rounding leaves tiny asymmetries and negatives
        return mean.fill_diagonal_(0.0)


def cluster_order(divergence: torch.Tensor) -> list[int]:
    """The leaf order of average-linkage agglomerative clustering of (N, N) distances: heads in the same
    cluster sit next to each other, the closest pairs merged first."""
    count = divergence.shape[0]
    clusters: dict[int, list[int]] = {index: [index] for index in range(count)}
    distance = {(a, b): float(divergence[a, b]) for a in range(count) for b in range(a + 1, count)}
    while len(clusters) > 1:
        (a, b), _ = min(distance.items(), key=lambda item: (item[1], item[0]))
        merged = clusters.pop(a) + clusters.pop(b)
        for pair in [pair for pair in distance if a in pair or b in pair]:
            del distance[pair]
        new = max(clusters, default=count - 1) + count  # a fresh key, larger than any
        for other, members in clusters.items():
            mean = float(divergence[merged][:, members].mean())
            distance[(min(other, new), max(other, new))] = mean
        clusters[new] = merged
    return next(iter(clusters.values()), [])


@dataclass(frozen=True)
class HeadSimilarity:
    """Pairwise divergence of the recorded heads.

    ``heads``: the (layer, head) of each row and column (layer indices of the part, checkpoint head numbers;
    pruned heads are left out); ``divergence``: (N, N) mean JSD in bits; ``order``: the heads' cluster order
    (indices into ``heads``); ``source``: what it was measured on ("this text", "178 corpus texts").
    """

    heads: list[tuple[int, int]]
    divergence: torch.Tensor
    order: list[int]
    source: str
    threshold: float = NEAR_DUPLICATE_JSD

    @classmethod
    def from_divergence(cls, heads: Sequence[tuple[int, int]], divergence: torch.Tensor, source: str) -> HeadSimilarity:
        return cls(list(heads), divergence, cluster_order(divergence), source)

    def between(self, a: tuple[int, int], b: tuple[int, int]) -> float:
        """The divergence in bits between heads ``a`` and ``b``, each (layer, head)."""
        return float(self.divergence[self._index(a), self._index(b)])

    def _index(self, head: tuple[int, int]) -> int:
        if tuple(head) not in self.heads:
            raise bad_argument(
                "head", "a (layer, head) the similarity covers", repr(head), f"pick one of {self.heads[:6]}..."
            )
        return self.heads.index((head[0], head[1]))

    def nearest(self, head: tuple[int, int], k: int = 3) -> list[tuple[tuple[int, int], float]]:
        """The ``k`` heads closest to ``head``: ((layer, head), divergence), closest first."""
        row = self.divergence[self._index(head)].clone()
        row[self._index(head)] = math.inf
        values, indices = row.topk(min(k, len(self.heads) - 1), largest=False)
        return [(self.heads[i], float(v)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)]

    def near_duplicates(self) -> list[tuple[tuple[int, int], tuple[int, int], float]]:
        """Pairs of heads under ``threshold`` bits apart: (head a, head b, divergence), closest first."""
        below = torch.triu(self.divergence < self.threshold, diagonal=1).nonzero().tolist()
        pairs = [(self.heads[a], self.heads[b], float(self.divergence[a, b])) for a, b in below]
        return sorted(pairs, key=lambda pair: pair[2])

    def as_dict(self, decimals: int = 6) -> dict:
        """Plain values for JSON: heads as [layer, head] pairs, the divergence matrix, the cluster order, the
        near-duplicate pairs and the threshold."""
        return {
            "source": self.source,
            "heads": [list(head) for head in self.heads],
            "divergence": self.divergence.round(decimals=decimals).tolist(),
            "order": self.order,
            "threshold": self.threshold,
            "near_duplicates": [
                {"a": list(a), "b": list(b), "divergence": round(d, decimals)} for a, b, d in self.near_duplicates()
            ],
        }
