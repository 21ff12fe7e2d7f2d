"""What a trained head does, in numbers: previous-token and induction scores, alignment, in-context learning.

The attention scores follow TransformerLens' definitions (Nanda and Bloom, ``TransformerLens``: the Main Demo's
induction score reads the diagonal ``L - 1`` below the main one on a repeated sequence, and the previous-token
head pattern of its ``head_detector`` the diagonal just below the main one); the in-context learning score is
Olsson et al. 2022's ("In-context Learning and Induction Heads", Anthropic): the loss late in the context minus the
loss early in it.

Attention weights come in the layout :func:`multihead.lab.inspect.capture` records, and every score is the mean over the
batch and the positions it reads, per head:

    weights (b, i, j)               one head (``rec.weights(layer, head)``)   -> score ()
    weights (b, h, i, j)            one layer (``rec.weights(layer)``)        -> score (h,)
    weights (layers, b, h, i, j)    a stack of layers                         -> score (layers, h)
    [weights (b, h, i, j), ...]     a list of layers                          -> score (layers, h)

Positions use the indexing of :mod:`multihead.lab.models.tasks`: with bos, position 0 is BOS and the two copies of the
segment x_1..x_L sit at 1..L and L+1..2L; without it they sit at 0..L-1 and L..2L-1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from multihead._errors import bad_argument, describe, positive_int

__all__ = [
    "previous_token_score",
    "induction_score",
    "prefix_matching_score",
    "repeated_tokens_loss",
    "alignment_accuracy",
    "per_position_loss",
    "repeated_half_loss",
    "in_context_learning_score",
]

Weights = torch.Tensor | Sequence[torch.Tensor]

_LAYOUTS = "(b, i, j), (b, h, i, j), (layers, b, h, i, j) or a list of (b, h, i, j)"


def _heads_first(name: str, weights: object, *, square: bool) -> torch.Tensor:
    """``weights`` as (..., b, i, j) with the head (and layer) axes leading, checked."""
    if not isinstance(weights, torch.Tensor):
        raise bad_argument(name, f"a tensor {_LAYOUTS}", describe(weights), "pass recorded weights", kind=TypeError)
    if not weights.is_floating_point():
        raise bad_argument(
            name, "a floating tensor of attention weights", weights.dtype, f"pass {name}.float()", kind=TypeError
        )
    if weights.ndim not in (3, 4, 5):
        raise bad_argument(name, f"a tensor {_LAYOUTS}", describe(weights), "pass weights in one of those layouts")
    if weights.shape[-3] == 0 if weights.ndim == 3 else weights.shape[-4] == 0:
        raise bad_argument(name, "at least one sequence in the batch", describe(weights), "pass a non-empty batch")
    if square and weights.shape[-1] != weights.shape[-2]:
        raise bad_argument(
            name,
            "self-attention weights with as many query rows i as keys j",
            describe(weights),
            "record every query row (capture(..., queries=None)) of a self-attention layer",
        )
    if weights.ndim == 4:
        return weights.movedim(1, 0)  # (b, h, i, j) -> (h, b, i, j)
    if weights.ndim == 5:
        return weights.movedim(2, 1)  # (layers, b, h, i, j) -> (layers, h, b, i, j)
    return weights


def _per_head(
    name: str, weights: object, score: Callable[[torch.Tensor], torch.Tensor], *, square: bool = True
) -> torch.Tensor:
    """Apply ``score`` ((..., b, i, j) -> (..., b)) and average over the batch, per layer and head."""
    if isinstance(weights, (list, tuple)):
        if not weights:
            raise bad_argument(name, "a non-empty list of per-layer weights", "[]", "pass one tensor per layer")
        per_layer = []
        for index, layer in enumerate(weights):
            if not isinstance(layer, torch.Tensor) or layer.ndim != 4:
                raise bad_argument(
                    f"{name}[{index}]",
                    "one layer's weights (b, h, i, j)",
                    describe(layer),
                    "pass rec.weights(layer) for each layer",
                    kind=TypeError if not isinstance(layer, torch.Tensor) else ValueError,
                )
            per_layer.append(_per_head(f"{name}[{index}]", layer, score, square=square))
        heads = {len(layer) for layer in per_layer}
        if len(heads) > 1:
            raise bad_argument(
                name,
                "layers with one number of heads (to stack the scores as (layers, h))",
                f"head counts {[len(layer) for layer in per_layer]}",
                "score the layers one by one",
            )
        return torch.stack(per_layer)  # (layers, h)
    tensor = _heads_first(name, weights, square=square)  # (..., b, i, j)
    return score(tensor).mean(-1)  # (...,)


def _induction_layout(half_length: object, bos: object) -> tuple[int, int]:
    """The checked (L, index of x_1) of an induction batch: L >= 2, and x_1 at 1 after a BOS token, else 0."""
    length = positive_int("half_length", half_length)
    if length < 2:
        raise bad_argument("half_length", "at least 2", length, "pass the half_length the batch was made with")
    if not isinstance(bos, bool):
        raise bad_argument("bos", "True or False", describe(bos), "pass bos=True or bos=False", kind=TypeError)
    return length, int(bos)


def previous_token_score(weights: Weights) -> torch.Tensor:
    """Mean attention from each position t to t - 1, over t = 1 .. n - 1 (TransformerLens' previous-token score).

    A head that always attends to the previous token scores 1; uniform causal attention scores the mean of
    1 / (t + 1) over t = 1 .. n - 1; uniform attention over all n keys scores 1 / n.

    Args:
        weights: attention weights, (b, n, n), (b, h, n, n), (layers, b, h, n, n) or a list of (b, h, n, n), n >= 2.

    Returns:
        The score per head: (), (h,) or (layers, h).
    """

    def score(w: torch.Tensor) -> torch.Tensor:  # (..., b, n, n) -> (..., b)
        n = w.shape[-1]
        if n < 2:
            raise bad_argument("weights", "at least 2 positions", n, "pass a sequence of two tokens or more")
        return w.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)  # entries w[t, t - 1], t = 1..n-1

    return _per_head("weights", weights, score)


def induction_score(weights: Weights, half_length: int, *, bos: bool = True) -> torch.Tensor:
    """Mean attention from each position t of the second copy to t - L + 1 (TransformerLens' induction score).

    On ``[BOS] x_1..x_L x_1..x_L`` (:func:`multihead.lab.models.tasks.induction_batch`) the second copy is at positions
    t = L + 1 .. 2L (with bos; L .. 2L - 1 without). Position t holds the token whose previous occurrence is at
    t - L; an induction head attends to the token that came right after it, at key position t - L + 1 (in both
    indexings). TransformerLens reads the same diagonal (``pattern.diagonal(offset=1 - L)``) but averages it over
    every row it crosses, which also counts the two last rows of the first copy (L - 1 and L with bos) whose keys
    (0 and 1) are no induction target; this score averages over the second copy only.

    A perfect induction head scores 1, a perfect previous-token head 0 (t - 1 is never t - L + 1 for L >= 3;
    for L = 2 the two coincide), uniform attention over all n keys 1 / n.

    Args:
        weights: attention weights on an induction batch, (b, n, n), (b, h, n, n), (layers, b, h, n, n) or a list of
            (b, h, n, n), with n = 2L + 1 with bos, 2L without.
        half_length: L >= 2, the length of the repeated segment.
        bos: whether the sequences start with a BOS token.

    Returns:
        The score per head: (), (h,) or (layers, h).
    """
    half_length, offset = _induction_layout(half_length, bos)
    expected = offset + 2 * half_length

    def score(w: torch.Tensor) -> torch.Tensor:  # (..., b, n, n) -> (..., b)
        n = w.shape[-1]
        if n != expected:
            raise bad_argument(
                "weights",
                f"{expected} positions ({'BOS + ' if bos else ''}2 x half_length {half_length})",
                f"{n} positions",
                "pass the half_length and bos the induction batch was made with",
            )
        rows = torch.arange(offset + half_length, n, device=w.device)  # the second copy
        return w[..., rows, rows - half_length + 1].mean(-1)  # entries w[t, t - L + 1]

    return _per_head("weights", weights, score)


def _previous(previous: object, b: int, n: int) -> torch.Tensor:
    if not isinstance(previous, torch.Tensor) or previous.dtype != torch.int64 or tuple(previous.shape) != (b, n):
        raise bad_argument(
            "previous",
            f"an int64 tensor ({b}, {n}): each position's earlier occurrence, or -1",
            describe(previous),
            "pass the induction batch's previous",
        )
    positions = torch.arange(n, device=previous.device)
    if bool(((previous >= positions - 1) & (previous >= 0)).any()) or bool((previous < -1).any()):
        raise bad_argument(
            "previous",
            "positions -1, or at least 2 before their own (an earlier occurrence with a token after it)",
            "a position that is not",
            "pass the induction batch's previous",
        )
    return previous


def prefix_matching_score(weights: Weights, previous: torch.Tensor) -> torch.Tensor:
    """Mean attention from each repeated token to the token after its earlier occurrence, on batches of any
    repeat lengths (Olsson et al. 2022's prefix matching; :func:`induction_score` with one L per sequence).

    Position t with ``previous[b, t] = p >= 0`` holds the token seen at p; a prefix-matching head attends to key
    p + 1. With one L for the batch this is :func:`induction_score` (p = t - L). Repeats of several lengths keep a
    head that attends at a fixed offset from scoring: with one L, a single rotary layer that learned the offset
    L - 1 scores as an induction head without matching anything.

    Args:
        weights: self-attention weights (b, n, n), (b, h, n, n), (layers, b, h, n, n) or a list of (b, h, n, n).
        previous: (b, n) int64, the batch's :attr:`~multihead.lab.models.tasks.InductionBatch.previous` (-1: not a
            repeat).

    Returns:
        The score per head: (), (h,) or (layers, h).
    """

    def score(w: torch.Tensor) -> torch.Tensor:  # (..., b, n, n) -> (..., b)
        b, n = w.shape[-3], w.shape[-1]
        earlier = _previous(previous, b, n).to(w.device)
        repeated = earlier >= 0  # (b, n)
        counts = repeated.sum(-1)  # (b,)
        if bool((counts == 0).any()):
            raise bad_argument("previous", "a repeated token in every sequence", describe(previous), "pass a batch")
        keys = (earlier + 1).clamp(min=0)  # (b, n): the token after the earlier occurrence
        picked = w.gather(-1, keys.expand(*w.shape[:-1]).unsqueeze(-1)).squeeze(-1)  # (..., b, n): w[t, p + 1]
        return (picked * repeated).sum(-1) / counts

    return _per_head("weights", weights, score)


def repeated_tokens_loss(logits: torch.Tensor, ids: torch.Tensor, repeated: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the predictions an induction head makes possible, for repeats of any
    lengths: the prediction made at a repeated token (``repeated[b, t]``) of the token after it, t < n - 1
    (:func:`repeated_half_loss` with one L per sequence).

    Args:
        logits: (b, n, vocab); ids: (b, n) int64; repeated: (b, n) bool, the batch's ``repeated``.

    Returns:
        A scalar tensor (differentiable).
    """
    logits, ids = _logits_and_ids(logits, ids)
    if not isinstance(repeated, torch.Tensor) or repeated.dtype != torch.bool or repeated.shape != ids.shape:
        raise bad_argument(
            "repeated", f"a bool tensor {tuple(ids.shape)}", describe(repeated), "pass the induction batch's repeated"
        )
    chosen = repeated[:, :-1]  # entry t predicts token t + 1
    if not bool(chosen.any()):
        raise bad_argument("repeated", "a repeated token before the last position", "none", "pass a batch")
    return per_position_loss(logits, ids)[chosen].mean()


def alignment_accuracy(weights: Weights, alignment: torch.Tensor) -> torch.Tensor:
    """Share of query positions whose most-attended key is the expected one (cross-attention alignment).

    Args:
        weights: cross-attention weights, target positions as queries i and source positions as keys j:
            (b, i, j), (b, h, i, j), (layers, b, h, i, j) or a list of (b, h, i, j).
        alignment: (i,) or (b, i) int64, the source position each query position should attend to
            (:attr:`multihead.lab.models.tasks.ReverseBatch.alignment`).

    Returns:
        The accuracy in [0, 1] per head: (), (h,) or (layers, h).
    """
    if not isinstance(alignment, torch.Tensor) or alignment.dtype not in (torch.int64, torch.int32):
        raise bad_argument(
            "alignment", "an int64 tensor (i,) or (b, i)", describe(alignment), "pass batch.alignment", kind=TypeError
        )

    def score(w: torch.Tensor) -> torch.Tensor:  # (..., b, i, j) -> (..., b)
        b, i, j = w.shape[-3:]
        if alignment.shape not in ((i,), (b, i)):
            raise bad_argument(
                "alignment",
                f"shape ({i},) or ({b}, {i}) to match the weights' (b, i)",
                describe(alignment),
                "pass one source position per query row",
            )
        if alignment.numel() and not bool(((alignment >= 0) & (alignment < j)).all()):
            raise bad_argument(
                "alignment", f"key positions in 0..{j - 1}", alignment.tolist(), "pass positions of the source"
            )
        hits = w.argmax(-1) == alignment.to(w.device)  # (..., b, i)
        return hits.to(w.dtype).mean(-1)

    return _per_head("weights", weights, score, square=False)


def _logits_and_ids(logits: object, ids: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or not logits.is_floating_point():
        raise bad_argument(
            "logits", "a floating tensor (b, n, vocab)", describe(logits), "pass the model's output logits"
        )
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.long:
        raise bad_argument("ids", "an int64 tensor (b, n)", describe(ids), "pass the batch's ids", kind=TypeError)
    if ids.shape != logits.shape[:2]:
        raise bad_argument(
            "ids",
            f"shape {tuple(logits.shape[:2])} (the logits' (b, n))",
            describe(ids),
            "pass the ids the logits were computed from",
        )
    if logits.shape[1] < 2:
        raise bad_argument("logits", "at least 2 positions", describe(logits), "pass a sequence of two tokens or more")
    return logits, ids


def per_position_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy at each position: entry t is the loss of predicting ``ids[:, t + 1]`` from
    ``logits[:, t]``.

    Args:
        logits: (b, n, vocab) floating.
        ids: (b, n) int64, the tokens the logits were computed from.

    Returns:
        (b, n - 1), in nats.
    """
    logits, ids = _logits_and_ids(logits, ids)
    b, n, vocab = logits.shape
    loss = F.cross_entropy(logits[:, :-1].reshape(b * (n - 1), vocab), ids[:, 1:].reshape(-1), reduction="none")
    return loss.view(b, n - 1)  # (b * (n - 1),) -> (b, n - 1)


def repeated_half_loss(logits: torch.Tensor, ids: torch.Tensor, half_length: int, *, bos: bool = True) -> torch.Tensor:
    """Mean next-token cross-entropy over the predictions of the second copy that an induction head makes possible.

    On ``[BOS] x_1..x_L x_1..x_L`` these are the predictions of the second copy's x_2..x_L (positions L + 2 .. 2L
    with bos, L + 1 .. 2L - 1 without), each made from the position before it. The second copy's x_1 is left out:
    nothing before it says the segment is about to repeat, so no head can predict it. A model that copies
    perfectly drives this loss to 0; one that does not stays near log(vocab_size - 1).

    Args:
        logits: (b, n, vocab) floating, n = 2L + 1 with bos, 2L without.
        ids: (b, n) int64, the induction batch's ids.
        half_length: L >= 2.
        bos: whether the sequences start with a BOS token.

    Returns:
        A scalar tensor (differentiable: it can be trained on).
    """
    logits, ids = _logits_and_ids(logits, ids)
    half_length, offset = _induction_layout(half_length, bos)
    if ids.shape[1] != offset + 2 * half_length:
        raise bad_argument(
            "ids",
            f"{offset + 2 * half_length} positions ({'BOS + ' if bos else ''}2 x half_length {half_length})",
            f"{ids.shape[1]} positions",
            "pass the half_length and bos the induction batch was made with",
        )
    loss = per_position_loss(logits, ids)  # (b, n - 1); entry t predicts token t + 1
    start = offset + half_length  # predicts the token at offset + L + 1: the second copy's x_2
    return loss[:, start:].mean()


def in_context_learning_score(
    per_position_loss: torch.Tensor, early: int | None = None, late: int | None = None
) -> torch.Tensor:
    """The loss late in the context minus the loss early in it, averaged over the batch (Olsson et al. 2022).

    Olsson et al. take the loss of the 500th token minus that of the 50th in 512-token contexts: negative when the
    model predicts better the more context it has. Here the positions are arguments; the defaults keep the paper's
    proportions for any length n: ``early = n // 10`` and ``late = n - 1`` (on an induction batch with bos,
    n = 2L predictions: early falls in the first copy, unpredictable, and late predicts the last token of the
    second copy).

    Args:
        per_position_loss: (b, n) losses by position (:func:`per_position_loss`).
        early: a position in -n..n-1 (default n // 10).
        late: a position in -n..n-1 after ``early`` (default n - 1).

    Returns:
        A scalar tensor, in nats.
    """
    losses = per_position_loss
    if not isinstance(losses, torch.Tensor) or losses.ndim != 2 or not losses.is_floating_point():
        raise bad_argument(
            "per_position_loss", "a floating tensor (b, n)", describe(losses), "pass per_position_loss(logits, ids)"
        )
    b, n = losses.shape
    if b == 0 or n < 2:
        raise bad_argument(
            "per_position_loss", "at least one sequence of 2 positions", describe(losses), "pass a non-empty batch"
        )
    chosen = []
    for name, value, default in (("early", early, n // 10), ("late", late, n - 1)):
        if value is None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_argument(name, "an int position", describe(value), f"pass {name} in 0..{n - 1}", kind=TypeError)
        if not -n <= value < n:
            raise bad_argument(name, f"a position in -{n}..{n - 1}", value, f"pass {name} in 0..{n - 1}")
        chosen.append(value % n)
    early_index, late_index = chosen
    if late_index <= early_index:
        raise bad_argument(
            "late",
            f"a position after early ({early_index})",
            late_index,
            "pass late > early (the score is the later loss minus the earlier)",
        )
    return (losses[:, late_index] - losses[:, early_index]).mean()
