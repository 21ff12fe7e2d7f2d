"""Activation patching of attention heads, exact and by attribution, on any causal language model on our kernel.

    exact = activation_patching(model, clean_ids, corrupt_ids, answer=12, wrong=40)         # z, by head
    exact.scores            # (layers, heads): (patched - corrupt) / (clean - corrupt) of the logit difference
    cheap = attribution_patching(model, clean_ids, corrupt_ids, answer=12, wrong=40)        # one forward + backward
    agreement(exact, cheap)  # how far the first-order estimate can be trusted on this model

The metric is the logit difference at the last position, logit(answer) - logit(wrong), averaged over the
prompts. A patch runs the corrupted prompts with one activation of one site taken from the clean run: a head's
``z`` (its output before W^O), its ``pattern``, its ``q``, or the ``k`` or ``v`` of a key/value head (by head),
or that activation of every head of a layer at one position (by position: the query position for z, pattern
and q, the key position for k and v). The score is the share of the clean-minus-corrupt difference the patch
restores: 1 restores it all, 0 nothing, a negative score moves the answer the other way.

Every site of one forward is patched in its own copy of the prompts: ``batch_size`` sites per forward, so a sweep
of L layers x H heads costs ceil(L H / batch_size) forwards. Only the patched head changes; every head runs the
model's kernel as usual (no eager attention anywhere), and a pattern is computed only for the heads that read
one. Attribution patching (Nanda 2023; Kramár et al. 2024, "AtP*") estimates every score at once to first order:
(clean - corrupt) . d metric / d activation at the corrupted run, from one forward and one backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from multihead._errors import bad_argument, describe
from multihead.attend import AttentionSite
from multihead.lab.circuits._runs import (
    BYS,
    INPUTS,
    Prepared,
    checked_batch_size,
    logit_difference,
    logits_of,
    prepare,
    step_weights,
)
from multihead.lab.models.contract import evaluating

__all__ = ["PatchingResult", "activation_patching", "attribution_patching", "Agreement", "agreement", "BYS"]


@dataclass(frozen=True)
class PatchingResult:
    """A sweep's scores. ``scores``: (layers, heads) by head — key/value heads for k and v — or (layers,
    positions) by position, float64; NaN where a layer has fewer heads than the widest. ``clean`` and
    ``corrupt``: the mean logit differences of the two runs. ``method``: "exact" or "attribution"."""

    what: str
    by: str
    part: str
    method: str
    scores: torch.Tensor
    clean: float
    corrupt: float

    def to_dict(self) -> dict:
        """JSON-ready: every field, ``scores`` as nested lists (null for NaN)."""
        grid = [[None if value != value else round(value, 6) for value in row] for row in self.scores.tolist()]
        return {
            "what": self.what,
            "by": self.by,
            "part": self.part,
            "method": self.method,
            "clean_logit_difference": self.clean,
            "corrupt_logit_difference": self.corrupt,
            "scores": grid,
        }


def _counts(sites: Sequence[AttentionSite], what: str, by: str, positions: int) -> list[int]:
    """How many things each layer's sweep patches: its query or key/value heads, or the positions."""
    if by == "position":
        return [positions] * len(sites)
    return [site.num_kv_heads if what in ("k", "v") else site.num_heads for site in sites]


