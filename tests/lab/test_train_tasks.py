"""multihead.lab.train: the synthetic tasks, the head scores and losses, and the model-agnostic training loop."""

from __future__ import annotations

import doctest
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multihead._errors import InputError
from multihead._figures import MissingExtraError
from multihead.lab.models import tasks
from multihead.lab.train import (
    BOS,
    alignment_accuracy,
    count_tokens,
    history_to_json,
    in_context_learning_score,
    induction_batch,
    induction_score,
    loop,
    per_position_loss,
    plot_history,
    previous_token_score,
    repeated_half_loss,
    reverse_batch,
    train,
)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster and immune to a busy machine."""


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- tasks -------------------------------------------------------------------------------------------------------


def test_task_docstring_examples_run():
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    examples = 0
    for test in doctest.DocTestFinder().find(tasks, globs={"torch": torch, **vars(tasks)}):
        examples += len(test.examples)
        runner.run(test)
    assert examples >= 4 and runner.failures == 0


def test_induction_batch_layout_with_bos():
    batch = induction_batch(3, 5, 11, generator=gen())
    ids = batch.ids
    assert ids.shape == (3, 11) and ids.dtype == torch.long
    assert (ids[:, 0] == BOS).all()
    assert torch.equal(ids[:, 1:6], ids[:, 6:11])  # x_1..x_L twice
    assert ((ids[:, 1:] >= 1) & (ids[:, 1:] < 11)).all()  # BOS is never drawn
    assert batch.repeated.tolist() == [[False] * 6 + [True] * 5] * 3
    assert batch.previous.tolist() == [[-1] * 6 + [1, 2, 3, 4, 5]] * 3
    assert batch.lengths.tolist() == [5, 5, 5]
    rows = batch.repeated[0].nonzero().flatten()
    assert torch.equal(ids[:, rows], ids[:, batch.previous[0, rows]])  # the previous occurrence holds the same token
    assert batch.bos and batch.offset == 1 and batch.half_length == 5


def test_induction_batch_without_bos_draws_every_token():
    batch = induction_batch(64, 3, 3, generator=gen(), bos=False)
    assert batch.ids.shape == (64, 6) and not batch.bos
    assert torch.equal(batch.ids[:, :3], batch.ids[:, 3:])
    assert set(batch.ids.unique().tolist()) == {0, 1, 2}
    assert batch.previous[0].tolist() == [-1, -1, -1, 0, 1, 2]


def test_induction_batch_with_varied_lengths_repeats_each_segment_at_its_own_distance():
    batch = induction_batch(200, 6, 40, generator=gen(), min_half_length=2)
    ids, lengths = batch.ids, batch.lengths
    assert ids.shape == (200, 13) and (ids[:, 0] == BOS).all() and ((ids[:, 1:] >= 1) & (ids[:, 1:] < 40)).all()
    assert set(lengths.tolist()) == {2, 3, 4, 5, 6}  # every length in min_half_length..half_length is drawn
    for row in range(200):
        length = lengths[row].item()
        start = 13 - 2 * length  # BOS, 2 (L - L_i) filler tokens, then the two copies
        assert torch.equal(ids[row, start : start + length], ids[row, start + length :])
        assert batch.repeated[row].nonzero().flatten().tolist() == list(range(13 - length, 13))
        expected = [-1] * (13 - length) + list(range(start, start + length))
        assert batch.previous[row].tolist() == expected
    same = induction_batch(200, 6, 40, generator=gen(), min_half_length=2)
    assert torch.equal(same.ids, ids) and torch.equal(same.lengths, lengths)
    fixed = induction_batch(4, 6, 40, generator=gen(), min_half_length=6)  # one length: no filler
    assert torch.equal(fixed.ids[:, 1:7], fixed.ids[:, 7:]) and fixed.lengths.tolist() == [6] * 4


def test_induction_batch_is_a_function_of_the_seed():
    first = induction_batch(2, 7, 50, generator=gen(3)).ids
    assert torch.equal(first, induction_batch(2, 7, 50, generator=gen(3)).ids)
    assert not torch.equal(first, induction_batch(2, 7, 50, generator=gen(4)).ids)
    g = gen(3)
    assert not torch.equal(induction_batch(2, 7, 50, generator=g).ids, induction_batch(2, 7, 50, generator=g).ids)


def test_reverse_batch_aligns_each_target_position_with_its_source():
    task = reverse_batch(3, 5, 13, generator=gen())
    assert task.source.shape == task.target.shape == task.decoder_input.shape == (3, 5)
    assert task.alignment.tolist() == [4, 3, 2, 1, 0]
    assert torch.equal(task.target, task.source[:, task.alignment])
    assert (task.decoder_input[:, 0] == BOS).all() and torch.equal(task.decoder_input[:, 1:], task.target[:, :-1])
    assert ((task.source >= 1) & (task.source < 13)).all()
    assert torch.equal(task.source, reverse_batch(3, 5, 13, generator=gen()).source)


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: induction_batch(0, 4, 10, generator=gen()), ValueError, "batch: expected a positive int"),
        (lambda: induction_batch(2, 1, 10, generator=gen()), ValueError, "half_length: expected at least 2"),
        (lambda: induction_batch(2, 4.0, 10, generator=gen()), TypeError, "half_length: expected a positive int"),
        (lambda: induction_batch(2, 4, 2, generator=gen()), ValueError, "vocab_size: expected at least 3"),
        (lambda: induction_batch(2, 4, 1, generator=gen(), bos=False), ValueError, "vocab_size: expected at least 2"),
        (lambda: induction_batch(2, 4, 10, generator=0), TypeError, "generator: expected a torch.Generator"),
        (lambda: induction_batch(2, 4, 10, generator=gen(), bos=1), TypeError, "bos: expected True or False"),
        (
            lambda: induction_batch(2, 4, 10, generator=gen(), min_half_length=5),
            ValueError,
            r"min_half_length: expected None or a length in 2..half_length \(4\)",
        ),
        (
            lambda: induction_batch(2, 4, 10, generator=gen(), min_half_length=1),
            ValueError,
            "min_half_length: expected None or a length in 2",
        ),
        (lambda: reverse_batch(2, 0, 10, generator=gen()), ValueError, "length: expected a positive int"),
        (lambda: reverse_batch(2, 3, 2, generator=gen()), ValueError, "vocab_size: expected at least 3"),
        (lambda: reverse_batch(2, 3, 9, generator=None), TypeError, "generator: expected a torch.Generator"),
    ],
)
def test_tasks_refuse_bad_arguments(call, error, fragment):
    with pytest.raises(error, match=fragment) as caught:
        call()
    assert isinstance(caught.value, InputError) and "Fix:" in str(caught.value)


# --- attention scores --------------------------------------------------------------------------------------------

L = 4
N = 2 * L + 1  # [BOS] x_1..x_4 x_1..x_4


def previous_token_pattern(n: int = N) -> torch.Tensor:
    w = torch.zeros(n, n, dtype=torch.float64)
    w[0, 0] = 1.0
    w[torch.arange(1, n), torch.arange(0, n - 1)] = 1.0  # t -> t - 1
    return w


def induction_pattern(half: int = L, offset: int = 1) -> torch.Tensor:
    n = offset + 2 * half
    w = torch.eye(n, dtype=torch.float64)  # the first copy (and BOS) attends to itself
    rows = torch.arange(offset + half, n)
    w[rows] = 0.0
    w[rows, rows - half + 1] = 1.0  # t -> t - L + 1
    return w


def causal_uniform(n: int = N) -> torch.Tensor:
    return torch.tril(torch.ones(n, n, dtype=torch.float64)) / torch.arange(1, n + 1, dtype=torch.float64)[:, None]


def test_a_previous_token_head_scores_one_on_previous_and_zero_on_induction():
    w = previous_token_pattern()[None]  # (b=1, n, n)
    assert previous_token_score(w).item() == 1.0
    assert induction_score(w, L).item() == 0.0


def test_an_induction_head_scores_one_on_induction_and_zero_on_previous():
    w = induction_pattern()[None]
    assert induction_score(w, L).item() == 1.0
    assert previous_token_score(w).item() == 0.0
    # the induction targets are exactly t - L + 1 for t = L + 1 .. 2L, i.e. keys 2 .. L + 1
    assert w[0, L + 1 :].argmax(-1).tolist() == [2, 3, 4, 5]


def test_induction_without_bos_reads_the_same_diagonal_one_position_earlier():
    w = induction_pattern(offset=0)[None]  # n = 2L
    assert induction_score(w, L, bos=False).item() == 1.0
    assert induction_score(induction_pattern(offset=1)[None, 1:, 1:], L, bos=False).item() == 1.0


def test_uniform_attention_scores_known_values():
    causal = causal_uniform()[None]
    assert previous_token_score(causal).item() == pytest.approx(sum(1 / (t + 1) for t in range(1, N)) / (N - 1))
    # second copy rows t = 5..8 give 1 / (t + 1) to key t - 3
    assert induction_score(causal, L).item() == pytest.approx((1 / 6 + 1 / 7 + 1 / 8 + 1 / 9) / 4)
    full = torch.full((1, N, N), 1 / N, dtype=torch.float64)
    assert previous_token_score(full).item() == pytest.approx(1 / N)
    assert induction_score(full, L).item() == pytest.approx(1 / N)


def test_scores_average_the_batch_and_keep_layers_and_heads_apart():
    prev, ind, uni = previous_token_pattern(), induction_pattern(), causal_uniform()
    # one layer (b=2, h=3): head 0 previous-token, head 1 induction, head 2 half induction / half uniform
    layer = torch.stack([torch.stack([prev, ind, ind]), torch.stack([prev, ind, uni])])  # (b, h, n, n)
    uniform_induction = (1 / 6 + 1 / 7 + 1 / 8 + 1 / 9) / 4
    expected = torch.tensor([0.0, 1.0, (1.0 + uniform_induction) / 2], dtype=torch.float64)
    assert torch.allclose(induction_score(layer, L), expected)
    other = layer.flip(1)  # heads in reverse order
    stacked = torch.stack([layer, other])  # (layers=2, b, h, n, n)
    scores = induction_score(stacked, L)
    assert scores.shape == (2, 3)
    assert torch.allclose(scores, torch.stack([expected, expected.flip(0)]))
    assert torch.equal(induction_score([layer, other], L), scores)
    assert torch.equal(previous_token_score([layer, other]), previous_token_score(stacked))
    assert torch.equal(previous_token_score(layer[:, 1]), previous_token_score(layer)[1])  # (b, n, n): one head


def test_scores_agree_with_a_loop_over_random_softmax_weights():
    torch.manual_seed(0)
    b, h, half = 2, 3, 5
    n = 2 * half + 1
    scores = torch.randn(b, h, n, n, dtype=torch.float64)
    weights = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf).softmax(-1)
    for head in range(h):
        prev = [weights[s, head, t, t - 1].item() for s in range(b) for t in range(1, n)]
        ind = [weights[s, head, t, t - half + 1].item() for s in range(b) for t in range(half + 1, n)]
        assert previous_token_score(weights)[head].item() == pytest.approx(sum(prev) / len(prev), abs=1e-12)
        assert induction_score(weights, half)[head].item() == pytest.approx(sum(ind) / len(ind), abs=1e-12)


def test_alignment_accuracy_counts_argmax_hits_per_head():
    task = reverse_batch(2, 5, 9, generator=gen())
    aligned = torch.eye(5, dtype=torch.float64).flip(1)  # query s -> key 4 - s
    diagonal = torch.eye(5, dtype=torch.float64)  # query s -> key s: right only at s = 2
    weights = torch.stack([aligned, diagonal])[None].expand(2, 2, 5, 5)  # (b, h, i, j)
    assert alignment_accuracy(weights, task.alignment).tolist() == [1.0, 0.2]
    per_sequence = task.alignment.expand(2, 5)  # (b, i)
    assert alignment_accuracy(weights, per_sequence).tolist() == [1.0, 0.2]
    assert alignment_accuracy(weights[:, :, :3], task.alignment[:3]).tolist() == [1.0, 1 / 3]  # i != j is fine


def weights_error(call, error, fragment):
    with pytest.raises(error, match=fragment) as caught:
        call()
    assert isinstance(caught.value, InputError) and "Fix:" in str(caught.value)


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: previous_token_score(torch.zeros(5, 5)), ValueError, r"weights: expected a tensor \(b, i, j\)"),
        (lambda: previous_token_score(torch.zeros(2, 5, 5, dtype=torch.long)), TypeError, "weights: expected a float"),
        (lambda: previous_token_score([[0.5]]), TypeError, r"weights\[0\]: expected one layer's weights"),
        (lambda: previous_token_score(torch.zeros(2, 3, 5, 4)), ValueError, "weights: expected self-attention"),
        (lambda: previous_token_score(torch.zeros(0, 3, 5, 5)), ValueError, "weights: expected at least one sequence"),
        (lambda: previous_token_score(torch.ones(2, 1, 1)), ValueError, "weights: expected at least 2 positions"),
        (lambda: previous_token_score([]), ValueError, "weights: expected a non-empty list"),
        (lambda: previous_token_score("w"), TypeError, "weights: expected a tensor"),
        (
            lambda: previous_token_score([torch.zeros(1, 2, 5, 5), torch.zeros(1, 3, 5, 5)]),
            ValueError,
            "weights: expected layers with one number of heads",
        ),
        (lambda: induction_score(torch.zeros(2, 3, 9, 9), 3), ValueError, "weights: expected 7 positions"),
        (lambda: induction_score(torch.zeros(2, 3, 9, 9), 4, bos=False), ValueError, "weights: expected 8 positions"),
        (lambda: induction_score(torch.zeros(2, 3, 3, 3), 1), ValueError, "half_length: expected at least 2"),
        (lambda: induction_score(torch.zeros(2, 3, 9, 9), 4, bos=None), TypeError, "bos: expected True or False"),
        (
            lambda: alignment_accuracy(torch.zeros(2, 3, 4, 5), torch.arange(5)),
            ValueError,
            r"alignment: expected shape \(4,\) or \(2, 4\)",
        ),
        (
            lambda: alignment_accuracy(torch.zeros(2, 3, 4, 5), torch.tensor([0, 1, 2, 5])),
            ValueError,
            "alignment: expected key positions in 0..4",
        ),
        (
            lambda: alignment_accuracy(torch.zeros(2, 3, 4, 5), torch.zeros(4)),
            TypeError,
            "alignment: expected an int64 tensor",
        ),
    ],
)
def test_scores_refuse_bad_weights(call, error, fragment):
    weights_error(call, error, fragment)


# --- losses ------------------------------------------------------------------------------------------------------


def test_per_position_loss_is_next_token_cross_entropy():
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 7, dtype=torch.float64)
    ids = torch.randint(0, 7, (2, 6))
    loss = per_position_loss(logits, ids)
    assert loss.shape == (2, 5)
    for s in range(2):
        for t in range(5):
            expected = F.cross_entropy(logits[s, t], ids[s, t + 1])
            assert loss[s, t].item() == pytest.approx(expected.item(), abs=1e-12)


def copying_logits(ids: torch.Tensor, vocab: int, rows: list[int]) -> torch.Tensor:
    """Logits 0 everywhere except +60 on the right next token at positions ``rows``."""
    logits = torch.zeros(*ids.shape, vocab, dtype=torch.float64)
    for t in rows:
        logits[torch.arange(ids.shape[0]), t, ids[:, t + 1]] = 60.0
    return logits


def test_repeated_half_loss_reads_the_predictions_of_x2_to_xL_of_the_second_copy():
    vocab = 10
    batch = induction_batch(3, L, vocab, generator=gen())
    ids = batch.ids  # (3, 9): predictions of positions 6, 7, 8 are made at rows 5, 6, 7
    uniform = torch.zeros(3, N, vocab, dtype=torch.float64)
    assert repeated_half_loss(uniform, ids, L).item() == pytest.approx(math.log(vocab))
    assert repeated_half_loss(copying_logits(ids, vocab, [5, 6, 7]), ids, L).item() < 1e-20
    # rows outside the predictable ones do not count; any of the three counts a third
    assert repeated_half_loss(copying_logits(ids, vocab, [0, 1, 2, 3, 4]), ids, L).item() == pytest.approx(
        math.log(vocab)
    )
    assert repeated_half_loss(copying_logits(ids, vocab, [5, 6]), ids, L).item() == pytest.approx(math.log(vocab) / 3)
    no_bos = induction_batch(2, L, vocab, generator=gen(), bos=False).ids  # rows 4, 5, 6 predict positions 5, 6, 7
    assert repeated_half_loss(copying_logits(no_bos, vocab, [4, 5, 6]), no_bos, L, bos=False).item() < 1e-20


def test_repeated_half_loss_is_differentiable():
    ids = induction_batch(2, 3, 6, generator=gen()).ids
    logits = torch.zeros(2, 7, 6, requires_grad=True)
    repeated_half_loss(logits, ids, 3).backward()
    assert logits.grad is not None and logits.grad[:, 4:6].abs().sum() > 0 and logits.grad[:, :4].abs().sum() == 0


def test_in_context_learning_score_is_late_minus_early():
    losses = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [5.0] * 10])
    # defaults for n = 10: early = 1, late = 9
    assert in_context_learning_score(losses).item() == pytest.approx(((0.0 - 3.0) + 0.0) / 2)
    assert in_context_learning_score(losses, early=0, late=4).item() == pytest.approx((0.5 - 4.0) / 2)
    assert in_context_learning_score(losses, early=-10, late=-1).item() == pytest.approx((0.0 - 4.0) / 2)


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda: per_position_loss(torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.long)), ValueError, "logits:"),
        (lambda: per_position_loss(torch.zeros(2, 5, 3), torch.zeros(2, 5)), TypeError, "ids: expected an int64"),
        (
            lambda: per_position_loss(torch.zeros(2, 5, 3), torch.zeros(2, 4, dtype=torch.long)),
            ValueError,
            r"ids: expected shape \(2, 5\)",
        ),
        (
            lambda: per_position_loss(torch.zeros(2, 1, 3), torch.zeros(2, 1, dtype=torch.long)),
            ValueError,
            "logits: expected at least 2 positions",
        ),
        (
            lambda: repeated_half_loss(torch.zeros(2, 9, 3), torch.zeros(2, 9, dtype=torch.long), 3),
            ValueError,
            "ids: expected 7 positions",
        ),
        (
            lambda: repeated_half_loss(torch.zeros(2, 3, 3), torch.zeros(2, 3, dtype=torch.long), 1),
            ValueError,
            "half_length: expected at least 2",
        ),
        (lambda: in_context_learning_score(torch.zeros(10)), ValueError, "per_position_loss: expected a floating"),
        (lambda: in_context_learning_score(torch.zeros(0, 10)), ValueError, "per_position_loss: expected at least"),
        (lambda: in_context_learning_score(torch.zeros(2, 10), early=10), ValueError, r"early: expected a position"),
        (lambda: in_context_learning_score(torch.zeros(2, 10), late=-11), ValueError, "late: expected a position"),
        (lambda: in_context_learning_score(torch.zeros(2, 10), early=5, late=5), ValueError, "late: expected a pos"),
        (lambda: in_context_learning_score(torch.zeros(2, 10), early=1.5), TypeError, "early: expected an int"),
    ],
)
def test_losses_refuse_bad_arguments(call, error, fragment):
    weights_error(call, error, fragment)


# --- the training loop -------------------------------------------------------------------------------------------

VOCAB = 7


class Bigram(nn.Module):
    """Embedding + linear: the next token from the current one alone."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))  # (b, n) -> (b, n, vocab)


