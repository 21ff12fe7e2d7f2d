"""A small training loop that knows nothing of the model: AdamW on ``loss_fn(model, make_batch(generator))``.

    make_batch = lambda generator: induction_batch(8, 16, 32, generator=generator)
    history = train(model, make_batch, steps=500, lr=1e-3, seed=0,
                    loss_fn=lambda model, batch: per_position_loss(model(batch.ids), batch.ids).mean(),
                    log_every=50, on_log=lambda model, step: {"induction": induction_score(weights_of(model), 16)})
    history_to_json(history, "run/history.json")
    plot_history(history, "run/curves.png")

The run is a function of ``seed``: the batches come from a ``torch.Generator`` seeded with it, handed to
``make_batch``, and torch's global generator (dropout, sampling in the model) is seeded with it for the run and put
back afterwards. The same model state, seed and arguments give the same losses, bit for bit, on one machine.

The history is a list of plain dicts, one per log: ``step`` (optimizer updates done), ``loss`` (the mean training
loss over the updates since the previous log), ``tokens_per_s`` (tokens of those updates over their wall time,
``on_log`` excluded) and whatever ``on_log`` measured (tensors become numbers and nested lists, ready for JSON).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from multihead._errors import bad_argument, describe, positive_int
from multihead._figures import pyplot, save_figure
from multihead._userfiles import output_file, writing

__all__ = ["train", "history_to_json", "plot_history", "count_tokens"]

History = list[dict[str, Any]]
RESERVED = ("step", "loss", "tokens_per_s")


def count_tokens(batch: object) -> int:
    """Tokens in a batch: a tensor's elements, those of its ``ids`` (or ``source`` and ``decoder_input``), or those
    of the first tensor of a tuple or list."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    ids = getattr(batch, "ids", None)
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    parts = [getattr(batch, name, None) for name in ("source", "decoder_input")]
    if all(isinstance(part, torch.Tensor) for part in parts):
        return sum(part.numel() for part in parts if isinstance(part, torch.Tensor))
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0].numel()
    raise bad_argument(
        "count_tokens",
        "a function counting the tokens of make_batch's batches",
        f"the default, which cannot count a {type(batch).__name__}",
        "pass count_tokens=lambda batch: <its number of tokens>",
        kind=TypeError,
    )


def _number(name: str, value: object, *, low: float, inclusive: bool) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad_argument(name, "a number", describe(value), f"pass {name} as a float", kind=TypeError)
    bad = not math.isfinite(value) or (value < low if inclusive else value <= low)
    if bad:
        bound = f">= {low}" if inclusive else f"> {low}"
        raise bad_argument(name, f"a finite number {bound}", value, f"pass {name} {bound}")
    return float(value)


def _callable(name: str, value: object, signature: str) -> None:
    if not callable(value):
        raise bad_argument(name, f"a function {signature}", describe(value), f"pass {name}={signature}", kind=TypeError)


def _plain(value: object, name: str) -> Any:
    """A value ``on_log`` returned, as JSON-ready data: numbers, nested lists (tensors converted)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(item, name) for item in value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_argument(
            "on_log",
            "a dict of numbers, tensors or lists of numbers",
            f"{name!r}: {describe(value)}",
            "return scores as floats or tensors",
            kind=TypeError,
        )
    return value


def _trainable_parameters(model: object) -> list[nn.Parameter]:
    """The parameters of ``model`` that require grad: the ones AdamW updates (and clips)."""
    if not isinstance(model, nn.Module):
        raise bad_argument("model", "a torch.nn.Module", describe(model), "pass the model to train", kind=TypeError)
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if not parameters:
        raise bad_argument(
            "model", "a module with trainable parameters", "none that require grad", "unfreeze the parameters"
        )
    return parameters


def _check_callbacks(make_batch: object, loss_fn: object, count_tokens: object, on_log: object) -> None:
    """Each function :func:`train` calls back is callable (``on_log`` may be None)."""
    _callable("make_batch", make_batch, "lambda generator: batch")
    _callable("loss_fn", loss_fn, "lambda model, batch: loss")
    _callable("count_tokens", count_tokens, "lambda batch: int")
    if on_log is not None:
        _callable("on_log", on_log, "lambda model, step: {name: value}")


def _check_seed(seed: object) -> None:
    """``seed`` is an int that ``torch.Generator.manual_seed`` takes: 0..2**63 - 1."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise bad_argument("seed", "an int", describe(seed), "pass seed=0", kind=TypeError)
    if not 0 <= seed < 2**63:
        raise bad_argument("seed", "an int in 0..2**63 - 1", seed, "pass seed=0")


