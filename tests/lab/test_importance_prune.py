"""prune_by_importance: the pruning curve measured on copies, then the least important heads removed from the model;
a mistake refused before the model is touched (multihead.lab.inspect.importance)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from multihead._errors import InputError
from multihead._userfiles import from_options
from multihead.lab.inspect import PruneResult, prune_by_importance
from multihead.lab.inspect.importance import HeadImportance, check_prune_fraction, fidelity
from multihead.lab.models import Encoder, EncoderConfig
from multihead.lab.models.loading import Tokenizer, find_model_dir

TEXTS = ["The bank was full of money.", "We sat on the river bank.", "It rained all night."]
# 2 layers x 4 heads, every score distinct: least important first (1, 2) 0.0, (0, 1) 1.0, (1, 0) 2.0, (0, 3) 3.0, ...
SCORES = torch.tensor([[5.0, 1.0, 7.0, 3.0], [2.0, 8.0, 0.0, 6.0]], dtype=torch.float64)
FAST = {"fractions": [0.0], "repeats": 1}  # the curve's speed is not under test: one timing, one other fraction


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors: one thread is faster and immune to a busy machine."""


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(find_model_dir() / "tokenizer.json", max_length=32)


@pytest.fixture
def encoder(tokenizer) -> Encoder:
    """A random encoder of 2 layers x 4 heads (8 wide) on the real tokenizer: a new one per test (pruning changes
    it)."""
    torch.manual_seed(0)
    config = EncoderConfig(hidden_size=8, num_layers=2, num_heads=4, intermediate_size=16, max_positions=32)
    return Encoder(config, tokenizer=tokenizer, name="tiny").eval()


def snapshot(model: Encoder) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    return copy.deepcopy(model.head_ids), {name: value.clone() for name, value in model.state_dict().items()}


def assert_unchanged(model: Encoder, before) -> None:
    head_ids, state = before
    assert model.head_ids == head_ids
    now = model.state_dict()
    assert now.keys() == state.keys() and all(torch.equal(now[name], state[name]) for name in state)


def test_removes_exactly_the_lowest_scoring_heads_at_the_fraction(encoder):
    reference = encoder.encode(TEXTS)
    result = prune_by_importance(encoder, TEXTS, SCORES, 0.25, **FAST)  # round(0.25 * 8) = 2 heads
    assert isinstance(result, PruneResult)
    assert result.plan == {1: [2], 0: [1]}  # the two lowest scores, least important first
    assert result.heads_removed == 2 and result.chosen["heads_removed"] == 2
    assert encoder.head_ids == [[0, 2, 3], [0, 1, 3]]
    assert [len(layer.attention.q_proj.weight) // 2 for layer in encoder.blocks] == [3, 3]  # head_dim 2: 3 heads
    # the curve: the fraction asked for among the others, each row measured on a copy
    assert [row["fraction"] for row in result.curve] == [0.0, 0.25]
    assert result.chosen is result.curve[1] and result.chosen["removed"] == [(1, 2), (0, 1)]
    assert result.curve[0]["heads_removed"] == 0 and result.curve[0]["cosine"] == pytest.approx(1.0)
    # the model now encodes as the chosen row measured its pruned copy
    assert fidelity(reference, encoder.encode(TEXTS))["cosine"] == pytest.approx(result.chosen["cosine"], abs=1e-6)


def test_a_layer_keeps_its_most_important_head(encoder):
    result = prune_by_importance(encoder, TEXTS, HeadImportance(SCORES, "test scores"), 0.9, **FAST)
    # round(0.9 * 8) = 7 asked; a layer keeps its last head, so 6 go and each layer keeps its best one
    assert result.heads_removed == 6 and result.chosen["heads_removed"] == 6
    assert encoder.head_ids == [[2], [1]]


def test_fraction_zero_removes_nothing(encoder):
    before = snapshot(encoder)
    result = prune_by_importance(encoder, TEXTS, SCORES, 0.0, fractions=[0.5], repeats=1)
    assert result.plan == {} and result.heads_removed == 0
    assert [row["fraction"] for row in result.curve] == [0.0, 0.5]
    assert_unchanged(encoder, before)


def test_a_pruned_model_is_pruned_further_by_its_checkpoint_numbers(encoder):
    encoder.prune_heads({1: [2]})  # its scores: NaN for the head gone, numbers kept for the others
    scores = SCORES.clone()
    scores[1, 2] = math.nan
    result = prune_by_importance(encoder, TEXTS, scores, 0.3, **FAST)  # round(0.3 * 7) = 2
    assert result.plan == {0: [1], 1: [0]}
    assert encoder.head_ids == [[0, 2, 3], [1, 3]]


@pytest.mark.parametrize(
    ("fraction", "kind", "got"),
    [
        (1.0, ValueError, "got 1.0"),
        (-0.1, ValueError, "got -0.1"),
        (math.nan, ValueError, "got nan"),
        (True, TypeError, "got bool True"),
        ("0.3", TypeError, "got str '0.3'"),
    ],
)
def test_a_bad_fraction_is_refused_before_the_model_is_touched(encoder, fraction, kind, got):
    before = snapshot(encoder)
    with pytest.raises(kind) as raised:
        prune_by_importance(encoder, TEXTS, SCORES, fraction, **FAST)
    assert isinstance(raised.value, InputError) and raised.value.argument == "fraction"
    assert str(raised.value).startswith(f"fraction: expected a fraction of all heads in [0, 1), {got}. Fix:")
    assert_unchanged(encoder, before)


@pytest.mark.parametrize(
    ("arguments", "kind", "name", "fragment"),
    [
        ({"scores": SCORES[:1]}, ValueError, "scores", "(layers, heads) = (2, 4)"),
        ({"scores": SCORES.tolist()}, TypeError, "scores", "a float tensor (2, 4)"),
        ({"scores": torch.where(SCORES == 8.0, math.nan, SCORES)}, ValueError, "scores", "NaN for a head still there"),
        ({"fractions": [0.2, 1.5]}, ValueError, "fractions", "got 1.5"),
        ({"fractions": 0.2}, TypeError, "fractions", "a sequence of numbers"),
        ({"texts": ["one text"]}, ValueError, "texts", "at least two texts"),
    ],
)
def test_bad_arguments_are_refused_before_the_model_is_touched(encoder, arguments, kind, name, fragment):
    before = snapshot(encoder)
    given = {"texts": TEXTS, "scores": SCORES, "fractions": [0.0], **arguments}
    with pytest.raises(kind, match=name) as raised:
        prune_by_importance(encoder, given["texts"], given["scores"], 0.25, fractions=given["fractions"], repeats=1)
    assert raised.value.argument == name and fragment in str(raised.value)
    assert_unchanged(encoder, before)


def test_a_model_without_prune_heads_is_refused():
    with pytest.raises(TypeError, match="model: expected a model whose heads can be removed"):
        prune_by_importance(torch.nn.Linear(2, 2), TEXTS, SCORES, 0.25)


def test_the_command_line_says_the_fraction_check_in_its_own_words():
    assert check_prune_fraction(0.25) == 0.25 and check_prune_fraction(0) == 0.0
    with pytest.raises(ValueError) as raised, from_options({"fraction": "--fraction"}):
        check_prune_fraction(1.0)
    assert str(raised.value) == (
        "--fraction: expected a fraction of all heads in [0, 1), got 1.0. Fix: pass e.g. --fraction 0.3"
    )