def counting_batch(generator: torch.Generator) -> torch.Tensor:
    """Sequences that count up modulo VOCAB from a random start: the next token is (token + 1) % VOCAB."""
    start = torch.randint(0, VOCAB, (5, 1), generator=generator)
    return (start + torch.arange(6)) % VOCAB  # (b=5, n=6)


def next_token_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return per_position_loss(model(ids), ids).mean()


def fresh_model() -> Bigram:
    torch.manual_seed(0)
    return Bigram()


def run(model: nn.Module | None = None, **overrides):
    options = dict(steps=40, lr=0.05, seed=0, loss_fn=next_token_loss, log_every=10)
    options.update(overrides)
    return train(model or fresh_model(), counting_batch, **options)


def test_training_learns_a_deterministic_task():
    model = fresh_model()
    history = run(model)
    assert [entry["step"] for entry in history] == [10, 20, 30, 40]
    losses = [entry["loss"] for entry in history]
    assert losses[0] > 0.5 and losses[-1] < 0.1 * losses[0]
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False))
    assert all(entry["tokens_per_s"] > 0 for entry in history)
    ids = counting_batch(gen(9))
    assert torch.equal(model(ids).argmax(-1)[:, :-1], ids[:, 1:])  # it predicts every next token


def test_the_same_seed_gives_the_same_losses_exactly():
    first = [entry["loss"] for entry in run()]
    assert first == [entry["loss"] for entry in run()]
    assert first != [entry["loss"] for entry in run(seed=1)]


