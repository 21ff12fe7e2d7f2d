"""What a `multihead train` checkpoint folder holds beside its weights, resolved for inspecting it.

A folder written by ``multihead train`` (``run.save(...)["model"]``) carries, in its ``behaviours.json``, the task
the model learned and the behaviour probes measured on one part of its attention (see
:mod:`multihead.lab.inspect.behaviours`). :func:`saved_model_extras` reads them for a loaded model: the part to show
(the one the probes measured, unless another is asked for), the probes' measures of it, and an input of the task::

    model = multihead.integrations.load_text_model("multihead-train/model")
    extras = multihead.lab.inspect.saved_model_extras("multihead-train/model", model)
    extras.part                  # "self" (an induction decoder) or "cross" (a reverse run's encoder-decoder)
    extras.task_text             # '<bos> e k c ... e k c': an input of the task the model learned
    inspection = multihead.lab.inspect.inspect_text(
        model, extras.task_text, part=extras.part, behaviours=extras.behaviours
    )
    columns = inspection.head_columns(extras.probe_columns())   # the probes as columns of the HTML report

Any other folder (a downloaded checkpoint, a pruned MiniLM) has none of them: every field is then None, and the
part is the one asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from multihead._errors import bad_argument, describe
from multihead.capture import part_sites
from multihead.lab.inspect.behaviours import BEHAVIOURS_FILE, read_behaviours, read_task
from multihead.lab.models.tasks import example_text

__all__ = ["SavedModelExtras", "saved_model_extras"]

_TASKS = ("induction", "reverse")  # the tasks whose checkpoints example_text spells an input of
_FIX_RUN = "train the model again with multihead train (it writes the file)"


@dataclass(frozen=True)
class SavedModelExtras:
    """What a checkpoint folder adds to inspecting its model (see the module docstring).

    ``part``: the part of the model's attention to show ("self", "encoder", "decoder" or "cross"); None for the
    model's first. ``behaviours``: the probes' measures of that part, ``{name: (layers, heads)}`` float64 over
    every layer of the part and the checkpoint's head numbers (NaN where a probe did not measure a head), or None
    when the folder saved no probes of it: what :func:`~multihead.lab.inspect.inspect_text` takes as ``behaviours``.
    ``task_text``: an input of the task the model was trained on, in the checkpoint's symbols (None for a model
    not trained by ``multihead train``).
    """

    part: str | None = None
    behaviours: dict[str, torch.Tensor] | None = None
    task_text: str | None = None

    def probe_columns(self) -> dict[str, list[list[float | None]]]:
        """The probes' measures as per-head columns of the HTML report, ``{"<name> (probe)": (layers, heads)}``
        nested lists over every layer of the part (empty without probes); cut them to the heads an inspection
        shows with :meth:`~multihead.lab.inspect.Inspection.head_columns`."""
        return {f"{name} (probe)": values.tolist() for name, values in (self.behaviours or {}).items()}


def saved_model_extras(folder: str | Path | None, model: torch.nn.Module, part: str | None = None) -> SavedModelExtras:
    """Read what the checkpoint ``folder`` saved beside ``model``'s weights, for inspecting ``model``.

    Args:
        folder: the folder ``model`` was loaded from (e.g. by :func:`multihead.integrations.load_text_model`);
            None for a model that came from no folder (the bundled all-MiniLM-L6-v2): nothing to read.
        model: the model loaded from ``folder``: its attention parts decide which saved probes apply.
        part: the part to show; None: the part the probes measured when the folder saved one part's (a
            ``train reverse`` checkpoint: its cross-attention), else the model's first.

    Returns:
        :class:`SavedModelExtras`: the part (``part`` as given when the folder has no probes: it is checked where
        it is used), the probes of that part ({name: (layers, heads)} or None) and an input of the task (or
        None).

    Raises:
        InputError (a ValueError) naming ``behaviours.json`` when the folder's file is damaged (unreadable, not of
        the form ``multihead train`` writes, or a task it does not run); ValueError naming ``part`` when the folder
        has probes and ``model`` has no such part (the error lists its parts).
    """
    if folder is None:
        return SavedModelExtras(part=part)
    saved = read_behaviours(folder)
    if saved is None:  # not a `multihead train` checkpoint: no probes and no task
        return SavedModelExtras(part=part)
    task = read_task(folder)
    assert task is not None  # read_behaviours read the same file
    if part is None and len(saved) == 1:  # the part the probes measured (a reverse run: its cross-attention)
        part = next(iter(saved))
    chosen, _ = part_sites(model, part)
    return SavedModelExtras(part=part, behaviours=saved.get(chosen), task_text=_task_text(*task))


def _task_text(task: str, settings: Mapping[str, Any]) -> str:
    """An input of ``task`` in the checkpoint's symbols; a task or settings the runs do not write is the file's
    damage, said as such (not a KeyError from inside the task)."""
    if task not in _TASKS:
        raise bad_argument(
            BEHAVIOURS_FILE, f"the task of a multihead train run ({' or '.join(_TASKS)})", repr(task), _FIX_RUN
        )
    try:
        return example_text(task, settings)
    except (KeyError, TypeError, ValueError) as error:  # a settings field missing, or not a valid number
        raise bad_argument(
            BEHAVIOURS_FILE, f"the settings of a multihead train {task} run", describe(str(error)), _FIX_RUN
        ) from None
