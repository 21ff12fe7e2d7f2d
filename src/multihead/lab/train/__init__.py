"""Train small models on synthetic tasks and measure what their heads learn (behind `multihead train`).

    generator = torch.Generator().manual_seed(0)
    batch = multihead.lab.train.induction_batch(8, 16, 32, generator=generator)   # ids (8, 33): [BOS] x x
    multihead.lab.train.induction_score(rec.weights(1), half_length=16)          # (h,): attention to t - L + 1
    history = multihead.lab.train.train(model, make_batch, steps=500, lr=1e-3, seed=0, loss_fn=loss_fn)

The modules: tasks (batches generated from a seed), scores (previous-token, induction and alignment scores per
head; per-position, repeated-half and in-context learning losses), loop (a model-agnostic AdamW loop, its JSON log
and PNG curves), symmetry (why the heads of a layer do not all learn the same thing: make_heads_identical,
heads_divergence, symmetry_experiment, and run_symmetry behind ``multihead train symmetry``), and the experiments
behind ``multihead train``: induction (a decoder on repeated random segments: run_induction) and reverse (an
encoder-decoder's cross-attention alignment: run_reverse).
"""

from multihead.lab.extra import require_lab

require_lab("multihead.lab.train")  # one line naming the extra, before any lab import fails

from multihead.lab.models.tasks import BOS, InductionBatch, ReverseBatch, induction_batch, reverse_batch
from multihead.lab.train.induction import InductionRun, InductionSettings, run_induction
from multihead.lab.train.loop import count_tokens, history_to_json, plot_history, train
from multihead.lab.train.reverse import ReverseRun, ReverseSettings, run_reverse
from multihead.lab.train.scores import (
    alignment_accuracy,
    in_context_learning_score,
    induction_score,
    per_position_loss,
    previous_token_score,
    repeated_half_loss,
)
from multihead.lab.train.symmetry import (
    SymmetryRun,
    head_parameter_difference,
    heads_divergence,
    make_heads_identical,
    run_symmetry,
    symmetry_experiment,
)

__all__ = [
    "InductionRun",
    "InductionSettings",
    "run_induction",
    "ReverseRun",
    "ReverseSettings",
    "run_reverse",
    "BOS",
    "InductionBatch",
    "ReverseBatch",
    "induction_batch",
    "reverse_batch",
    "previous_token_score",
    "induction_score",
    "alignment_accuracy",
    "per_position_loss",
    "repeated_half_loss",
    "in_context_learning_score",
    "train",
    "history_to_json",
    "plot_history",
    "count_tokens",
    "make_heads_identical",
    "head_parameter_difference",
    "heads_divergence",
    "symmetry_experiment",
    "SymmetryRun",
    "run_symmetry",
]