def test_training_puts_back_the_global_generator_and_the_models_mode():
    model = fresh_model().eval()
    state = torch.get_rng_state()
    run(model, steps=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert not model.training


def test_on_log_measures_in_eval_mode_without_gradients_and_joins_the_history():
    seen = []

    def on_log(model, step):
        seen.append((step, model.training, torch.is_grad_enabled()))
        head_scores = torch.tensor([[0.25, 0.5], [1.0, 0.0]])
        return {"probe": float(step) / 2, "per_head": head_scores}

    model = fresh_model()
    history = run(model, steps=12, log_every=5, on_log=on_log)
    assert seen == [(5, False, False), (10, False, False), (12, False, False)]
    assert [entry["step"] for entry in history] == [5, 10, 12]
    assert history[2]["probe"] == 6.0 and history[2]["per_head"] == [[0.25, 0.5], [1.0, 0.0]]
    assert model.training


def test_a_loss_that_stops_being_finite_stops_the_run_before_the_update():
    model = fresh_model()
    before = [parameter.clone() for parameter in model.parameters()]

    def exploding(model, ids):
        return next_token_loss(model, ids) * math.inf

    with pytest.raises(ValueError, match=r"lr: expected a learning rate at which the loss stays finite.*update 1"):
        run(model, loss_fn=exploding)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(
    ("overrides", "error", "fragment"),
    [
        ({"steps": 0}, ValueError, "steps: expected a positive int"),
        ({"log_every": 0}, ValueError, "log_every: expected a positive int"),
        ({"lr": 0.0}, ValueError, "lr: expected a finite number > 0"),
        ({"lr": math.nan}, ValueError, "lr: expected a finite number > 0"),
        ({"lr": "1e-3"}, TypeError, "lr: expected a number"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay: expected a finite number >= 0"),
        ({"max_grad_norm": 0}, ValueError, "max_grad_norm: expected a finite number > 0"),
        ({"seed": -1}, ValueError, "seed: expected an int in"),
        ({"seed": 1.0}, TypeError, "seed: expected an int"),
        ({"loss_fn": None}, TypeError, "loss_fn: expected a function"),
        ({"on_log": 3}, TypeError, "on_log: expected a function"),
        ({"loss_fn": lambda model, ids: model(ids)}, TypeError, "loss_fn: expected a function returning a scalar"),
        ({"loss_fn": lambda model, ids: torch.tensor(1.0)}, TypeError, "loss_fn: expected a function returning"),
        ({"on_log": lambda model, step: {"loss": 1.0}}, ValueError, "on_log: expected a dict with string keys"),
        ({"on_log": lambda model, step: {"name": "x"}}, TypeError, "on_log: expected a dict of numbers"),
        ({"on_log": lambda model, step: [1.0]}, TypeError, "on_log: expected a function returning a dict"),
    ],
)
def test_train_refuses_bad_arguments(overrides, error, fragment):
    with pytest.raises(error, match=fragment) as caught:
        run(**{"steps": 2, "log_every": 1, **overrides})
    assert isinstance(caught.value, InputError)


def test_train_refuses_what_is_not_a_trainable_model_or_an_uncountable_batch():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        train("model", counting_batch, steps=1, lr=0.1, seed=0, loss_fn=next_token_loss)
    frozen = fresh_model().requires_grad_(False)
    with pytest.raises(ValueError, match="model: expected a module with trainable parameters"):
        train(frozen, counting_batch, steps=1, lr=0.1, seed=0, loss_fn=next_token_loss)
    with pytest.raises(TypeError, match="count_tokens: expected a function counting"):
        train(
            fresh_model(),
            lambda generator: {"ids": counting_batch(generator)},
            steps=1,
            lr=0.1,
            seed=0,
            loss_fn=lambda model, batch: next_token_loss(model, batch["ids"]),
        )


def test_count_tokens_reads_the_tasks_batches():
    assert count_tokens(induction_batch(3, 4, 10, generator=gen())) == 3 * 9
    assert count_tokens(reverse_batch(3, 5, 10, generator=gen())) == 3 * 5 * 2  # source and decoder input
    assert count_tokens((torch.zeros(2, 7), torch.zeros(2))) == 14 and count_tokens(torch.zeros(4, 3)) == 12
    with pytest.raises(TypeError, match="count_tokens: expected a function counting"):
        count_tokens({"ids": torch.zeros(2, 3)})


def test_history_round_trips_through_json(tmp_path):
    history = run(steps=4, log_every=2, on_log=lambda model, step: {"heads": torch.tensor([0.5, math.nan])})
    history[0]["tokens_per_s"] = math.inf
    path = history_to_json(history, tmp_path / "run" / "history.json", meta={"task": "counting", "seed": 0})
    data = json.loads((tmp_path / "run" / "history.json").read_text())
    assert path.endswith("history.json")
    assert data["meta"] == {"task": "counting", "seed": 0}
    assert [entry["loss"] for entry in data["history"]] == [entry["loss"] for entry in history]
    assert data["history"][0]["tokens_per_s"] is None and data["history"][1]["heads"] == [0.5, None]


def test_history_to_json_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="path: expected a file name ending in .json"):
        history_to_json([], tmp_path / "history.txt")
    with pytest.raises(ValueError, match="history: expected a list of dicts"):
        history_to_json({"step": 1}, tmp_path / "history.json")
    with pytest.raises(ValueError, match="history: expected numbers and lists of numbers"):
        history_to_json([{"step": 1, "loss": object()}], tmp_path / "history.json")
    assert not (tmp_path / "history.json").exists()


def test_plot_history_draws_every_logged_curve(tmp_path):
    history = run(steps=6, log_every=2, on_log=lambda model, step: {"induction": [[0.1 * step, 0.2], [0.3, 0.4]]})
    path = plot_history(history, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.endswith("curves.png")
    with pytest.raises(ValueError, match="keys: expected keys every log has"):
        plot_history(history, tmp_path / "other.png", keys=["previous"])
    with pytest.raises(ValueError, match="path: expected a file name ending in .png"):
        plot_history(history, tmp_path / "curves.pdf")
    with pytest.raises(ValueError, match="history: expected a non-empty list"):
        plot_history([], tmp_path / "empty.png")
    ragged = [dict(history[0], induction=[0.1]), dict(history[1], induction=[0.1, 0.2])]
    with pytest.raises(ValueError, match="history: expected 'induction' with one size at every log"):
        plot_history(ragged, tmp_path / "ragged.png")


def test_plot_history_labels_one_curve_per_layer_and_head():
    history = [
        {"step": 1, "loss": 2.0, "prev": [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], "one": [0.1, 0.2], "ratio": 0.5},
        {"step": 2, "loss": 1.0, "prev": [[0.7, 0.8, 0.9], [1.0, 0.0, 0.5]], "one": [0.3, 0.4], "ratio": 0.25},
    ]
    curves, labels = loop._series(history, "prev")
    assert labels == ["L0 h0", "L0 h1", "L0 h2", "L1 h0", "L1 h1", "L1 h2"]
    assert curves[3] == [0.4, 1.0] and curves[2] == [0.3, 0.9]
    assert loop._series(history, "one") == ([[0.1, 0.3], [0.2, 0.4]], ["h0", "h1"])
    assert loop._series(history, "ratio") == ([[0.5, 0.25]], [None])


def test_plot_history_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    history = run(steps=2, log_every=1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'multihead\[plots\]'"):
        plot_history(history, tmp_path / "curves.png")
    assert not (tmp_path / "curves.png").exists()


def test_prefix_matching_equals_induction_score_for_one_length_and_reads_each_sequences_own():
    from multihead.lab.train.scores import prefix_matching_score, repeated_tokens_loss

    generator = torch.Generator().manual_seed(3)
    fixed = induction_batch(5, 4, 11, generator=generator)
    weights = torch.softmax(torch.randn(5, 3, 9, 9, generator=generator), dim=-1)  # (b, h, n, n)
    assert torch.allclose(prefix_matching_score(weights, fixed.previous), induction_score(weights, 4))
    logits = torch.randn(5, 9, 11, generator=generator)
    assert torch.allclose(
        repeated_tokens_loss(logits, fixed.ids, fixed.repeated), repeated_half_loss(logits, fixed.ids, 4)
    )
    varied = induction_batch(2, 5, 11, generator=generator, min_half_length=2)
    perfect = torch.zeros(2, 11, 11)
    perfect[..., 0] = 1.0  # every row on BOS ...
    for b in range(2):
        for t in range(11):
            p = int(varied.previous[b, t])
            if p >= 0:  # ... but repeated tokens on the token after their earlier occurrence
                perfect[b, t] = 0.0
                perfect[b, t, p + 1] = 1.0
    assert float(prefix_matching_score(perfect, varied.previous)) == 1.0
    assert float(prefix_matching_score(perfect.roll(1, dims=-1), varied.previous)) == 0.0
    varied_logits = torch.randn(2, 11, 11, generator=generator)
    expected = per_position_loss(varied_logits, varied.ids)[varied.repeated[:, :-1]].mean()
    assert torch.allclose(repeated_tokens_loss(varied_logits, varied.ids, varied.repeated), expected)
    with pytest.raises(InputError, match="repeated: "):
        repeated_tokens_loss(varied_logits, varied.ids, varied.repeated.long())


@pytest.mark.parametrize(
    ("previous", "fragment"),
    [
        (torch.full((1, 5), -1), "repeated token"),
        (torch.tensor([[-1, -1, -1, 2, -1]]), "at least 2 before"),
        (torch.tensor([[-1, -1, -1, -2, -1]]), "at least 2 before"),
        (torch.zeros(1, 4, dtype=torch.long), r"\(1, 5\)"),
        (torch.zeros(1, 5), "int64"),
    ],
)
def test_prefix_matching_refuses_a_bad_previous(previous, fragment):
    from multihead.lab.train.scores import prefix_matching_score

    with pytest.raises(InputError, match=f"previous: .*{fragment}"):
        prefix_matching_score(torch.full((1, 5, 5), 0.2), previous)
