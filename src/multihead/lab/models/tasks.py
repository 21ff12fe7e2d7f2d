"""Synthetic tasks, generated on the fly from a ``torch.Generator`` (no downloads, same seed, same batches).

Token 0 is the beginning-of-sequence token :data:`BOS` in every task; the random tokens are drawn uniformly from
``1 .. vocab_size - 1`` (from ``0 .. vocab_size - 1`` when a task is asked for no BOS).

**Induction** (:func:`induction_batch`): a random sequence of ``L = half_length`` tokens, repeated once, as in
Olsson et al. 2022 ("In-context Learning and Induction Heads") and TransformerLens' induction-head test
(``make_repeated_tokens``)::

    position   0     1   ...  L     L+1  ...  2L          (with bos; without it, every index is one less)
    token      BOS   x_1 ...  x_L   x_1  ...  x_L

The second copy is predictable only by looking back: at a position t of the second copy (token x_{t-L} with
bos), the token's previous occurrence is at t - L and the token that followed it at t - L + 1, which is what an
induction head attends to (see :func:`multihead.lab.train.scores.induction_score`).

Train on ``min_half_length=``: with one L in every batch, "attend L - 1 positions back" solves the task from
positions alone (a rotary or learned-position head learns that offset, and even a one-layer model copies), so no
previous-token head is needed and Olsson et al.'s two-layer circuit need not form. With ``min_half_length`` each
sequence repeats a segment of its own length L_i in ``min_half_length .. half_length``, after ``2 (L - L_i)``
random filler tokens (every sequence keeps n = 2L + 1 positions): the offset back to the previous occurrence varies,
and only matching the token finds it. Measure the scores on a batch with one L (the default), as TransformerLens
does.

**Reverse** (:func:`reverse_batch`): an encoder-decoder alignment task. The encoder reads random source tokens; the
decoder must write them reversed, so target position s copies source position ``L - 1 - s``: a cross-attention head
that aligns target with source attends there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from multihead._errors import bad_argument, describe, positive_int
from multihead.lab.models.symbols import task_symbols

__all__ = ["BOS", "InductionBatch", "ReverseBatch", "induction_batch", "reverse_batch", "example_text"]

BOS = 0
"""The beginning-of-sequence token of every task (never drawn as a random token when a task uses it)."""


def _generator(generator: object) -> torch.Generator:
    if not isinstance(generator, torch.Generator):
        raise bad_argument(
            "generator",
            "a torch.Generator",
            describe(generator),
            "pass generator=torch.Generator().manual_seed(seed)",
            kind=TypeError,
        )
    return generator


def _tokens(name: str, vocab_size: object, bos: bool) -> int:
    vocab_size = positive_int(name, vocab_size)
    low = 1 if bos else 0
    if vocab_size - low < 2:
        raise bad_argument(
            name,
            f"at least {low + 2} tokens (two to draw from{', plus BOS' if bos else ''})",
            vocab_size,
            f"pass {name} >= {low + 2}",
        )
    return vocab_size


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise bad_argument(name, "True or False", describe(value), f"pass {name}=True or {name}=False", kind=TypeError)
    return value


@dataclass(frozen=True)
class InductionBatch:
    """A batch of repeated random sequences.

    ids: (b, n) int64, n = 2L + 1 with bos (``[BOS, x_1..x_L, x_1..x_L]``), 2L without.
    repeated: (b, n) bool, True at each sequence's second copy: positions ``offset + 2L - L_i .. offset + 2L - 1``
        (``offset + L .. offset + 2L - 1`` when every L_i = L).
    previous: (b, n) int64, at a position t of the second copy the position t - L_i of the same token in the first
        copy; -1 elsewhere. The token after that occurrence (the induction target) is at ``previous + 1``.
    lengths: (b,) int64, each sequence's segment length L_i (all L unless ``min_half_length`` was given).
    half_length: L. offset: 1 with bos, else 0 (the first copy starts there when L_i = L).
    """

    ids: torch.Tensor
    repeated: torch.Tensor
    previous: torch.Tensor
    lengths: torch.Tensor
    half_length: int
    offset: int

    @property
    def bos(self) -> bool:
        return self.offset == 1


def induction_batch(
    batch: int,
    half_length: int,
    vocab_size: int,
    *,
    generator: torch.Generator,
    bos: bool = True,
    min_half_length: int | None = None,
) -> InductionBatch:
    """``batch`` sequences of ``half_length`` random tokens repeated once, after a BOS token when ``bos``.

    Args:
        batch: b, the number of sequences.
        half_length: L >= 2, the length of the random segment (the score and loss of the repeated half need a
            token after the first: with L = 1 the "next token" would be the query itself).
        vocab_size: the model's vocabulary; tokens are drawn from 1..vocab_size-1 (0..vocab_size-1 without bos).
        generator: the torch.Generator the tokens come from; ``ids`` lives on its device.
        bos: prefix each sequence with :data:`BOS` (TransformerLens does; it gives heads a place to rest).
        min_half_length: None (every sequence repeats L tokens), or 2 .. L: each sequence repeats L_i tokens, L_i
            uniform in min_half_length .. L, after 2 (L - L_i) random filler tokens (for training: see the module).

    Returns:
        An :class:`InductionBatch`: ``ids`` (b, 2L + 1) with bos, (b, 2L) without; ``repeated``, ``previous`` (b, n).

    >>> batch = induction_batch(2, 3, 10, generator=torch.Generator().manual_seed(0))
    >>> batch.ids.shape, batch.repeated[0].nonzero().flatten().tolist(), batch.previous[0].tolist()
    (torch.Size([2, 7]), [4, 5, 6], [-1, -1, -1, -1, 1, 2, 3])
    >>> bool((batch.ids[:, 1:4] == batch.ids[:, 4:7]).all())
    True
    >>> varied = induction_batch(1, 3, 10, generator=torch.Generator().manual_seed(0), min_half_length=2)
    >>> varied.lengths.tolist(), varied.previous.tolist()
    ([2], [[-1, -1, -1, -1, -1, 3, 4]])
    """
    batch = positive_int("batch", batch)
    half_length = positive_int("half_length", half_length)
    if half_length < 2:
        raise bad_argument(
            "half_length",
            "at least 2 (a repeated token needs a successor to copy)",
            half_length,
            "pass half_length >= 2",
        )
    bos = _flag("bos", bos)
    vocab_size = _tokens("vocab_size", vocab_size, bos)
    generator = _generator(generator)
    if min_half_length is not None:
        min_half_length = positive_int("min_half_length", min_half_length)
        if not 2 <= min_half_length <= half_length:
            raise bad_argument(
                "min_half_length",
                f"None or a length in 2..half_length ({half_length})",
                min_half_length,
                f"pass min_half_length in 2..{half_length}, or None for one length",
            )
    offset = int(bos)
    device = generator.device
    if min_half_length is None:
        lengths = torch.full((batch,), half_length, dtype=torch.long, device=device)
        segment = torch.randint(
            offset, vocab_size, (batch, half_length), generator=generator, device=device, dtype=torch.long
        )  # (b, L)
        body = torch.cat([segment, segment], dim=1)  # (b, 2L)
    else:
        lengths = torch.randint(
            min_half_length, half_length + 1, (batch,), generator=generator, device=device, dtype=torch.long
        )  # (b,)
        tokens = torch.randint(
            offset, vocab_size, (batch, 2 * half_length), generator=generator, device=device, dtype=torch.long
        )  # (b, 2L): filler, then the first copy, then the columns the second copy overwrites
        columns = torch.arange(2 * half_length, device=device)[None]  # (1, 2L)
        second = columns >= 2 * half_length - lengths[:, None]  # (b, 2L)
        body = tokens.gather(1, torch.where(second, columns - lengths[:, None], columns))  # (b, 2L)
    if bos:
        body = torch.cat([torch.full((batch, 1), BOS, dtype=torch.long, device=device), body], dim=1)
    ids = body  # (b, offset + 2L)
    n = ids.shape[1]
    positions = torch.arange(n, device=device)[None]  # (1, n)
    repeated = positions >= n - lengths[:, None]  # (b, n)
    previous = torch.where(repeated, positions - lengths[:, None], -1)  # (b, n)
    return InductionBatch(
        ids=ids, repeated=repeated, previous=previous, lengths=lengths, half_length=half_length, offset=offset
    )


@dataclass(frozen=True)
class ReverseBatch:
    """A batch of the reverse task, laid out for teacher forcing.

    source: (b, L) int64, the encoder's input (random tokens, never BOS).
    target: (b, L) int64, ``source`` reversed: ``target[:, s] == source[:, L - 1 - s]``.
    decoder_input: (b, L) int64, ``[BOS, target[:, :-1]]``: decoder position s reads the target so far and
        predicts ``target[:, s]``.
    alignment: (L,) int64, the source position each decoder position s should attend to: ``L - 1 - s``.
    """

    source: torch.Tensor
    target: torch.Tensor
    decoder_input: torch.Tensor
    alignment: torch.Tensor


def reverse_batch(batch: int, length: int, vocab_size: int, *, generator: torch.Generator) -> ReverseBatch:
    """``batch`` random source sequences of ``length`` tokens (from 1..vocab_size-1) and their reversal.

    Returns a :class:`ReverseBatch`: source, target, decoder_input (b, L) and alignment (L,), on the generator's
    device.

    >>> task = reverse_batch(1, 4, 10, generator=torch.Generator().manual_seed(0))
    >>> task.target.tolist() == [task.source[0].flip(0).tolist()], task.alignment.tolist()
    (True, [3, 2, 1, 0])
    """
    batch = positive_int("batch", batch)
    length = positive_int("length", length)
    vocab_size = _tokens("vocab_size", vocab_size, True)
    generator = _generator(generator)
    device = generator.device
    source = torch.randint(1, vocab_size, (batch, length), generator=generator, device=device, dtype=torch.long)
    target = source.flip(1)  # (b, L)
    start = torch.full((batch, 1), BOS, dtype=torch.long, device=device)
    decoder_input = torch.cat([start, target[:, :-1]], dim=1)  # (b, L)
    alignment = torch.arange(length - 1, -1, -1, device=device)  # (L,)
    return ReverseBatch(source=source, target=target, decoder_input=decoder_input, alignment=alignment)


def example_text(task: str, settings: Mapping[str, Any], *, seed: int = 0) -> str:
    """One input of ``task`` as the text a checkpoint's symbols spell (what ``multihead inspect`` shows a trained
    model when no text is given): for "induction" a segment of ``half_length`` symbols repeated after ``<bos>``,
    for "reverse" a source of ``length`` symbols. ``settings``: the run's settings (as saved with it).

    >>> example_text("induction", {"half_length": 3, "vocab_size": 6})
    '<bos> e e d e e d'
    """
    generator = torch.Generator().manual_seed(seed)
    symbols = task_symbols(int(settings["vocab_size"]))
    if task == "induction":
        ids = induction_batch(1, int(settings["half_length"]), len(symbols), generator=generator).ids[0]
    elif task == "reverse":
        ids = reverse_batch(1, int(settings["length"]), len(symbols), generator=generator).source[0]
    else:
        raise bad_argument("task", '"induction" or "reverse"', repr(task), "pass a task multihead train runs")
    return " ".join(symbols[int(token)] for token in ids)
