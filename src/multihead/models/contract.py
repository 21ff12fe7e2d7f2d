"""The encoder contract every reader of a model relies on: :class:`TextEncoder`, and :func:`evaluating`.

The readers (:func:`multihead.inspect.inspect_text`, :func:`~multihead.inspect.head_stats`,
:func:`~multihead.inspect.syntax_scores`, the importance tools and :meth:`Encoder.encode`) take a
model that reads text: a module with its tokenizer and its name. :class:`multihead.models.Encoder`
is one; an adapter for another library's encoder subclasses :class:`TextEncoder` the same way and
serves every reader alike.

    model, _ = load_minilm()
    tokenizer = text_tokenizer(model)        # the model's Tokenizer, or an error saying how to get one
    with evaluating(model):                  # eval mode and no autograd; the mode is restored after
        states = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from multihead._errors import bad_argument
from multihead.layer import MultiHeadAttention
from multihead.models.tokenizer import TextTokenizer

__all__ = ["TextEncoder", "text_tokenizer", "evaluating"]


class TextEncoder(nn.Module, ABC):
    """A model that reads text: token ids in, token states out, with its tokenizer and its name.

    ``tokenizer``: the :class:`~multihead.models.TextTokenizer` that makes its ids; None for a model built
    without one (it runs on token ids only, and text readers refuse it).
    ``name``: what reports call it (the checkpoint's folder, e.g. "all-MiniLM-L6-v2").
    ``attention_layers``: its :class:`multihead.MultiHeadAttention` layers in order (layer l is the l-th).
    ``forward(input_ids, attention_mask, token_type_ids)``: (b, n) ids -> (b, n, hidden) states.
    """

    tokenizer: TextTokenizer | None
    name: str

    def __init__(self, *, tokenizer: TextTokenizer | None = None, name: str = "encoder") -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.name = name

    @property
    @abstractmethod
    def attention_layers(self) -> list[MultiHeadAttention]:
        """The attention layer of every block, in order (index = layer number)."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(b, n) token ids, (b, n) mask (1 = real token), (b, n) segment ids -> (b, n, hidden) token states."""


def text_tokenizer(model: object, *, argument: str = "model") -> TextTokenizer:
    """The tokenizer of ``model``, a :class:`TextEncoder`: the one check every reader of text makes.

    Raises TypeError (naming ``argument``) for a model that is not a text encoder, and ValueError
    (naming ``<argument>.tokenizer``) for one built without a tokenizer.
    """
    if not isinstance(model, TextEncoder):
        raise bad_argument(
            argument,
            "a text encoder with its tokenizer (multihead.models.load_minilm())",
            type(model).__name__,
            "load the model with multihead.models.load_minilm()",
            kind=TypeError,
        )
    if model.tokenizer is None:
        raise bad_argument(
            f"{argument}.tokenizer",
            "a Tokenizer (multihead.models.load_minilm gives the model with its own)",
            None,
            "load the model with load_minilm(), or call forward() on token ids",
        )
    return model.tokenizer


_Module = TypeVar("_Module", bound=nn.Module)


@contextmanager
def evaluating(model: _Module) -> Iterator[_Module]:
    """Run ``model`` in eval mode without autograd within the block; its previous mode comes back on exit,
    whether the block returns or raises.

    Example:
        >>> layer = torch.nn.Dropout(0.5).train()
        >>> with evaluating(layer):
        ...     layer.training, torch.is_grad_enabled()
        (False, False)
        >>> layer.training
        True
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)
