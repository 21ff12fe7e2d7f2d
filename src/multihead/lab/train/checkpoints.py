"""What `multihead heads importance` measures on a `multihead train` checkpoint: each head's cost to the task it
was trained on, by ablation (the task's own loss, on the run's probe), instead of embedding fidelity on English
text the checkpoint cannot read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from multihead._errors import InputError, bad_argument, describe
from multihead.lab.inspect.behaviours import BEHAVIOURS_FILE
from multihead.lab.inspect.importance import HeadImportance
from multihead.lab.models.seq2seq_reader import Seq2SeqReader
from multihead.lab.models.symbols import DecoderReader
from multihead.lab.train import induction, reverse

__all__ = ["task_importance"]

_FIX = "train the model again with multihead train (it writes the file)"


def task_importance(model: object, task: str, settings: Mapping[str, Any]) -> tuple[HeadImportance, str]:
    """Each head's ablation importance on its checkpoint's task: the increase of the task's loss on the run's
    probe when the head alone is zeroed, in nats (an induction run: the repeated-token loss, every head; a reverse
    run: the teacher-forced loss, the cross-attention heads). Returns the importance and the part it covers.

    ``model``: the checkpoint as :func:`multihead.integrations.load_text_model` opens it; ``task`` and
    ``settings``: as saved with it (:func:`multihead.lab.inspect.behaviours.read_task`).
    """
    try:
        if task == "induction" and isinstance(model, DecoderReader):
            run_settings: Any = induction.InductionSettings(**settings)
            scores = induction.ablation_scores(model.decoder, induction.probe_batch(run_settings))
            what, part = "repeated-token loss", "self"
        elif task == "reverse" and isinstance(model, Seq2SeqReader):
            run_settings = reverse.ReverseSettings(**settings)
            scores = reverse.ablation_scores(model.seq2seq, reverse.probe_batch(run_settings))
            what, part = "teacher-forced loss", "cross"
        else:
            raise bad_argument(
                BEHAVIOURS_FILE,
                "the task of the model beside it (induction: a decoder; reverse: an encoder-decoder)",
                f"task {task!r} for a {type(model).__name__}",
                _FIX,
            )
    except TypeError as error:  # a settings field the run does not have
        raise bad_argument(BEHAVIOURS_FILE, "the settings of a multihead train run", str(error), _FIX) from None
    except InputError as error:  # a settings value the run refuses
        if error.argument == BEHAVIOURS_FILE:
            raise
        raise bad_argument(BEHAVIOURS_FILE, "valid run settings", describe(str(error)), _FIX) from None
    importance = HeadImportance(
        scores["ablated_loss"] - scores["loss"],
        f"increase of the {what} (nats) when the head alone is zero-ablated, on the {task} probe",
        texts=run_settings.probe_size,
    )
    return importance, part