def activation_patching(
    model: nn.Module,
    clean_ids: torch.Tensor,
    corrupt_ids: torch.Tensor,
    *,
    answer: int | torch.Tensor,
    wrong: int | torch.Tensor,
    what: str = "z",
    by: str = "head",
    part: str | None = None,
    sites: Sequence[tuple[int, int]] | None = None,
    batch_size: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> PatchingResult:
    """Patch each head (or each layer at each position) from the clean run into the corrupted one, exactly.

    Args:
        model: a causal LM on our kernel (a :class:`~multihead.lab.models.Decoder`, or a transformers ``*ForCausalLM``
            with ``attn_implementation="multihead"``) whose ``forward(ids)`` gives logits.
        clean_ids, corrupt_ids: token ids (n,) or (b, n), of one shape.
        answer, wrong: the token whose logit should win and the one it competes with: ints, or (b,) tensors.
        what: "z", "pattern", "q", "k" or "v" (see the module docstring). by: "head" or "position".
        part: which attention (default: the model's first). batch_size: patched copies of the prompts per forward.
        sites: only these (layer, head) or (layer, position) pairs (default: every one); the others' scores are NaN.
        progress: ``progress(done, total)`` after each forward of the sweep.

    Returns:
        :class:`PatchingResult` with ``method="exact"``: ``scores`` (layers, heads or positions).

    The model runs in eval mode without autograd; its mode comes back afterwards. Raises ValueError or TypeError
    naming the argument: prompts of different shapes, a token outside the vocabulary, ``answer == wrong``, or a
    corruption that leaves the logit difference as it was.
    """
    checked_batch_size(batch_size)
    with evaluating(model):
        run = prepare(model, clean_ids, corrupt_ids, answer, wrong, what, by, part)
        counts = _counts(run.sites, what, by, run.clean_ids.shape[1])
        targets = [(layer, index) for layer, count in enumerate(counts) for index in range(count)]
        if sites is not None:
            targets = _chosen_sites(sites, targets, by)
        patched = torch.empty(len(targets), dtype=torch.float64)
        chunks = [targets[start : start + batch_size] for start in range(0, len(targets), batch_size)]
        for done, chunk in enumerate(chunks):
            differences = _patched_run(model, run, chunk, what, by)  # (len(chunk),)
            start = done * batch_size
            patched[start : start + len(chunk)] = differences.cpu()
            if progress is not None:
                progress(done + 1, len(chunks))
    scores = torch.full((len(counts), max(counts)), float("nan"), dtype=torch.float64)
    for (layer, index), value in zip(targets, patched.tolist(), strict=True):
        scores[layer, index] = (value - run.corrupt_difference) / (run.clean_difference - run.corrupt_difference)
    return PatchingResult(what, by, run.part, "exact", scores, run.clean_difference, run.corrupt_difference)


def _chosen_sites(sites: object, targets: list[tuple[int, int]], by: str) -> list[tuple[int, int]]:
    """``sites`` checked against the sweep's ``targets``: distinct (layer, index) pairs among them, in order."""
    fix = f"pass e.g. sites=[(1, 2)]: (layer, {by}) pairs"
    if isinstance(sites, (str, bytes)) or not isinstance(sites, Sequence) or not sites:
        raise bad_argument("sites", f"a non-empty list of (layer, {by}) pairs", describe(sites), fix, kind=TypeError)
    chosen: list[tuple[int, int]] = []
    for site in sites:
        pair = tuple(site) if isinstance(site, (tuple, list)) else None
        if pair is None or len(pair) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in pair):
            raise bad_argument("sites", f"(layer, {by}) pairs of ints", describe(site), fix, kind=TypeError)
        if pair not in targets:
            raise bad_argument("sites", f"(layer, {by}) pairs of this model and prompt", repr(pair), fix)
        if pair in chosen:
            raise bad_argument("sites", "each pair once", f"{pair!r} twice", "list every site once")
        chosen.append(pair)
    return chosen


