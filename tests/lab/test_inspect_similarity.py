"""Head similarity (multihead.lab.inspect.similarity): the Jensen-Shannon divergence of Clark et al. 2019
against a direct float64 computation, padding left out, the clustering order, near-duplicates, and the
statistics' similarity on all-MiniLM-L6-v2."""

from __future__ import annotations

import json
import math

import pytest
import torch

from multihead.lab.inspect.similarity import (
    NEAR_DUPLICATE_JSD,
    DivergenceAccumulator,
    HeadSimilarity,
    cluster_order,
)


def jsd_bits(p: torch.Tensor, q: torch.Tensor) -> float:
    """The textbook definition, one pair of rows, float64."""
    m = (p + q) / 2

    def kl(a: torch.Tensor, b: torch.Tensor) -> float:
        keep = a > 0
        return float((a[keep] * (a[keep] / b[keep]).log2()).sum())

    return (kl(p, m) + kl(q, m)) / 2


def test_divergence_matches_the_definition_and_skips_padding():
    torch.manual_seed(0)
    heads, n, pad = 4, 6, 2
    weights = torch.softmax(torch.randn(1, heads, n + pad, n + pad, dtype=torch.float64), dim=-1)
    weights[..., n:] = 0  # padded keys get no weight
    weights = weights / weights.sum(-1, keepdim=True)
    weights[:, :, n:, :] = torch.rand(heads, pad, n + pad, dtype=torch.float64)  # garbage in padded query rows
    real = torch.tensor([[True] * n + [False] * pad])
    accumulator = DivergenceAccumulator(heads)
    accumulator.add(weights, real, real)
    result = accumulator.result()
    for a in range(heads):
        for b in range(heads):
            expected = sum(jsd_bits(weights[0, a, i, :n], weights[0, b, i, :n]) for i in range(n)) / n
            assert result[a, b] == pytest.approx(expected, abs=1e-5)
    assert torch.equal(result, result.T) and torch.all(result.diagonal() == 0)


def test_identical_heads_are_0_bits_apart_and_disjoint_ones_1():
    one_hot = torch.eye(3, dtype=torch.float32)  # query i attends to key i
    shifted = one_hot.roll(1, dims=1)  # query i attends to key i - 1
    weights = torch.stack([one_hot, one_hot.clone(), shifted])[None]  # (1, 3, 3, 3)
    real = torch.ones(1, 3, dtype=torch.bool)
    accumulator = DivergenceAccumulator(3)
    accumulator.add(weights, real, real)
    result = accumulator.result()
    assert result[0, 1] == 0 and result[0, 2] == pytest.approx(1.0) and result[1, 2] == pytest.approx(1.0)


def test_texts_add_up_by_query_token():
    """Two texts fed in two batches give the mean over all their query tokens, each token counting once."""
    torch.manual_seed(1)
    short, long = (torch.softmax(torch.randn(1, 3, n, n), dim=-1) for n in (3, 7))
    together, apart = DivergenceAccumulator(3), DivergenceAccumulator(3)
    apart.add(short, torch.ones(1, 3, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool))
    apart.add(long, torch.ones(1, 7, dtype=torch.bool), torch.ones(1, 7, dtype=torch.bool))
    padded = torch.zeros(2, 3, 7, 7)
    padded[0, :, :3, :3], padded[1] = short[0], long[0]
    real = torch.tensor([[True] * 3 + [False] * 4, [True] * 7])
    together.add(padded, real, real)
    assert torch.allclose(together.result(), apart.result()) and together.queries == 10


def test_cluster_order_keeps_groups_together():
    # heads 0, 2, 4 are alike, as are 1, 3, 5: the order must not interleave the groups
    groups = torch.tensor([0, 1, 0, 1, 0, 1])
    distance = torch.where(groups[:, None] == groups[None, :], 0.05, 0.9).to(torch.float64)
    distance += torch.arange(6, dtype=torch.float64)[:, None] * 1e-3 + torch.arange(6, dtype=torch.float64) * 1e-3
    distance.fill_diagonal_(0)
    order = cluster_order(distance)
    assert sorted(order) == list(range(6))
    assert {tuple(sorted(order[:3])), tuple(sorted(order[3:]))} == {(0, 2, 4), (1, 3, 5)}


def test_near_duplicates_nearest_and_json():
    heads = [(0, 0), (0, 1), (1, 0)]
    divergence = torch.tensor([[0.0, 0.01, 0.5], [0.01, 0.0, 0.4], [0.5, 0.4, 0.0]], dtype=torch.float64)
    similarity = HeadSimilarity.from_divergence(heads, divergence, "this text")
    assert similarity.near_duplicates() == [((0, 0), (0, 1), 0.01)]
    assert similarity.nearest((1, 0), k=2) == [((0, 1), 0.4), ((0, 0), 0.5)]
    assert similarity.between((0, 1), (1, 0)) == 0.4
    data = json.loads(json.dumps(similarity.as_dict()))
    assert data["heads"] == [[0, 0], [0, 1], [1, 0]] and data["threshold"] == NEAR_DUPLICATE_JSD
    assert data["near_duplicates"] == [{"a": [0, 0], "b": [0, 1], "divergence": 0.01}]
    assert sorted(data["order"]) == [0, 1, 2]
    with pytest.raises(ValueError, match="head"):
        similarity.between((5, 5), (0, 0))


def test_minilm_statistics_carry_the_similarity_of_every_head():
    from multihead.lab.inspect import head_stats
    from multihead.lab.models import load_minilm

    model, _ = load_minilm()
    stats = head_stats(model, ["The bank was full of money.", "It rained all day, so we stayed in."])
    similarity = stats.similarity
    assert similarity is not None and len(similarity.heads) == 72 and similarity.heads[13] == (1, 1)
    assert similarity.divergence.shape == (72, 72) and similarity.source == "2 texts"
    off_diagonal = similarity.divergence[~torch.eye(72, dtype=torch.bool)]
    assert 0 < float(off_diagonal.min()) and float(off_diagonal.max()) <= 1 + 1e-6
    assert not math.isnan(float(off_diagonal.sum()))
