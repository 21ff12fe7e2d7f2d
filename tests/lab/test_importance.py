"""Head importance: fidelity, ablation and gradient importance (Michel et al.), pruning the real MiniLM."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention
from multihead.lab.inspect import bundled_corpus, capture
from multihead.lab.inspect.importance import (
    ablated,
    ablation_importance,
    fidelity,
    gradient_importance,
    mean_head_outputs,
    pruning_curve,
    pruning_order,
)
from multihead.lab.models import load_minilm

TEXTS = bundled_corpus()[:12]


@pytest.fixture(scope="module")
def minilm():
    return load_minilm()[0]


def test_fidelity_of_known_embeddings():
    torch.manual_seed(0)
    reference = torch.nn.functional.normalize(torch.randn(5, 8), dim=-1)
    assert fidelity(reference, reference) == {
        "cosine": pytest.approx(1.0),
        "min_cosine": pytest.approx(1.0),
        "nn_agreement": 1.0,
    }
    flipped = reference.clone()
    flipped[2] = -flipped[2]
    result = fidelity(reference, flipped)
    assert result["min_cosine"] == pytest.approx(-1.0)
    assert result["cosine"] == pytest.approx(3 / 5)
    # neighbours 0<->1 and 2<->3; moving point 3 between 0 and 1 changes every text's nearest neighbour
    line = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0]]), dim=-1)
    moved = line.clone()
    moved[3] = torch.nn.functional.normalize(torch.tensor([1.0, 0.05]), dim=0)
    assert fidelity(line, moved)["nn_agreement"] == 0.0
    assert fidelity(line, line)["nn_agreement"] == 1.0


def test_ablation_equals_pruning_on_the_real_model(minilm):
    heads = {0: [2, 7], 4: [11]}
    with ablated(minilm, heads):
        ablated_embeddings = minilm.encode(TEXTS)
    assert minilm.attention_layers[0].head_ablation is None  # restored after the block
    import copy

    pruned = copy.deepcopy(minilm)
    pruned.prune_heads(heads)
    assert pruned.head_ids[0] == [0, 1, 3, 4, 5, 6, 8, 9, 10, 11]
    torch.testing.assert_close(pruned.encode(TEXTS), ablated_embeddings, atol=1e-6, rtol=0)


def test_mean_head_outputs_average_real_tokens_only(minilm):
    texts = ["A short one.", "A much longer sentence that forces padding onto the short one."]
    means = mean_head_outputs(minilm, texts, batch_size=2)
    total, tokens = 0, 0
    for text in texts:  # one at a time: no padding at all
        with torch.no_grad(), capture(minilm, layers=[3], weights=False, outputs=True) as rec:
            minilm.encode(text)
        total = total + rec.outputs(3)[0].sum(dim=1)  # (heads, e)
        tokens += rec.outputs(3).shape[2]
    torch.testing.assert_close(means[3], total / tokens, atol=1e-5, rtol=0)


def test_ablation_importance_is_one_minus_the_cosine(minilm):
    importance = ablation_importance(minilm, TEXTS, layers=[0])
    assert importance.scores.shape == (6, 12)
    assert torch.isnan(importance.scores[1:]).all() and not torch.isnan(importance.scores[0]).any()
    reference = minilm.encode(TEXTS)
    with ablated(minilm, {0: [2]}):
        cosine = (reference * minilm.encode(TEXTS)).sum(-1).mean()
    assert float(importance.scores[0, 2]) == pytest.approx(1 - float(cosine), abs=1e-6)
    assert importance.ranking()[0][:2] == (0, int(importance.scores[0].argmax()))
    assert [layer for layer, _, _ in importance.ranking()] == [0] * 12  # heads not measured are not ranked


def test_pruning_order_never_empties_a_layer():
    scores = torch.tensor([[0.1, 0.2, 0.3], [0.05, 0.9, 0.01]])
    order = pruning_order(scores, [3, 3])
    assert order == [(1, 2), (1, 0), (0, 0), (0, 1)]  # (1, 1) and (0, 2) are their layers' last heads


def test_pruning_curve_measures_the_pruned_copies(minilm):
    importance = torch.arange(72, dtype=torch.float32).view(6, 12)  # layer 0's heads go first
    rows = pruning_curve(minilm, TEXTS, importance, fractions=(0.0, 0.1), repeats=1)
    assert rows[0]["heads_removed"] == 0 and rows[0]["cosine"] == pytest.approx(1.0, abs=1e-6)
    assert rows[1]["heads_removed"] == 7 and rows[1]["removed"] == [(0, h) for h in range(7)]
    reference = minilm.encode(TEXTS)
    with ablated(minilm, {0: list(range(7))}):
        expected = fidelity(reference, minilm.encode(TEXTS))
    assert rows[1]["cosine"] == pytest.approx(expected["cosine"], abs=1e-6)
    assert all(row["seconds"] > 0 and row["attention_seconds"] > 0 for row in rows)
    assert minilm.attention_layers[0].num_heads == 12  # the model itself is untouched
    with pytest.raises(ValueError, match=r"fractions: expected fractions of all heads in \[0, 1\), got 1.0"):
        pruning_curve(minilm, TEXTS, importance, fractions=(1.0,))


def test_speed_ups_come_from_paired_runs_in_alternating_order(minilm, monkeypatch):
    """The original and the pruned copy are timed back to back, the order alternating, and the speed-up is the
    median pair's with the range over pairs (it was one timing of each, minutes apart, on a loaded machine)."""
    from multihead.lab.inspect import importance as module

    calls = []
    times = iter([(4.0, 2.0), (2.0, 1.0), (2.0, 0.5), (4.0, 2.0), (4.0, 2.0), (1.0, 2.5)])  # base, pruned, ...

    def once(timer):
        calls.append("base" if timer.model is minilm else "pruned")
        return next(times)

    monkeypatch.setattr(module._EncodeTimer, "once", once)
    importance = torch.arange(72, dtype=torch.float32).view(6, 12)
    row = pruning_curve(minilm, TEXTS, importance, fractions=(0.1,), repeats=3)[0]
    assert calls == ["base", "pruned", "pruned", "base", "base", "pruned"]
    # pairs (base / pruned): whole 4/2, 4/2, 4/1 -> median 2; attention 2/1, 2/0.5, 2/2.5 -> median 2
    assert row["speedup"] == 2.0 and row["speedup_range"] == [2.0, 4.0]
    assert row["attention_speedup"] == 2.0 and row["attention_speedup_range"] == [0.8, 4.0]
    assert row["repeats"] == 3 and row["seconds"] == 2.0