def _patched_run(model, run: Prepared, chunk: list[tuple[int, int]], what: str, by: str) -> torch.Tensor:
    """The mean logit difference of each target of ``chunk`` (layer, index), each patched into its own copy of
    the corrupted prompts: one forward of len(chunk) x b rows."""
    b = run.corrupt_ids.shape[0]
    by_layer: dict[int, list[tuple[slice, int]]] = {}
    for copy, (layer, index) in enumerate(chunk):
        by_layer.setdefault(layer, []).append((slice(copy * b, (copy + 1) * b), index))
    handles = []
    try:
        for layer, patches in by_layer.items():
            site, source = run.sites[layer], run.clean[layer]
            if what in INPUTS:
                hook = _input_patch(INPUTS[what], patches, source, by)
                handles.append(site.attend.register_forward_pre_hook(hook, with_kwargs=True))
            else:
                hook = _output_patch(what, patches, source, by, site.num_heads // site.num_kv_heads)
                handles.append(site.attend.register_forward_hook(hook, with_kwargs=True))
        logits = logits_of(model, run.corrupt_ids.repeat(len(chunk), 1))
    finally:
        for handle in handles:
            handle.remove()
    return logit_difference(logits, run.answer, run.wrong).reshape(len(chunk), b).mean(1)


def _place(target: torch.Tensor, rows: slice, index: int, source: torch.Tensor, by: str) -> None:
    """Write ``source``'s head (by head, dim 1) or position (by position, dim 2) ``index`` into ``rows`` of
    ``target``: both (rows or b, heads, positions, ...)."""
    if by == "head":
        target[rows, index] = source[:, index]
    else:
        target[rows, :, index] = source[:, :, index]


def _input_patch(position: int, patches: list[tuple[slice, int]], source: torch.Tensor, by: str):
    """A pre-hook giving the step its clean q, k or v at each patch's head or position."""

    def hook(module, args, kwargs):
        value = args[position].clone()
        for rows, index in patches:
            _place(value, rows, index, source.to(value.dtype), by)
        return (*args[:position], value, *args[position + 1 :]), kwargs

    return hook


def _output_patch(what: str, patches: list[tuple[slice, int]], source: torch.Tensor, by: str, per_group: int):
    """A forward hook giving the step its clean z at each patch, or the output the clean pattern gives with
    this run's values."""

    def hook(module, args, kwargs, result):
        out = result.output.clone()
        if what == "z":
            for rows, index in patches:
                _place(out, rows, index, source.to(out.dtype), by)
        else:  # pattern: the clean weights applied to this run's values, v of each query head's key/value head
            v = args[2].repeat_interleave(per_group, dim=1)  # (rows, h, j, e)
            for rows, index in patches:
                clean = source.to(v.dtype)  # (b, h, i, j)
                if by == "head":
                    out[rows, index] = clean[:, index] @ v[rows, index]
                else:
                    out[rows, :, index] = torch.einsum("bhj,bhje->bhe", clean[:, :, index], v[rows])
        return result._replace(output=out)

    return hook


def attribution_patching(
    model: nn.Module,
    clean_ids: torch.Tensor,
    corrupt_ids: torch.Tensor,
    *,
    answer: int | torch.Tensor,
    wrong: int | torch.Tensor,
    what: str = "z",
    by: str = "head",
    part: str | None = None,
) -> PatchingResult:
    """The first-order estimate of :func:`activation_patching`'s scores (attribution patching, AtP), from the
    clean run, one corrupted forward and one backward: for each site, (clean - corrupt) . d metric / d activation
    at the corrupted run, summed over the site's entries, over (clean - corrupt) of the metric.

    Arguments and result as :func:`activation_patching` (``method="attribution"``). Exact for a metric linear in
    the activation; a head whose effect saturates a softmax is misjudged (compare with :func:`agreement`). The
    model's parameters get no gradient (``torch.autograd.grad`` to the activations only), and its mode comes back
    afterwards.
    """
    with evaluating(model):
        run = prepare(model, clean_ids, corrupt_ids, answer, wrong, what, by, part)
        with torch.enable_grad():
            leaves: dict[int, torch.Tensor] = {}
            corrupt: dict[int, torch.Tensor] = {}
            handles = []
            try:
                for layer, site in enumerate(run.sites):
                    if what in INPUTS:
                        hook = _input_leaf(INPUTS[what], layer, leaves, corrupt)
                        handles.append(site.attend.register_forward_pre_hook(hook, with_kwargs=True))
                    else:
                        hook = _output_leaf(what, layer, leaves, corrupt, site.num_heads // site.num_kv_heads)
                        handles.append(site.attend.register_forward_hook(hook, with_kwargs=True))
                logits = logits_of(model, run.corrupt_ids)
            finally:
                for handle in handles:
                    handle.remove()
            metric = logit_difference(logits, run.answer, run.wrong).mean()
            layers = sorted(leaves)
            gradients = torch.autograd.grad(metric, [leaves[layer] for layer in layers], allow_unused=True)
    counts = _counts(run.sites, what, by, run.clean_ids.shape[1])
    scores = torch.full((len(counts), max(counts)), float("nan"), dtype=torch.float64)
    span = run.clean_difference - run.corrupt_difference
    for layer, gradient in zip(layers, gradients, strict=True):
        change = run.clean[layer].double() - corrupt[layer].double()
        effect = change * (torch.zeros_like(change) if gradient is None else gradient.double())
        keep = 1 if by == "head" else 2  # the dim of heads or positions
        per_index = effect.transpose(0, keep).reshape(effect.shape[keep], -1).sum(1)
        scores[layer, : per_index.shape[0]] = per_index.cpu() / span
    return PatchingResult(what, by, run.part, "attribution", scores, run.clean_difference, run.corrupt_difference)


def _input_leaf(position: int, layer: int, leaves: dict, corrupt: dict):
    """A pre-hook adding a zero leaf to q, k or v: its gradient is the metric's gradient there."""

    def hook(module, args, kwargs):
        value = args[position]
        corrupt[layer] = value.detach().clone()
        leaves[layer] = leaf = torch.zeros_like(value, requires_grad=True)
        return (*args[:position], value + leaf, *args[position + 1 :]), kwargs

    return hook


def _output_leaf(what: str, layer: int, leaves: dict, corrupt: dict, per_group: int):
    """A forward hook adding a zero leaf to z, or to the pattern (as leaf @ v on the output): its gradient is the
    metric's gradient there."""

    def hook(module, args, kwargs, result):
        out = result.output
        if what == "z":
            corrupt[layer] = out.detach().clone()
            leaves[layer] = leaf = torch.zeros_like(out, requires_grad=True)
            out = out + leaf
        else:
            weights = step_weights(module, args, kwargs)  # (b, h, i, j)
            corrupt[layer] = weights.detach().clone()
            leaves[layer] = leaf = torch.zeros_like(weights, requires_grad=True)
            out = out + leaf @ args[2].repeat_interleave(per_group, dim=1)
        return result._replace(output=out)

    return hook


@dataclass(frozen=True)
class Agreement:
    """How attribution patching's estimate compares with the exact scores: ``correlation`` (Pearson, over every
    site with both scores) and ``top_overlap``, the share of the exact top ``top`` sites (by |score|) that the
    estimate also puts in its top ``top``."""

    correlation: float
    top_overlap: float
    top: int


def agreement(exact: PatchingResult, estimate: PatchingResult, *, top: int = 5) -> Agreement:
    """Compare two sweeps of the same sites (typically exact and attribution). Raises ValueError naming
    ``estimate`` when the sweeps are of different activations, groupings or shapes."""
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise bad_argument("top", "a positive int", describe(top), "pass e.g. top=5")
    if (exact.what, exact.by, exact.scores.shape) != (estimate.what, estimate.by, estimate.scores.shape):
        raise bad_argument(
            "estimate",
            f"a sweep of {exact.what} by {exact.by}, scores {tuple(exact.scores.shape)} (those of exact)",
            f"{estimate.what} by {estimate.by}, scores {tuple(estimate.scores.shape)}",
            "run both with the same what=, by= and model",
        )
    both = ~(exact.scores.isnan() | estimate.scores.isnan())
    a, b = exact.scores[both].double(), estimate.scores[both].double()
    a, b = a - a.mean(), b - b.mean()
    correlation = float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30))
    top = max(1, min(top, int(both.sum())))
    first = set(exact.scores[both].abs().topk(top).indices.tolist())
    second = set(estimate.scores[both].abs().topk(top).indices.tolist())
    return Agreement(correlation, len(first & second) / top, top)
