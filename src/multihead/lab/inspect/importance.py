"""Which heads matter: ablation importance, gradient importance (Michel et al. 2019), and pruning curves.

    importance = ablation_importance(model, texts)          # (layers, heads): 1 - cosine when one head goes
    scores = gradient_importance(model, loss_fn, batches)   # (layers, heads): |E[A_h^T dL/dA_h]|
    curve = pruning_curve(model, texts, importance.scores)  # fidelity and measured speed as heads go
    result = prune_by_importance(model, texts, importance, 0.3)  # the curve, then 30% of the heads removed

Embedding fidelity compares the sentence embeddings of the changed model with the original's:
the mean cosine similarity over the texts, and nearest-neighbour agreement, the share of texts
whose nearest other text (by cosine) is the same under both.

References:
    Michel, Levy, Neubig. Are Sixteen Heads Really Better than One? NeurIPS 2019.
    Voita, Talbot, Moiseev, Sennrich, Titov. Analyzing Multi-Head Self-Attention. ACL 2019.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Real

import torch

from multihead._errors import bad_argument, describe
from multihead.capture import attention_layers, capture, part_sites
from multihead.heads import make_ablation
from multihead.lab._words import counted
from multihead.lab.inspect.notebook import head_grid_html
from multihead.lab.inspect.recording import head_numbers
from multihead.lab.models.contract import TextEncoder, evaluating, text_tokenizer

__all__ = [
    "ablated",
    "mean_head_outputs",
    "fidelity",
    "HeadImportance",
    "ablation_importance",
    "gradient_importance",
    "pruning_order",
    "pruning_curve",
    "PRUNING_FRACTIONS",
    "check_prune_fraction",
    "PruneResult",
    "prune_by_importance",
]


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise bad_argument("texts", "a list of strings", describe(texts), "pass e.g. bundled_corpus()", kind=TypeError)
    if len(texts) < 2:
        raise bad_argument(
            "texts",
            "at least two texts (nearest-neighbour agreement needs them)",
            len(texts),
            "pass a corpus, e.g. multihead.lab.inspect.bundled_corpus()",
        )
    return list(texts)


@contextmanager
def ablated(
    model,
    heads: dict[int, Sequence[int]],
    how: str = "zero",
    mean_outputs: dict[int, torch.Tensor] | None = None,
    *,
    part: str | None = None,
):
    """Within the block, ablate ``{layer: [heads]}`` (current head positions) of ``model``; then restore.

    ``mean_outputs``: for how="mean", {layer: (heads of the layer, e)} as :func:`mean_head_outputs` gives.
    The ablation acts on each layer's attention step (its :class:`~multihead.attend.Attend`), so it serves
    our layers and a transformers model on our kernel alike; layers are those of ``part`` (default: the
    model's first part; "encoder", "decoder" or "cross" for an encoder-decoder). An unknown part raises
    ValueError naming the model's parts.
    """
    _, sites = part_sites(model, part)
    try:
        for index, chosen in heads.items():
            if chosen:
                site = sites[index]
                means = None if mean_outputs is None else mean_outputs[index][list(chosen)]
                width = 0 if means is None else means.shape[-1]  # e: means come from the step's own outputs
                site.attend.head_ablation = make_ablation(site.num_heads, width, list(chosen), how, means)
        yield model
    finally:
        for site in sites:
            site.attend.head_ablation = None


def mean_head_outputs(model: TextEncoder, texts: Sequence[str], *, batch_size: int = 32) -> dict[int, torch.Tensor]:
    """{layer: (heads, e)}: each head's output (in eval mode) averaged over every real token of ``texts`` (for
    how="mean")."""
    tokenizer = text_tokenizer(model)
    sums: dict[int, torch.Tensor] = {}
    tokens = 0
    with evaluating(model), capture(model, weights=False, outputs=True) as rec:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer.batch(list(texts[start : start + batch_size]), truncate=True)
            model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
            real = batch.attention_mask.to(torch.float64)[:, None, :, None]  # (b, 1, n, 1)
            for layer in rec.layers:
                total = (rec.outputs(layer).to(torch.float64) * real).sum(dim=(0, 2))  # (heads, e)
                sums[layer] = sums.get(layer, 0) + total
            tokens += int(batch.attention_mask.sum())
            rec.clear()
    return {layer: (total / tokens).float() for layer, total in sums.items()}


def fidelity(reference: torch.Tensor, embeddings: torch.Tensor) -> dict[str, float]:
    """How faithful ``embeddings`` (n, dim) are to ``reference`` (n, dim), both L2-normalised.

    cosine: mean cosine similarity; min_cosine: the worst text; nn_agreement: the share of texts whose
    nearest other text is the same under both.
    """
    cosine = (reference * embeddings).sum(dim=-1)  # (n,)

    def nearest(x: torch.Tensor) -> torch.Tensor:
        similarity = x @ x.T
        similarity.fill_diagonal_(-float("inf"))
        return similarity.argmax(dim=-1)

    return {
        "cosine": float(cosine.mean()),
        "min_cosine": float(cosine.min()),
        "nn_agreement": float((nearest(reference) == nearest(embeddings)).float().mean()),
    }


@dataclass
class HeadImportance:
    """Importance of every head: ``scores`` (layers, heads), higher = matters more.

    Columns are the checkpoint's head numbers (a pruned :class:`~multihead.lab.models.Encoder`'s heads keep
    theirs, in ``head_ids``); a head pruned from a layer, or not measured, is NaN.
    ``metric`` names what the scores are; ``details`` holds per-head extras (e.g. nn_agreement).
    """

    scores: torch.Tensor
    metric: str
    details: dict[str, torch.Tensor] = field(default_factory=dict)
    texts: int = 0

    def ranking(self) -> list[tuple[int, int, float]]:
        """(layer, head, score), most important first; heads not measured (NaN scores) are left out."""
        flat = [
            (layer, head, float(self.scores[layer, head]))
            for layer in range(self.scores.shape[0])
            for head in range(self.scores.shape[1])
            if not math.isnan(float(self.scores[layer, head]))
        ]
        return sorted(flat, key=lambda item: -item[2])

    def __repr__(self) -> str:
        """One line: the metric, the grid, the texts and the three most important heads."""
        top = ", ".join(f"L{layer}H{head} {score:.3g}" for layer, head, score in self.ranking()[:3])
        layers, heads = self.scores.shape
        return (
            f"HeadImportance({self.metric}, {counted(layers, 'layer')} x {counted(heads, 'head')} on "
            f"{counted(self.texts, 'text')}; top: {top})"
        )

    def _repr_html_(self) -> str:
        """A notebook's view: every head's score, shaded by its share of the largest."""
        layers, heads = self.scores.shape
        largest = max((abs(score) for _, _, score in self.ranking()), default=0.0) or 1.0
        values = self.scores.tolist()
        return head_grid_html(
            f"Head importance: {self.metric} ({self.texts} texts)",
            list(range(layers)),
            list(range(heads)),
            lambda row, col: None if values[row][col] != values[row][col] else f"{values[row][col]:.3g}",
            lambda row, col: abs(values[row][col]) / largest,
            note="shading: the score over the largest; pruned or unmeasured heads read 'pruned'",
        )

    def as_dict(self) -> dict:
        """Plain lists for JSON (NaN, for heads not measured, as None)."""

        def plain(values: torch.Tensor) -> list:
            return [[None if v != v else v for v in row] for row in values.tolist()]

        return {
            "metric": self.metric,
            "texts": self.texts,
            "scores": plain(self.scores),
            **{name: plain(values) for name, values in self.details.items()},
        }


@torch.no_grad()
def ablation_importance(
    model,
    texts: Sequence[str],
    *,
    how: str = "zero",
    batch_size: int = 32,
    layers: Sequence[int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> HeadImportance:
    """Ablate each head alone and measure embedding fidelity over ``texts``.

    Returns scores = 1 - mean cosine (layers, heads: the checkpoint's head numbers), with details
    "nn_agreement" and "min_cosine". Heads of layers not in ``layers``, and heads pruned from a layer,
    get NaN. ``progress(done, total)`` after each head.
    """
    texts = _check_texts(texts)
    _, sites = part_sites(model)
    numbers, heads = head_numbers(model)
    chosen = list(range(len(sites))) if layers is None else list(layers)
    means = mean_head_outputs(model, texts, batch_size=batch_size) if how == "mean" else None
    reference = model.encode(texts, batch_size=batch_size, truncate=True)
    shape = (len(sites), heads)
    scores, agreement, worst = (torch.full(shape, float("nan")) for _ in range(3))
    total, done = sum(sites[layer].num_heads for layer in chosen), 0
    for layer in chosen:
        for position, head in enumerate(numbers[layer]):  # the layer's own index, the checkpoint's number
            with ablated(model, {layer: [position]}, how=how, mean_outputs=means):
                result = fidelity(reference, model.encode(texts, batch_size=batch_size, truncate=True))
            scores[layer, head] = 1.0 - result["cosine"]
            agreement[layer, head] = result["nn_agreement"]
            worst[layer, head] = result["min_cosine"]
            done += 1
            if progress is not None:
                progress(done, total)
    return HeadImportance(
        scores,
        f"1 - embedding cosine when the head is {how}-ablated",
        {"nn_agreement": agreement, "min_cosine": worst},
        texts=len(texts),
    )


def gradient_importance(
    model, loss_fn: Callable[[object, object], torch.Tensor], batches: Iterable, *, normalize: bool = False
) -> HeadImportance:
    """Michel et al. (2019): I_h = |E_x[A_h(x)^T dL/dA_h(x)]|, through a gate on every head's output.

    Args:
        model: any model built from :class:`multihead.MultiHeadAttention`, or a transformers model on our
            kernel (the gates sit on its attention steps; layers are its first part's).
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        batches: an iterable of batches for ``loss_fn``.
        normalize: divide each layer's scores by their L2 norm (Michel et al.'s layer normalisation).

    Returns:
        :class:`HeadImportance` with scores (layers, heads), heads by the checkpoint's numbers (NaN: pruned).
    """
    _, sites = part_sites(model)
    gates = [torch.ones(site.num_heads, requires_grad=True) for site in sites]
    totals = [torch.zeros(site.num_heads) for site in sites]
    count = 0
    try:
        for site, gate in zip(sites, gates, strict=True):
            site.attend.head_gate = gate
        for batch in batches:
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
                raise bad_argument(
                    "loss_fn",
                    "a function returning a scalar tensor",
                    describe(loss),
                    "reduce the loss to one number, e.g. .mean()",
                    kind=TypeError,
                )
            grads = torch.autograd.grad(loss, gates, allow_unused=True)
            for total, grad in zip(totals, grads, strict=True):
                if grad is not None:
                    total += grad.detach()
            count += 1
    finally:
        for site in sites:
            site.attend.head_gate = None
    if count == 0:
        raise bad_argument("batches", "at least one batch", "none", "pass an iterable of batches")
    numbers, heads = head_numbers(model)
    scores = torch.full((len(sites), heads), float("nan"))  # columns: checkpoint head numbers; NaN: pruned
    for index, total in enumerate(totals):
        values = (total / count).abs()
        if normalize:
            values = values / values.norm().clamp(min=1e-20)
        scores[index, numbers[index]] = values
    return HeadImportance(
        scores, "|E[A_h^T dL/dA_h]| (Michel et al. 2019)" + (", layer-normalised" if normalize else "")
    )


def pruning_order(
    importance: torch.Tensor, heads_per_layer: Sequence[int] | Sequence[Sequence[int]]
) -> list[tuple[int, int]]:
    """(layer, head) from least to most important, never emptying a layer (its last head is left out).

    ``heads_per_layer``: each layer's heads, by the numbers that index ``importance``'s columns (the
    checkpoint's: ``Encoder.head_ids``), or each layer's head count for heads 0, 1, ...
    """
    kept = [range(heads) if isinstance(heads, int) else list(heads) for heads in heads_per_layer]
    candidates = sorted(
        ((float(importance[layer, head]), layer, head) for layer, heads in enumerate(kept) for head in heads),
        key=lambda item: item[0],
    )
    left = [len(heads) for heads in kept]
    order = []
    for _, layer, head in candidates:
        if left[layer] > 1:
            order.append((layer, head))
            left[layer] -= 1
    return order


class _EncodeTimer:
    """Times ``model.encode`` over texts: the whole call and the time inside its attention layers (hooks)."""

    def __init__(self, model, texts: Sequence[str], batch_size: int):
        self.model, self.texts, self.batch_size = model, list(texts), batch_size
        self.spent = 0.0
        self._starts: list[float] = []

    def __enter__(self) -> _EncodeTimer:
        layers = attention_layers(self.model)
        self._handles = [layer.register_forward_pre_hook(self._enter) for layer in layers]
        self._handles += [layer.register_forward_hook(self._leave) for layer in layers]
        self.model.encode(self.texts[: self.batch_size], batch_size=self.batch_size, truncate=True)  # warm-up
        return self

    def _enter(self, *_) -> None:
        self._starts.append(time.perf_counter())

    def _leave(self, *_) -> None:
        self.spent += time.perf_counter() - self._starts.pop()

    def __exit__(self, *_) -> None:
        for handle in self._handles:
            handle.remove()

    def once(self) -> tuple[float, float]:
        """(whole encode, attention layers only) in seconds, of one encode of every text."""
        self.spent = 0.0
        start = time.perf_counter()
        self.model.encode(self.texts, batch_size=self.batch_size, truncate=True)
        return time.perf_counter() - start, self.spent


def _spread(ratios: list[float]) -> dict:
    """The median of paired ratios and their range."""
    ordered = sorted(ratios)
    return {"median": statistics.median(ordered), "low": ordered[0], "high": ordered[-1]}


def _paired_speedups(base, pruned, texts: Sequence[str], batch_size: int, repeats: int) -> dict:
    """``pruned``'s speed-up over ``base``, measured in pairs: each repeat times one encode of each, the order
    alternating, so a load that comes and goes falls on both alike. Per pair base / pruned, for the whole
    encode and its attention layers; the median, and the range over the pairs (the spread of the noise)."""
    whole, attention, seconds, attention_seconds = [], [], [], []
    with _EncodeTimer(base, texts, batch_size) as first, _EncodeTimer(pruned, texts, batch_size) as second:
        for repeat in range(repeats):
            order = (first, second) if repeat % 2 == 0 else (second, first)
            timed = {id(timer): timer.once() for timer in order}
            (base_total, base_attention), (total, attention_s) = timed[id(first)], timed[id(second)]
            whole.append(base_total / total)
            attention.append(base_attention / attention_s)
            seconds.append(total)
            attention_seconds.append(attention_s)
    return {
        "seconds": statistics.median(seconds),
        "attention_seconds": statistics.median(attention_seconds),
        "speedup": _spread(whole),
        "attention_speedup": _spread(attention),
    }


# The fractions of all heads a pruning curve measures by default
PRUNING_FRACTIONS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def _check_prunable(model: object) -> None:
    if not callable(getattr(model, "prune_heads", None)):
        raise bad_argument(
            "model",
            "a model whose heads can be removed (one built from multihead.MultiHeadAttention, e.g. load_minilm())",
            f"a {type(model).__name__}, which has no prune_heads",
            "measure which heads matter with ablation_importance, which ablates them in place instead",
            kind=TypeError,
        )


@torch.no_grad()
def pruning_curve(
    model,
    texts: Sequence[str],
    importance: torch.Tensor,
    *,
    fractions: Sequence[float] = PRUNING_FRACTIONS,
    batch_size: int = 32,
    repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Remove heads least-important first and, at each fraction of all heads, physically prune a copy
    of ``model`` and measure its embedding fidelity and its speed (encode over ``texts``).

    ``importance``: (layers, heads) scores, heads by the checkpoint's numbers (as :class:`HeadImportance`).
    Returns one dict per fraction: fraction, heads_removed, removed [(layer, checkpoint head)], cosine,
    min_cosine, nn_agreement, seconds, attention_seconds (medians), speedup and attention_speedup (the
    median over ``repeats`` pairs of runs, each pair timing the unpruned model and the pruned copy back to
    back, the order alternating), speedup_range and attention_speedup_range ([lowest, highest] pair: the
    noise), and repeats. A layer always keeps its last head, so the largest fractions
    may remove fewer heads than asked (heads_removed says how many).
    """
    texts = _check_texts(texts)
    _check_prunable(model)
    fractions = _check_fractions(fractions)
    numbers, _ = head_numbers(model)
    counts = [len(heads) for heads in numbers]
    order = pruning_order(importance, numbers)
    reference = model.encode(texts, batch_size=batch_size, truncate=True)
    rows = []
    for step, fraction in enumerate(fractions):
        wanted = round(fraction * sum(counts))
        removed = order[:wanted]
        pruned = copy.deepcopy(model)
        plan: dict[int, list[int]] = {}
        for layer, head in removed:  # an Encoder prunes by the checkpoint's head numbers, as the order gives them
            plan.setdefault(layer, []).append(head)
        if plan:
            pruned.prune_heads(plan)
        result = fidelity(reference, pruned.encode(texts, batch_size=batch_size, truncate=True))
        speed = _paired_speedups(model, pruned, texts, batch_size, repeats)
        rows.append(
            {
                "fraction": fraction,
                "heads_removed": len(removed),
                "removed": removed,
                **result,
                "seconds": speed["seconds"],
                "attention_seconds": speed["attention_seconds"],
                "speedup": speed["speedup"]["median"],
                "speedup_range": [speed["speedup"]["low"], speed["speedup"]["high"]],
                "attention_speedup": speed["attention_speedup"]["median"],
                "attention_speedup_range": [speed["attention_speedup"]["low"], speed["attention_speedup"]["high"]],
                "repeats": repeats,
            }
        )
        if progress is not None:
            progress(step + 1, len(fractions))
    return rows


def check_prune_fraction(fraction: object) -> float:
    """``fraction`` of all heads to remove, as a float: TypeError unless a real number (not bool), ValueError
    outside [0, 1) (NaN included; 1 would empty every layer), both naming ``fraction``. The command line calls it
    before any work, so a mistake costs no measuring."""
    if not isinstance(fraction, Real) or isinstance(fraction, bool):
        expected = "a fraction of all heads in [0, 1)"
        raise bad_argument("fraction", expected, describe(fraction), "pass e.g. fraction=0.3", kind=TypeError)
    value = float(fraction)
    if not 0.0 <= value < 1.0:  # NaN fails it too
        raise bad_argument("fraction", "a fraction of all heads in [0, 1)", fraction, "pass e.g. fraction=0.3")
    return value


def _check_fractions(fractions: object) -> list[float]:
    """The curve's fractions, each a real number in [0, 1), or an error naming ``fractions``."""
    fix = "pass e.g. fractions=[0.1, 0.2, 0.5]"
    if isinstance(fractions, (str, bytes)) or not isinstance(fractions, Sequence):
        raise bad_argument("fractions", "a sequence of numbers", describe(fractions), fix, kind=TypeError)
    for value in fractions:
        if not isinstance(value, Real) or isinstance(value, bool):
            raise bad_argument("fractions", "a sequence of numbers", f"an item {describe(value)}", fix, kind=TypeError)
        if not 0.0 <= float(value) < 1.0:
            raise bad_argument("fractions", "fractions of all heads in [0, 1)", value, fix)
    return [float(value) for value in fractions]


@dataclass(frozen=True)
class PruneResult:
    """What :func:`prune_by_importance` measured and did.

    ``curve``: the rows of :func:`pruning_curve`, one per fraction (measured on copies of the model).
    ``chosen``: the row of the fraction asked for, whose heads were removed from the model. ``plan``: those heads,
    ``{layer: [checkpoint head numbers]}``, least important first, as :meth:`~multihead.lab.models.Encoder.prune_heads`
    took them (empty for fraction 0).
    """

    curve: list[dict]
    chosen: dict
    plan: dict[int, list[int]]

    @property
    def heads_removed(self) -> int:
        """How many heads were removed from the model."""
        return sum(len(heads) for heads in self.plan.values())


def prune_by_importance(
    model,
    texts: Sequence[str],
    scores: torch.Tensor | HeadImportance,
    fraction: float,
    *,
    fractions: Sequence[float] | None = None,
    batch_size: int = 32,
    repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> PruneResult:
    """Measure the pruning curve over ``texts``, then remove from ``model``, in place, the ``fraction`` of its heads
    that ``scores`` rank least important (never a layer's last head: see :func:`pruning_order`).

    Args:
        model: a model whose heads can be removed (an :class:`~multihead.lab.models.Encoder`: ``prune_heads``).
        texts: at least two texts, for the curve's embedding fidelity and speed.
        scores: (layers, heads) importance, higher = matters more, heads by the checkpoint's numbers (a pruned
            model's heads keep theirs), or a :class:`HeadImportance` (its ``scores``); NaN for heads already
            pruned.
        fraction: the fraction of all heads to remove, in [0, 1); the number removed is
            ``round(fraction * heads)`` (fewer when layers run down to their last head).
        fractions: the other fractions the curve measures (default :data:`PRUNING_FRACTIONS`); ``fraction``
            (rounded to 4 places, as its row says) is always among them.
        batch_size, repeats: as :func:`pruning_curve`. progress: ``progress(done, total)`` after each fraction.

    Returns:
        :class:`PruneResult`: the curve, the row of ``fraction`` and the plan applied to ``model``.

    Raises:
        TypeError or ValueError naming ``fraction``, ``fractions``, ``scores``, ``texts`` or ``model``; every
        argument is checked, and the curve measured on copies, before ``model`` is touched: a call that raises
        leaves it as it was.
    """
    fraction = round(check_prune_fraction(fraction), 4)  # the curve's row for it carries this value
    wanted = _check_fractions(PRUNING_FRACTIONS if fractions is None else fractions)
    texts = _check_texts(texts)
    _check_prunable(model)
    importance = _check_scores(model, scores.scores if isinstance(scores, HeadImportance) else scores)
    curve = pruning_curve(
        model,
        texts,
        importance,
        fractions=sorted({*wanted, fraction}),
        batch_size=batch_size,
        repeats=repeats,
        progress=progress,
    )
    chosen = next(row for row in curve if row["fraction"] == fraction)
    plan: dict[int, list[int]] = {}
    for layer, head in chosen["removed"]:  # checkpoint head numbers, as Encoder.prune_heads takes them
        plan.setdefault(layer, []).append(head)
    if plan:
        model.prune_heads(plan)
    return PruneResult(curve=curve, chosen=chosen, plan=plan)


def _check_scores(model, scores: object) -> torch.Tensor:
    """``scores`` as (layers, heads) over the model's first part and the checkpoint's head numbers, or an error
    naming ``scores`` (an importance of another model would prune the wrong heads, or index past the grid)."""
    kept_heads, total = head_numbers(model)
    shape = (len(kept_heads), total)
    if not isinstance(scores, torch.Tensor) or scores.ndim != 2 or not scores.is_floating_point():
        raise bad_argument(
            "scores",
            f"a float tensor {shape} (layers, heads) or a HeadImportance",
            describe(scores),
            "pass the importance of this model's heads (ablation_importance(model, texts))",
            kind=TypeError,
        )
    if tuple(scores.shape) != shape:
        raise bad_argument(
            "scores",
            f"(layers, heads) = {shape}: the model's layers and its checkpoint's heads",
            tuple(scores.shape),
            "measure the importance of this model's heads (ablation_importance(model, texts))",
        )
    kept = torch.tensor([[head in heads for head in range(total)] for heads in kept_heads])  # (layers, heads)
    if torch.isnan(scores[kept]).any():
        raise bad_argument(
            "scores",
            "a number for every head the model still has (NaN only for heads pruned already)",
            "NaN for a head still there",
            "measure the importance of every head of this model again (ablation_importance(model, texts))",
        )
    return scores
