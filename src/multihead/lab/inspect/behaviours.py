"""Behaviour probes saved beside a checkpoint (``behaviours.json``), which the roles weigh.

A probe measures a head on inputs built for one behaviour, not on the text being inspected: prefix matching and
copying on repeated random segments, alignment on a task with a known source position for every target position
(see :mod:`multihead.lab.train`). ``multihead train`` writes the file into its checkpoint folder; ``multihead inspect
--model`` reads it and passes the measures to :func:`~multihead.lab.inspect.inspect_text` (``behaviours=``), whose
roles weigh them (:mod:`multihead.lab.inspect.roles`).

    {"task": "induction", "part": "self", "settings": {...},
     "behaviours": {"prefix_matching": [[...], ...], "copying": [[...], ...]}}     # (layers, heads) each
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from multihead._errors import bad_argument, describe
from multihead._userfiles import ANY_OBJECT, STRING, path_kind, read_json
from multihead.lab.inspect.roles import BEHAVIOUR_STATISTICS

__all__ = ["BEHAVIOURS_FILE", "plain_measures", "read_behaviours", "read_task", "write_behaviours"]

BEHAVIOURS_FILE = "behaviours.json"  # the probe measures saved beside a checkpoint, which inspect weighs into roles
_FIX_RUN = "train the model again with multihead train (it writes the file)"


def plain_measures(values: Mapping[str, Any]) -> dict[str, Any]:
    """Tensors as nested lists (NaN as None) for JSON."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if isinstance(value, list):
            return [plain(item) for item in value]
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value

    return {name: plain(value) for name, value in values.items()}


def write_behaviours(
    folder: Path, behaviours: Mapping[str, torch.Tensor], *, task: str, part: str, settings: object
) -> Path:
    """``behaviours.json`` in a checkpoint folder: {name: (layers, h)} probe measures of the model's ``part``
    ("self", or "cross" for an encoder-decoder's cross-attention), with the task and the settings (a dataclass)
    they were measured under."""
    path = folder / BEHAVIOURS_FILE
    data = {
        "task": task,
        "settings": dataclasses.asdict(settings),  # type: ignore[call-overload]
        "part": part,
        "behaviours": plain_measures(behaviours),
    }
    path.write_text(json.dumps(data, indent=1, allow_nan=False))
    return path


def _read(folder: str | Path) -> dict[str, Any] | None:
    path = Path(folder) / BEHAVIOURS_FILE
    if path_kind(path) != "file":
        return None
    return read_json(
        BEHAVIOURS_FILE,
        path,
        what="the behaviour probes of a multihead train checkpoint",
        schema={"task": STRING, "part": STRING, "settings": ANY_OBJECT, "behaviours": ANY_OBJECT},
        fix=_FIX_RUN,
    )


def read_task(folder: str | Path) -> tuple[str, dict[str, Any]] | None:
    """The task and settings a checkpoint was trained under (from its ``behaviours.json``), or None."""
    saved = _read(folder)
    return None if saved is None else (saved["task"], saved["settings"])


def read_behaviours(folder: str | Path) -> dict[str, dict[str, torch.Tensor]] | None:
    """The probe measures saved in checkpoint ``folder`` ({part: {name: (layers, h)}}), or None when it has none;
    a damaged file raises an InputError naming it."""
    saved = _read(folder)
    if saved is None:
        return None
    measures = {}
    for name, rows in saved["behaviours"].items():
        if name not in BEHAVIOUR_STATISTICS:
            raise bad_argument(
                BEHAVIOURS_FILE, f"measures named {', '.join(BEHAVIOUR_STATISTICS)}", repr(name), _FIX_RUN
            )
        try:
            values = torch.tensor(
                [[math.nan if v is None else v for v in row] for row in rows], dtype=torch.float64
            )  # (layers, h)
        except (TypeError, ValueError):
            raise bad_argument(
                BEHAVIOURS_FILE, f"{name!r}: rows of numbers, one per layer", describe(rows), _FIX_RUN
            ) from None
        if values.ndim != 2:
            raise bad_argument(BEHAVIOURS_FILE, f"{name!r}: a (layers, heads) table", describe(rows), _FIX_RUN)
        measures[name] = values
    return {saved["part"]: measures}
