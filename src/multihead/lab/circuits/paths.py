"""Path patching (Wang et al. 2022, "Interpretability in the Wild"; Goldowsky-Dill et al. 2023): how much of an
answer a sender head gives through chosen receiver heads' queries, keys or values alone.

    found = path_patching(model, clean_ids, corrupt_ids, answer=12, wrong=40, receivers=[(1, 0), (1, 2)], what="k")
    found.scores        # (layers, heads): each earlier head as sender; NaN for heads that cannot send

For each sender head, two runs of the corrupted prompts:

1. The sender's output z comes from the clean run, and every other head's output is held at its corrupted value,
   so that the sender's change reaches later layers only directly (through the residual stream and the MLPs),
   never through another head. The receivers' ``what`` (their q, k or v, as their layer computes it from that
   residual) is recorded.
2. The corrupted prompts run again, with only the receivers' ``what`` replaced by what step 1 recorded.

The score is step 2's share of the clean-minus-corrupt logit difference, as in
:func:`~multihead.lab.circuits.activation_patching`. Senders are the heads of every layer before the first
receiver's. Many senders share each forward (``batch_size``), and every head runs the model's kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from multihead._errors import bad_argument, describe
from multihead.lab.circuits._runs import (
    INPUTS,
    checked_batch_size,
    checked_choice,
    logit_difference,
    logits_of,
    prepare,
    record,
)
from multihead.lab.circuits.patching import PatchingResult
from multihead.lab.models.contract import evaluating

__all__ = ["path_patching"]


def _checked_receivers(receivers: object, heads_per_layer: list[int]) -> list[tuple[int, int]]:
    """``receivers`` as a list of distinct (layer, query head) pairs within the model."""
    fix = "pass e.g. receivers=[(1, 0), (1, 2)]: (layer, head) of each receiving head"
    if isinstance(receivers, (str, bytes)) or not isinstance(receivers, Sequence) or not receivers:
        raise bad_argument(
            "receivers", "a non-empty list of (layer, head) pairs", describe(receivers), fix, kind=TypeError
        )
    checked: list[tuple[int, int]] = []
    for pair in receivers:
        if (
            not isinstance(pair, (tuple, list))
            or len(pair) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in pair)
        ):
            raise bad_argument("receivers", "(layer, head) pairs of ints", describe(pair), fix, kind=TypeError)
        layer, head = pair
        if not 0 <= layer < len(heads_per_layer) or not 0 <= head < heads_per_layer[layer]:
            raise bad_argument(
                "receivers", f"heads of the model's {len(heads_per_layer)} layers", f"({layer}, {head})", fix
            )
        if (layer, head) in checked:
            raise bad_argument("receivers", "each head once", f"({layer}, {head}) twice", "list every head once")
        checked.append((layer, head))
    if min(layer for layer, _ in checked) == 0:
        raise bad_argument(
            "receivers", "heads after layer 0 (a sender must come before them)", describe(receivers), fix
        )
    return checked


def path_patching(
    model: nn.Module,
    clean_ids: torch.Tensor,
    corrupt_ids: torch.Tensor,
    *,
    answer: int | torch.Tensor,
    wrong: int | torch.Tensor,
    receivers: Sequence[tuple[int, int]],
    what: str = "k",
    part: str | None = None,
    batch_size: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> PatchingResult:
    """Score every head before the first receiver as a sender into ``receivers``' ``what`` (see the module docstring).

    Args:
        receivers: (layer, query head) pairs. For k and v, a receiver's key/value head (head // (h / g) under
            GQA) is the one replaced: every query head sharing it receives too.
        what: "q", "k" or "v". Other arguments as :func:`~multihead.lab.circuits.activation_patching`.

    Returns:
        :class:`~multihead.lab.circuits.PatchingResult` with ``method="path"``, ``by="head"``: ``scores`` (layers,
        heads), NaN at the receivers' layers and after.
    """
    what = checked_choice("what", what, tuple(INPUTS))
    checked_batch_size(batch_size)
    with evaluating(model):
        run = prepare(model, clean_ids, corrupt_ids, answer, wrong, "z", "head", part)
        heads = [site.num_heads for site in run.sites]
        chosen = _checked_receivers(receivers, heads)
        _, corrupt = record(model, run.sites, run.corrupt_ids, "z")
        first = min(layer for layer, _ in chosen)
        senders = [(layer, head) for layer in range(first) for head in range(heads[layer])]
        # the receivers' heads, by layer, in the tensor ``what`` is: query heads for q, key/value heads for k, v
        receiving: dict[int, list[int]] = {}
        for layer, head in chosen:
            site = run.sites[layer]
            index = head if what == "q" else head // (site.num_heads // site.num_kv_heads)
            if index not in receiving.setdefault(layer, []):
                receiving[layer].append(index)
        patched = torch.empty(len(senders), dtype=torch.float64)
        chunks = [senders[start : start + batch_size] for start in range(0, len(senders), batch_size)]
        for done, chunk in enumerate(chunks):
            received = _sent(model, run, corrupt, chunk, receiving, what)
            differences = _received(model, run, chunk, receiving, received, what)
            patched[done * batch_size : done * batch_size + len(chunk)] = differences.cpu()
            if progress is not None:
                progress(done + 1, len(chunks))
    scores = torch.full((len(heads), max(heads)), float("nan"), dtype=torch.float64)
    span = run.clean_difference - run.corrupt_difference
    for (layer, head), value in zip(senders, patched.tolist(), strict=True):
        scores[layer, head] = (value - run.corrupt_difference) / span
    return PatchingResult(what, "head", run.part, "path", scores, run.clean_difference, run.corrupt_difference)


def _sent(model, run, corrupt, chunk, receiving, what) -> dict[int, torch.Tensor]:
    """Step 1 for each sender of ``chunk`` in its own copy of the corrupted prompts: every head's output held at
    its corrupted value but the sender's, taken from the clean run. Returns the receivers' layers' ``what``,
    {layer: (copies x b, heads, positions, ...)}."""
    b = run.corrupt_ids.shape[0]
    copies = len(chunk)
    received: dict[int, torch.Tensor] = {}
    handles = []

    def held(layer: int):
        def hook(module, args, kwargs, result):
            out = corrupt[layer].to(result.output.dtype).repeat(copies, 1, 1, 1)
            for copy, (sender_layer, head) in enumerate(chunk):
                if sender_layer == layer:
                    out[copy * b : (copy + 1) * b, head] = run.clean[layer][:, head]
            return result._replace(output=out)

        return hook

    def recording(layer: int):
        def hook(module, args, kwargs):
            received[layer] = args[INPUTS[what]].detach().clone()

        return hook

    try:
        for layer, site in enumerate(run.sites):
            handles.append(site.attend.register_forward_hook(held(layer), with_kwargs=True))
            if layer in receiving:
                handles.append(site.attend.register_forward_pre_hook(recording(layer), with_kwargs=True))
        logits_of(model, run.corrupt_ids.repeat(copies, 1))
    finally:
        for handle in handles:
            handle.remove()
    return received


def _received(model, run, chunk, receiving, received, what) -> torch.Tensor:
    """Step 2: the corrupted prompts with only the receivers' ``what`` taken from step 1, per copy; returns each
    copy's mean logit difference (len(chunk),)."""
    b = run.corrupt_ids.shape[0]
    position = INPUTS[what]
    handles = []

    def replacing(layer: int):
        def hook(module, args, kwargs):
            value = args[position].clone()
            for index in receiving[layer]:
                value[:, index] = received[layer][:, index].to(value.dtype)
            return (*args[:position], value, *args[position + 1 :]), kwargs

        return hook

    try:
        for layer in receiving:
            hook = replacing(layer)
            handles.append(run.sites[layer].attend.register_forward_pre_hook(hook, with_kwargs=True))
        logits = logits_of(model, run.corrupt_ids.repeat(len(chunk), 1))
    finally:
        for handle in handles:
            handle.remove()
    return logit_difference(logits, run.answer, run.wrong).reshape(len(chunk), b).mean(1)
