"""Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers"): how much each input
token flows into chosen positions' final states, following attention through every layer.

    flow = attention_rollout(model, ids, queries=[-1])   # (b, 1, n): the last position's rollout over the tokens

Each layer's attention, averaged over its heads, is mixed with the identity for the residual connection,
0.5 A + 0.5 I (each row still sums to 1), and the layers are multiplied from the last down to the first:
rollout = Â_L ... Â_1. Only the chosen rows are carried down (a (rows, n) product per layer), and each layer's
weights are recorded through :func:`~multihead.capture` on the model's kernel. Works for encoders and decoders
alike (a decoder's rollout is lower triangular).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from multihead._errors import bad_argument, describe
from multihead._indices import checked_indices
from multihead.capture import capture
from multihead.lab.circuits._runs import checked_ids
from multihead.lab.models.contract import evaluating

__all__ = ["attention_rollout"]


def attention_rollout(
    model: nn.Module,
    ids: torch.Tensor,
    *,
    queries: Sequence[int] | int | None = None,
    part: str | None = None,
    residual: bool = True,
) -> torch.Tensor:
    """The rollout of ``queries`` (positions, negative from the end; default every position) over the tokens of
    ``ids`` (n,) or (b, n): (b, len(queries), n), each row summing to 1.

    ``residual``: mix each layer with the identity (the paper's rollout); False multiplies the bare attention.
    ``part``: which attention of the model (default its first). The model runs in eval mode without autograd
    (its mode comes back). Raises TypeError or ValueError naming ``ids``, ``queries`` or ``residual``.
    """
    ids = checked_ids("ids", ids, "tokenise the text")
    if not isinstance(residual, bool):
        raise bad_argument("residual", "True or False", describe(residual), "pass residual=True", kind=TypeError)
    n = ids.shape[1]
    rows = checked_indices("queries", queries, n, "query")
    with evaluating(model), capture(model, part=part) as recorder:
        model(ids)
    flow = None
    identity = torch.eye(n, device=ids.device)
    for layer in reversed(recorder.layers):
        weights = recorder.weights(layer)  # (b, h, n, n)
        mixed = weights.to(torch.promote_types(weights.dtype, torch.float32)).mean(1)  # (b, n, n)
        if residual:
            mixed = 0.5 * mixed + 0.5 * identity.to(mixed)
        flow = mixed[:, rows] if flow is None else flow @ mixed  # (b, rows, n)
    assert flow is not None  # a part has at least one layer
    return flow