# --------------------------------------------------------------------------- gradient importance, trained


class CopyPrevious(nn.Module):
    """Predict the previous token: only attention can move it. Heads 2 and 3 have W^O columns held at
    zero, so they cannot matter: their importance must be exactly 0."""

    def __init__(self, vocab: int = 6, length: int = 8, width: int = 16):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(length, width) * 0.5)
        self.attention = MultiHeadAttention(width, 4)
        self.readout = nn.Linear(width, vocab)
        with torch.no_grad():
            self.attention.out_proj.weight[:, 8:] = 0.0
        self.attention.out_proj.weight.register_hook(lambda grad: torch.cat([grad[:, :8], grad[:, 8:] * 0], 1))

    def forward(self, x):
        return self.readout(self.attention(self.tokens(x) + self.positions, causal=True)[0])


def copy_loss(model, batch):
    x = batch
    logits = model(x)[:, 1:]  # (b, length - 1, vocab): position t predicts x[t - 1]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, :-1].reshape(-1))


def test_gradient_importance_finds_the_heads_a_trained_model_uses():
    torch.manual_seed(0)
    model = CopyPrevious()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    data = torch.Generator().manual_seed(1)
    for _ in range(250):
        batch = torch.randint(0, 6, (64, 8), generator=data)
        optimizer.zero_grad()
        copy_loss(model, batch).backward()
        optimizer.step()
    batches = [torch.randint(0, 6, (64, 8), generator=data) for _ in range(4)]
    with torch.no_grad():
        trained_loss = sum(float(copy_loss(model, b)) for b in batches) / 4
    assert trained_loss < 0.3  # it learned to copy (chance is log 6 = 1.79)
    importance = gradient_importance(model, copy_loss, batches)
    scores = importance.scores[0]
    assert scores[2] == 0 and scores[3] == 0  # heads that cannot reach the output
    top = int(scores.argmax())
    assert top in (0, 1) and scores[top] > 0
    # the ranking is what ablation shows: removing the top head hurts most, the held-out heads not at all
    losses = []
    for head in range(4):
        model.attention.ablate_heads([head])
        with torch.no_grad():
            losses.append(sum(float(copy_loss(model, b)) for b in batches) / 4)
        model.attention.restore_heads()
    assert losses[2] == pytest.approx(trained_loss, abs=1e-6) and losses[3] == pytest.approx(trained_loss, abs=1e-6)
    assert losses[top] == max(losses) and losses[top] > trained_loss + 0.2
    normalized = gradient_importance(model, copy_loss, batches, normalize=True).scores[0]
    assert float(normalized.norm()) == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(ValueError, match="batches: expected at least one batch"):
        gradient_importance(model, copy_loss, [])


def test_encoder_prune_errors_and_save_load(minilm, tmp_path):
    import copy

    model = copy.deepcopy(minilm)
    with pytest.raises(ValueError, match=r"heads\[0\]: expected fewer than all 12 heads of layer 0"):
        model.prune_heads({0: list(range(12))})
    with pytest.raises(ValueError, match=r"heads: expected layer indices in 0\.\.5, got 6"):
        model.prune_heads({6: [0]})
    model.prune_heads({2: [3]})
    with pytest.raises(ValueError, match=r"heads\[2\]: expected heads still in layer 2"):
        model.prune_heads({2: [3]})
    model.save(tmp_path)
    loaded, _ = load_minilm(tmp_path)
    assert loaded.head_ids[2] == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]
    torch.testing.assert_close(loaded.encode(TEXTS), model.encode(TEXTS), atol=0, rtol=0)