def _checked_loss(loss: object, lr: float, step: int) -> torch.Tensor:
    """``loss_fn``'s result, checked: a one-element tensor with a graph to the parameters, and finite (a loss
    that is not finite means the learning rate blew the parameters up, so the error names ``lr``)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise bad_argument(
            "loss_fn",
            "a function returning a scalar tensor that depends on the model's parameters",
            describe(loss),
            "return the mean loss of the batch, computed from the model's output",
            kind=TypeError,
        )
    if not bool(torch.isfinite(loss.detach())):
        raise bad_argument(
            "lr",
            "a learning rate at which the loss stays finite",
            f"{lr} (the loss was {loss.item()} at update {step})",
            "lower lr (or set max_grad_norm)",
        )
    return loss


def _update(
    optimizer: torch.optim.Optimizer,
    parameters: list[nn.Parameter],
    loss: torch.Tensor,
    max_grad_norm: float | None,
) -> None:
    """One optimizer update on ``loss`` (one element, any shape): fresh gradients, clipped to ``max_grad_norm``
    (their global norm; None: not clipped), then the step."""
    optimizer.zero_grad(set_to_none=True)
    loss.reshape(()).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
    optimizer.step()


def _log_entry(step: int, losses: list[torch.Tensor], tokens: int, elapsed: float) -> dict[str, Any]:
    """A log's reserved fields from the updates since the previous log: ``losses``, their () losses; ``tokens``
    and ``elapsed`` (seconds), what they read and took."""
    return {
        "step": step,
        "loss": torch.stack(losses).double().mean().item(),
        "tokens_per_s": tokens / elapsed if elapsed > 0 else math.inf,
    }


def _measurements(
    model: nn.Module, step: int, on_log: Callable[[nn.Module, int], Mapping[str, Any] | None]
) -> dict[str, Any]:
    """What ``on_log(model, step)`` measured, JSON-ready, with ``model`` in eval mode and gradients off for the
    call (back in training mode afterwards); {} when it returned None."""
    model.eval()
    with torch.no_grad():
        measured = on_log(model, step)
    model.train()
    if measured is None:
        return {}
    if not isinstance(measured, Mapping):
        raise bad_argument(
            "on_log",
            "a function returning a dict (or None)",
            describe(measured),
            "return {name: value}",
            kind=TypeError,
        )
    plain: dict[str, Any] = {}
    for name, value in measured.items():
        # the reserved keys are train's own: a measurement must not overwrite them
        if not isinstance(name, str) or name in RESERVED:
            raise bad_argument(
                "on_log",
                f"a dict with string keys other than {', '.join(RESERVED)}",
                f"the key {name!r}",
                "rename the measurement",
            )
        plain[name] = _plain(value, name)
    return plain


def train(
    model: nn.Module,
    make_batch: Callable[[torch.Generator], Any],
    *,
    steps: int,
    lr: float,
    seed: int,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    log_every: int = 10,
    on_log: Callable[[nn.Module, int], Mapping[str, Any] | None] | None = None,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    count_tokens: Callable[[Any], int] = count_tokens,
) -> History:
    """Train ``model`` in place for ``steps`` AdamW updates and return the history of its logs.

    Args:
        model: any torch module; it is put in training mode for the updates and back in its own mode afterwards.
        make_batch: ``make_batch(generator) -> batch``, drawing the batch from the run's generator (seeded with
            ``seed``, on the device of the model's first parameter).
        steps: the number of optimizer updates, >= 1.
        lr: AdamW's learning rate, > 0.
        seed: seeds the batch generator and, for the run only, torch's global generator.
        loss_fn: ``loss_fn(model, batch) -> loss``, a scalar tensor to minimise.
        log_every: log after every ``log_every`` updates, and after the last.
        on_log: ``on_log(model, step) -> {name: value}`` or None, called at each log with the model in eval mode
            and gradients off; its numbers (floats, tensors, nested lists) join the log's dict. Put the progress
            bar here too.
        weight_decay: AdamW's decoupled weight decay, >= 0.
        max_grad_norm: clip the gradients' global norm to this (> 0) before each update; None: no clipping.
        count_tokens: ``count_tokens(batch) -> int`` for ``tokens_per_s`` (the default counts ``batch.ids``,
            a tensor batch, or the first tensor of a tuple).

    Returns:
        A list of dicts: ``{"step", "loss", "tokens_per_s", **on_log's}``.

    Raises:
        ValueError naming ``lr`` when the loss stops being finite (the model's parameters are then not trusted:
        the run stops at that update, before stepping on it).
    """
    parameters = _trainable_parameters(model)
    _check_callbacks(make_batch, loss_fn, count_tokens, on_log)
    steps = positive_int("steps", steps)
    log_every = positive_int("log_every", log_every)
    lr = _number("lr", lr, low=0.0, inclusive=False)
    weight_decay = _number("weight_decay", weight_decay, low=0.0, inclusive=True)
    if max_grad_norm is not None:
        max_grad_norm = _number("max_grad_norm", max_grad_norm, low=0.0, inclusive=False)
    _check_seed(seed)

    device = parameters[0].device
    generator = torch.Generator(device=device).manual_seed(seed)
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    devices = [device] if device.type == "cuda" else []
    was_training = model.training
    history: History = []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            model.train()
            losses: list[torch.Tensor] = []
            tokens = 0
            started = time.perf_counter()
            for step in range(1, steps + 1):
                batch = make_batch(generator)
                tokens += count_tokens(batch)
                loss = _checked_loss(loss_fn(model, batch), lr, step)
                _update(optimizer, parameters, loss, max_grad_norm)
                losses.append(loss.detach().reshape(()))
                if step % log_every and step != steps:
                    continue
                # timed before on_log, so that tokens_per_s measures the updates only
                entry = _log_entry(step, losses, tokens, time.perf_counter() - started)
                if on_log is not None:
                    entry.update(_measurements(model, step, on_log))
                history.append(entry)
                losses, tokens = [], 0
                started = time.perf_counter()
        finally:
            model.train(was_training)
    return history


def _json_ready(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN or infinity
    if isinstance(value, list):
        return [_json_ready(item) for item in value]
    return value


def history_to_json(
    history: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, meta: Mapping[str, Any] | None = None
) -> str:
    """Write ``{"meta": meta, "history": history}`` to ``path`` (a .json file; its folder is created).

    Non-finite numbers (a tokens/s of infinity on a too fast first log) are written as null, so that the file is
    strict JSON. Returns the path written, as a string.
    """
    if not isinstance(history, (list, tuple)) or not all(isinstance(entry, Mapping) for entry in history):
        raise bad_argument("history", "a list of dicts (train's result)", describe(history), "pass train(...)'s result")
    if meta is not None and not isinstance(meta, Mapping):
        raise bad_argument("meta", "a dict or None", describe(meta), "pass meta={'task': 'induction', ...}")
    target = output_file("path", path, suffixes=(".json",), fix="pass a path ending in .json in a writable folder")
    data = {
        "meta": dict(meta or {}),
        "history": [{key: _json_ready(value) for key, value in entry.items()} for entry in history],
    }
    try:
        text = json.dumps(data, indent=1, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise bad_argument(
            "history", "numbers and lists of numbers", f"a value JSON cannot hold ({error})", "log numbers only"
        ) from None
    with writing("path", target):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n", encoding="utf-8")
    return str(target)


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[list[float]], list[str | None]]:
    """``key``'s values over the logs as curves and their labels: one unlabelled curve for a number, one per head
    ("h2") of an (h,) list, one per layer and head ("L1 h2") of an (layers, h) list."""
    values = [torch.tensor(entry[key], dtype=torch.float64) for entry in history]
    shapes = {tuple(value.shape) for value in values}
    if len(shapes) != 1:
        raise bad_argument(
            "history", f"{key!r} with one size at every log", f"shapes {sorted(shapes)}", "log the same heads each time"
        )
    shape = values[0].shape
    labels: list[str | None]
    if len(shape) == 0:
        labels = [None]
    elif len(shape) == 1:
        labels = [f"h{head}" for head in range(shape[0])]
    else:
        labels = [" ".join(f"{'Lh'[min(axis, 1)]}{i}" for axis, i in enumerate(index)) for index in _indices(shape)]
    rows = [value.flatten().tolist() for value in values]
    return [list(curve) for curve in zip(*rows, strict=True)], labels


def _indices(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every index of ``shape`` in row-major order."""
    found: list[tuple[int, ...]] = [()]
    for size in shape:
        found = [index + (i,) for index in found for i in range(size)]
    return found


def plot_history(
    history: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, keys: Sequence[str] | None = None
) -> str:
    """Draw the loss and each measured score over the steps into a PNG at ``path``; returns the path written.

    One panel per key: the loss first, then ``keys`` (default: every measured key, in the first log's order,
    tokens/s left out). A key holding a list per log (scores per head, or per layer and head) draws one line per
    entry, labelled ``h<head>`` for an (h,) score and ``L<layer> h<head>`` for a (layers, h) one. Needs matplotlib.
    """
    if not isinstance(history, (list, tuple)) or not history or not all(isinstance(e, Mapping) for e in history):
        raise bad_argument("history", "a non-empty list of dicts", describe(history), "pass train(...)'s result")
    target = output_file("path", path, suffixes=(".png",), fix="pass a path ending in .png in a writable folder")
    available = [key for key in history[0] if key not in ("step", "tokens_per_s")]
    chosen = available if keys is None else ["loss", *[key for key in keys if key != "loss"]]
    for key in chosen:
        if any(key not in entry for entry in history):
            raise bad_argument(
                "keys", f"keys every log has ({', '.join(available)})", repr(key), "pass keys the history logged"
            )
    steps = [entry["step"] for entry in history]
    curves = {key: _series(history, key) for key in chosen}
    plt = pyplot("plot_history")
    figure, axes = plt.subplots(len(chosen), 1, figsize=(6.4, 2.2 * len(chosen)), sharex=True, squeeze=False)
    for axis, key in zip(axes[:, 0], chosen, strict=True):
        lines, labels = curves[key]
        for curve, label in zip(lines, labels, strict=True):
            axis.plot(steps, curve, label=label, linewidth=1.2)
        axis.set_ylabel(key)
        axis.grid(alpha=0.3)
        if 1 < len(lines) <= 16:
            axis.legend(fontsize=6, ncol=min(len(lines), 8), loc="best")
    axes[-1, 0].set_xlabel("step")
    with writing("path", target):
        save_figure(figure, target)
    return str(target)


def check_run_settings(settings: Any) -> None:
    """The optimiser and logging fields every run's settings share (``steps``, ``batch``, ``log_every``,
    ``probe_size``: ints >= 1; ``lr`` > 0 and ``weight_decay`` >= 0, finite; ``seed`` in 0..2**63 - 2), checked
    once for :class:`~multihead.lab.train.InductionSettings` and :class:`~multihead.lab.train.ReverseSettings`."""
    for name in ("steps", "batch", "log_every", "probe_size"):
        positive_int(name, getattr(settings, name))
    _number("lr", settings.lr, low=0.0, inclusive=False)
    _number("weight_decay", settings.weight_decay, low=0.0, inclusive=True)
    seed = settings.seed
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63 - 1:
        raise bad_argument("seed", "an int in 0..2**63 - 2", describe(seed), "pass e.g. seed=0")


def train_run(
    model: nn.Module,
    settings: Any,
    make_batch: Callable[[torch.Generator], Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    probe: Callable[[], dict[str, Any]],
    on_log: Callable[[int, Mapping[str, Any]], None] | None = None,
    *,
    count_tokens: Callable[[Any], int] = count_tokens,
) -> History:
    """:func:`train` with a run's settings (``steps``, ``lr``, ``weight_decay``, ``seed``, ``log_every``; see
    :func:`check_run_settings`), logging ``probe()``'s scores at every log and passing them to
    ``on_log(step, scores)`` (a progress bar): the loop every ``multihead train`` task runs."""

    def measure(trained: nn.Module, step: int) -> dict[str, Any]:
        scores = probe()
        if on_log is not None:
            on_log(step, scores)
        return scores

    return train(
        model,
        make_batch,
        steps=settings.steps,
        lr=settings.lr,
        weight_decay=settings.weight_decay,
        seed=settings.seed,
        loss_fn=loss_fn,
        log_every=settings.log_every,
        on_log=measure,
        count_tokens=count_tokens,
    )
