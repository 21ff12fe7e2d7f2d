"""Which heads an inspection covers and how they are recorded: :class:`HeadGrid` (layers x checkpoint head numbers,
a pruned layer's missing heads left empty), :func:`head_grid` (the grid of a model's part, its attention sites
resolved once and kept on it), :func:`record_grid` (one recorder per layer, reusing those sites) and
:func:`is_causal_part`. The statistics (:mod:`multihead.lab.inspect.stats`) and the readers build on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from multihead._errors import bad_argument
from multihead._indices import checked_indices
from multihead.attend import AttentionSite
from multihead.capture import Recorder, part_sites

__all__ = ["HeadGrid", "head_grid", "head_numbers", "record_grid", "GridRecorder", "is_causal_part"]


# ------------------------------------------------------------------ which heads: the checkpoint's numbers


@dataclass(frozen=True)
class HeadGrid:
    """The heads an inspection covers: rows ``layers`` (model layer indices), columns ``heads`` (head numbers).

    Head numbers are the checkpoint's. Pruning removes heads from a layer, and a pruned
    :class:`~multihead.lab.models.Encoder` keeps, in ``head_ids``, the original number of every head still
    there, so a head keeps its number when others go (a model without ``head_ids`` numbers each layer's
    heads 0, 1, ...). A layer may then lack some columns: row r has the heads ``layer_heads[r]`` (in
    column order), which are the layer's heads ``positions[r]`` as the layer (and capture) counts them.
    ``part``: the model's part the layers belong to ("self", or "encoder", "decoder", "cross"; see
    :func:`~multihead.capture.attention_sites`), None when not taken from a model.
    """

    layers: list[int]
    heads: list[int]
    layer_heads: list[list[int]]
    positions: list[list[int]] | None = None  # None: not taken from a model (weights given directly)
    part: str | None = None
    # the part's attention sites (site l is layer l), resolved once by head_grid: recording reuses them
    sites: tuple[AttentionSite, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def ragged(self) -> bool:
        """True when some layer lacks one of the columns (a pruned model)."""
        return any(len(kept) != len(self.heads) for kept in self.layer_heads)

    @property
    def present(self) -> torch.Tensor:
        """(layers, heads) bool: True where the layer has the head, False where it was pruned."""
        mask = torch.zeros(len(self.layers), len(self.heads), dtype=torch.bool)
        for row, kept in enumerate(self.layer_heads):
            mask[row, [self.heads.index(head) for head in kept]] = True
        return mask

    def pad(self, per_layer: Sequence[torch.Tensor | None], fill: float = 0.0) -> torch.Tensor:
        """One (layers, heads, *rest) tensor from each row's (len(layer_heads[r]), *rest) (None: a row with no
        head), with ``fill`` in the cells of pruned heads."""
        first = next(values for values in per_layer if values is not None)
        out = torch.full((len(self.layers), len(self.heads), *first.shape[1:]), fill, dtype=first.dtype)
        for row, (kept, values) in enumerate(zip(self.layer_heads, per_layer, strict=True)):
            if values is not None and kept:
                out[row, [self.heads.index(head) for head in kept]] = values
        return out


def is_causal_part(model: torch.nn.Module, part: str | None = None) -> bool:
    """True when ``part`` of ``model`` (default its first) is causal: query i sees keys 0..i only.

    That is a model whose ``is_causal`` attribute says so (a decoder-only transformers checkpoint on our
    kernel, :class:`~multihead.integrations.transformers_models.TransformersModel`; our own
    :class:`~multihead.lab.models.Encoder` has none: not causal), or an encoder-decoder's "decoder" part. An
    unknown part raises ValueError naming the model's parts.
    """
    part, _ = part_sites(model, part)
    return _causal(model, part)


def _causal(model: torch.nn.Module, part: str | None) -> bool:
    """:func:`is_causal_part` of a part already resolved (its name, as ``part_sites`` gave it)."""
    return part == "decoder" or getattr(model, "is_causal", False) is True


def head_numbers(
    model: torch.nn.Module, *, part: str | None = None, sites: Sequence[AttentionSite] | None = None
) -> tuple[list[list[int]], int]:
    """Every attention layer's heads by their checkpoint numbers (``model.head_ids`` when the model keeps
    them, else 0, 1, ... per layer), and how many heads a layer of the checkpoint had.

    The layers are those of ``part`` (default: the model's first part, the layers
    :func:`~multihead.capture.capture` numbers by default; see
    :func:`~multihead.capture.attention_sites`). An unknown part raises ValueError naming the model's
    parts. ``sites``: the part's sites when the caller resolved them already.
    """
    if sites is None:
        _, sites = part_sites(model, part)
    counts = [site.num_heads for site in sites]
    numbers = getattr(model, "head_ids", None)
    if numbers is None:
        numbers = [list(range(count)) for count in counts]
    elif len(numbers) != len(counts) or any(len(ids) != count for ids, count in zip(numbers, counts, strict=True)):
        raise bad_argument(
            "model.head_ids",
            f"one list per attention layer, of its heads ({counts})",
            [len(ids) for ids in numbers],
            "prune with model.prune_heads, which keeps head_ids in step with the layers",
        )
    total = max(max(ids, default=-1) + 1 for ids in numbers)
    config_heads = getattr(getattr(model, "config", None), "num_heads", None)
    if isinstance(config_heads, int) and config_heads > total:
        total = config_heads
    return [list(ids) for ids in numbers], total


def head_grid(
    model: torch.nn.Module,
    layers: Sequence[int] | int | None = None,
    heads: Sequence[int] | int | None = None,
    *,
    part: str | None = None,
) -> HeadGrid:
    """The :class:`HeadGrid` of ``model``'s chosen layers and heads (both default all) in ``part`` (default:
    the model's first; the grid records which).

    ``heads`` are checkpoint head numbers (see :class:`HeadGrid`); a layer that lacks one of them (it was
    pruned) has that cell empty. A head that no chosen layer has, or a part the model lacks, raises
    ValueError.
    """
    part, sites = part_sites(model, part)  # the one walk of the model's modules an inspection makes
    numbers, total = head_numbers(model, part=part, sites=sites)
    rows = checked_indices("layers", layers, len(numbers), "layer")
    if heads is None:
        columns = sorted({head for row in rows for head in numbers[row]})
    else:
        columns = checked_indices("heads", heads, total, "head")
        if len(set(columns)) != len(columns):
            twice = next(head for head in columns if columns.count(head) > 1)
            raise bad_argument("heads", "each head once", f"head {twice} twice", "list every head once")
        kept = sorted({head for row in rows for head in numbers[row]})
        for head in columns:
            if head not in kept:
                where = ", ".join(map(str, rows))
                raise bad_argument(
                    "heads",
                    f"heads that a chosen layer still has ({kept})",
                    f"{head}, pruned from layer{'s' if len(rows) > 1 else ''} {where}",
                    "pick heads the chosen layers have, or other layers",
                )
    layer_heads = [[head for head in columns if head in numbers[row]] for row in rows]
    positions = [
        [numbers[row].index(head) for head in row_heads] for row, row_heads in zip(rows, layer_heads, strict=True)
    ]
    return HeadGrid(rows, columns, layer_heads, positions, part, tuple(sites))


class GridRecorder:
    """Records the attention weights of a :class:`HeadGrid`'s heads while active (use :func:`record_grid`):
    one :class:`~multihead.capture.Recorder` per layer of the grid's part, each with that layer's
    own heads."""

    def __init__(self, model: torch.nn.Module, grid: HeadGrid):
        if grid.positions is None:
            raise bad_argument(
                "grid", "a HeadGrid of a model (head_grid(model))", "one without positions", "use head_grid"
            )
        self.grid = grid
        self._recorders: list[Recorder | None] = [
            Recorder(model, part=grid.part, sites=grid.sites, layers=[layer], heads=positions) if positions else None
            for layer, positions in zip(grid.layers, grid.positions, strict=True)
        ]
        self._stack = ExitStack()

    def __enter__(self) -> GridRecorder:
        with ExitStack() as stack:
            for recorder in self._recorders:
                if recorder is not None:
                    stack.enter_context(recorder)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def weights(self) -> list[torch.Tensor | None]:
        """Per row of the grid, the latest pass's (b, len(layer_heads[row]), i, j) weights (None: no head):
        i query positions, j key positions (j differs from i in cross-attention)."""
        return [
            None if recorder is None else recorder.weights(layer)
            for layer, recorder in zip(self.grid.layers, self._recorders, strict=True)
        ]

    def clear(self) -> None:
        """Forget every recorded pass."""
        for recorder in self._recorders:
            if recorder is not None:
                recorder.clear()


def record_grid(model: torch.nn.Module, grid: HeadGrid) -> GridRecorder:
    """A context manager recording the weights of ``grid``'s heads, in the grid's part (``head_grid(model,
    part=...)``), in every forward pass inside it."""
    return GridRecorder(model, grid)
