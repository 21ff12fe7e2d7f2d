"""The encoder contract every reader of a model relies on: :class:`TextEncoder`, and :func:`evaluating`.

The readers (:func:`multihead.lab.inspect.inspect_text`, :func:`~multihead.lab.inspect.head_stats`,
:func:`~multihead.lab.inspect.syntax_scores`, the importance tools and :meth:`Encoder.encode`) take a
model that reads text: a module with its tokenizer and its name. :class:`multihead.lab.models.Encoder`
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
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from multihead._errors import bad_argument, describe
from multihead.lab.models.tokenizer import Pieces, TextTokenizer, TokenBatch
from multihead.layer import MultiHeadAttention

__all__ = ["TextEncoder", "text_tokenizer", "evaluating", "CausalLM"]


class TextEncoder(nn.Module, ABC):
    """A model that reads text: token ids in, token states out, with its tokenizer and its name; its
    sentence embeddings (:meth:`encode`) are mean-pooled states, as sentence-transformers computes them.

    ``tokenizer``: the :class:`~multihead.lab.models.TextTokenizer` that makes its ids; None for a model built
    without one (it runs on token ids only, and text readers refuse it).
    ``name``: what reports call it (the checkpoint's folder, e.g. "all-MiniLM-L6-v2"); ``described_as``: what kind
    of model it is, in words (each subclass says).
    ``attention_layers``: its :class:`multihead.MultiHeadAttention` layers in order (layer l is the l-th).
    ``forward(input_ids, attention_mask, token_type_ids)``: (b, n) ids -> (b, n, hidden) states.
    """

    tokenizer: TextTokenizer | None
    name: str
    # what the model is, in the words a message uses ("..., got NAME, a multihead train checkpoint")
    described_as: str = "a text model"

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

    @staticmethod
    def mean_pool(states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(b, n, hidden) states, (b, n) mask -> (b, hidden) mean over real tokens (sentence-transformers)."""
        weights = attention_mask.to(states.dtype).unsqueeze(-1)  # (b, n, 1)
        return (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)

    def part_pieces(self, batch: TokenBatch, part: str) -> tuple[list[Pieces], list[Pieces]]:
        """The pieces, with their words, along the query and the key axis of ``part``'s attention (see
        :func:`multihead.lab.inspect.attention_sites`), one :class:`~multihead.lab.models.Pieces` per text of
        ``batch``. A one-stack model reads the text itself on both; an encoder-decoder's decoder reads its own
        input, and its cross-attention goes from the decoder's input to the text.
        """
        return batch.pieces, batch.pieces

    def part_tokens(self, batch: TokenBatch, part: str) -> tuple[list[list[str]], list[list[str]]]:
        """The pieces of :meth:`part_pieces` as strings: (queries, keys), one list per text of ``batch``."""
        queries, keys = self.part_pieces(batch, part)
        return [text.tokens for text in queries], [text.tokens for text in keys]

    def encode(
        self, texts: str | list[str], *, batch_size: int = 32, normalize: bool = True, truncate: bool = False
    ) -> torch.Tensor:
        """Sentence embeddings as sentence-transformers computes them: mean pooling, then L2 normalisation.

        Args:
            texts: a string or a list of strings.
            batch_size: texts per forward pass (padded to the longest in the batch).
            normalize: L2-normalise each embedding (sentence-transformers' ``Normalize`` module).
            truncate: cut texts at the tokenizer's ``sentence_max_length`` (256 for all-MiniLM-L6-v2, as
                sentence-transformers does). Without it, texts up to the model's positions (512 for
                all-MiniLM-L6-v2) are encoded whole and longer ones raise.

        Returns:
            (len(texts), hidden) float32 embeddings; (1, hidden) for a single string.

        Example:
            >>> model, tokenizer = multihead.lab.models.load_minilm()
            >>> model.encode(["The bank was full of money.", "We sat on the river bank."]).shape
            torch.Size([2, 384])
        """
        tokenizer = text_tokenizer(self)
        batch_texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(batch_texts, list) or not all(isinstance(t, str) for t in batch_texts):
            raise bad_argument(
                "texts",
                "a string or a list of strings",
                describe(texts),
                "pass e.g. model.encode(['first text', 'second text'])",
                kind=TypeError,
            )
        if not batch_texts:
            raise bad_argument("texts", "at least one text", "an empty list", "pass one or more strings")
        embeddings = []
        with evaluating(self):
            for start in range(0, len(batch_texts), batch_size):
                # truncation cuts where sentence-transformers does; without it, only the position limit applies
                batch = tokenizer.batch(
                    batch_texts[start : start + batch_size],
                    truncate=truncate,
                    max_length=tokenizer.sentence_max_length if truncate else None,
                )
                states = self(batch.input_ids, batch.attention_mask, batch.token_type_ids)
                embeddings.append(self.mean_pool(states, batch.attention_mask))
        pooled = torch.cat(embeddings)  # (len(texts), hidden)
        return F.normalize(pooled, p=2, dim=-1) if normalize else pooled


def text_tokenizer(model: object, *, argument: str = "model") -> TextTokenizer:
    """The tokenizer of ``model``, a :class:`TextEncoder`: the one check every reader of text makes.

    Raises TypeError (naming ``argument``) for a model that is not a text encoder, and ValueError
    (naming ``<argument>.tokenizer``) for one built without a tokenizer.
    """
    if not isinstance(model, TextEncoder):
        raise bad_argument(
            argument,
            "a text encoder with its tokenizer (multihead.lab.models.load_minilm())",
            type(model).__name__,
            "load the model with multihead.lab.models.load_minilm()",
            kind=TypeError,
        )
    if model.tokenizer is None:
        raise bad_argument(
            f"{argument}.tokenizer",
            "a Tokenizer (multihead.lab.models.load_minilm gives the model with its own)",
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


@dataclass(frozen=True)
class CausalLM:
    """A causal language model with its tokenizer, as `multihead circuits` opens a folder: ``model`` (its
    ``forward(ids)`` gives (b, n, vocab) logits: a :class:`~multihead.lab.models.Decoder`, or a transformers
    ``*ForCausalLM`` on the kernel), ``tokenizer`` (its :class:`~multihead.lab.models.TextTokenizer`) and ``name``."""

    model: nn.Module
    tokenizer: TextTokenizer
    name: str

    def ids(self, text: str) -> torch.Tensor:
        """``text`` as the model reads it, special tokens included (a BOS where the tokenizer adds one): (1, n)."""
        if not isinstance(text, str) or not text.strip():
            raise bad_argument("text", "a non-empty text", describe(text), 'pass e.g. "a b c a b"')
        return self.tokenizer.batch([text]).input_ids

    def piece(self, token_id: int) -> str:
        """The tokenizer's piece for ``token_id`` (a symbol, a BPE piece), for reports."""
        read = getattr(self.tokenizer, "piece", None)
        return str(read(token_id)) if callable(read) else str(token_id)

    @property
    def bos_id(self) -> int | None:
        """The id of the token a sequence starts with (a symbol vocabulary's <bos>, transformers'
        bos_token_id), or None."""
        return self.tokenizer.bos_id

    def next_token(self, text: str, continuation: str) -> int:
        """The one token ``continuation`` adds after ``text``: appended as written, or after a space (a
        word-level tokenizer's symbols, GPT-2-style pieces that begin with their space). A ValueError naming
        ``continuation`` when neither adds exactly one token and leaves ``text``'s own tokens as they were."""
        if not isinstance(continuation, str) or not continuation.strip():
            raise bad_argument("continuation", "a non-empty token", describe(continuation), "pass e.g. Mary")
        prompt = self.ids(text)[0].tolist()
        for joined in (text + continuation, text + " " + continuation):
            try:
                ids = self.ids(joined)[0].tolist()
            except ValueError:  # a word-level tokenizer refuses the glued word: try the spaced one
                continue
            if len(ids) == len(prompt) + 1 and ids[: len(prompt)] == prompt:
                return ids[-1]
        raise bad_argument(
            "continuation",
            "one token that follows the prompt (as written, or after a space)",
            repr(continuation),
            "pass a single token of the model's vocabulary",
        )
