"""Models of synthetic tasks as text readers: a tokenizer of symbols, and a decoder every reader can open.

``multihead train`` trains on token ids drawn at random (no words), so its checkpoints name each id by a symbol:
``<bos>`` for id 0 and ``a``, ``b``, ... (or ``t1``, ``t2``, ... past 26) for the others. A text for such a model is
its symbols separated by spaces, ``"<bos> q d k q d k"``; the symbols are saved beside the weights
(``symbols.json``), so ``multihead inspect --model RUN/model "q d k q d k"`` reads the checkpoint like any other.

    tokenizer = SymbolTokenizer(task_symbols(24), max_length=25)
    tokenizer.tokenize("q d k q d k")          # ['<bos>', 'q', 'd', 'k', 'q', 'd', 'k']: <bos> is added
    reader = DecoderReader(decoder, tokenizer=tokenizer)   # a TextEncoder: inspect, capture, importance
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path

import torch

from multihead._errors import bad_argument, describe
from multihead._userfiles import STRING, ListOf, path_kind, read_json
from multihead.lab.models.contract import TextEncoder
from multihead.lab.models.decoder import Decoder, load_decoder
from multihead.lab.models.tokenizer import Pieces, TextTokenizer, TokenBatch
from multihead.layer import MultiHeadAttention

__all__ = ["BOS_SYMBOL", "SYMBOLS_FILE", "task_symbols", "SymbolTokenizer", "DecoderReader", "load_decoder_reader"]

BOS_SYMBOL = "<bos>"  # id 0: the tasks' BOS (multihead.lab.models.tasks.BOS) and a decoder's start token
SYMBOLS_FILE = "symbols.json"  # a checkpoint's symbols, id by id, beside its weights


def task_symbols(vocab_size: int) -> list[str]:
    """The symbols of a synthetic vocabulary: ``<bos>``, then ``a`` .. ``z`` when they suffice, else ``t1`` ..
    ``t{vocab_size - 1}`` (one word each, so the report's word view shows them as they are).

    >>> task_symbols(4)
    ['<bos>', 'a', 'b', 'c']
    """
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 2:
        raise bad_argument("vocab_size", "an int >= 2 (<bos> and one symbol)", describe(vocab_size), "pass e.g. 24")
    if vocab_size - 1 <= len(string.ascii_lowercase):
        return [BOS_SYMBOL, *string.ascii_lowercase[: vocab_size - 1]]
    return [BOS_SYMBOL, *(f"t{index}" for index in range(1, vocab_size))]


class SymbolTokenizer(TextTokenizer):
    """Whitespace-separated symbols, one token each; ``<bos>`` is put first when the vocabulary has it and the
    text does not start with it. Each symbol is its own word (the report's word view shows symbols).

    ``symbols``: the vocabulary, symbol i is token id i (distinct, non-empty, no whitespace).
    ``max_length``: the model's position limit (longer texts raise unless truncated).
    """

    def __init__(self, symbols: Sequence[str], *, max_length: int):
        symbols = list(symbols)
        if not symbols or not all(isinstance(s, str) and s and not any(c.isspace() for c in s) for s in symbols):
            raise bad_argument(
                "symbols",
                "a non-empty list of symbols without whitespace",
                describe(symbols),
                "pass e.g. task_symbols(24)",
                kind=TypeError,
            )
        if len(set(symbols)) != len(symbols):
            repeated = next(s for s in symbols if symbols.count(s) > 1)
            raise bad_argument("symbols", "distinct symbols", f"{repeated!r} twice", "name every token once")
        self.symbols = symbols
        self.ids = {symbol: index for index, symbol in enumerate(symbols)}
        self.bos_id = self.ids.get(BOS_SYMBOL)
        self.max_length = max_length
        self.sentence_max_length = max_length
        self.pad_id = 0

    @property
    def vocabulary_size(self) -> int:
        return len(self.symbols)

    def piece(self, token_id: int) -> str:
        """The symbol of ``token_id``."""
        return self.symbols[token_id]

    def text(self, ids: Sequence[int]) -> str:
        """The text of a sequence of ids (symbols joined by spaces)."""
        return " ".join(self.symbols[int(token)] for token in ids)

    def batch(
        self, texts: list[str] | list[list[str]], *, truncate: bool = False, max_length: int | None = None
    ) -> TokenBatch:
        """Tokenize and pad ``texts`` (strings of symbols, or lists of symbols); see :meth:`TextTokenizer.batch`.
        A symbol outside the vocabulary raises, naming it and the text."""
        limit = self.max_length if max_length is None else max_length
        ids, pieces_of_text, analysed, full_lengths = [], [], [], []
        for index, text in enumerate(texts):
            pieces = text.split() if isinstance(text, str) else list(text)
            if self.bos_id is not None and (not pieces or pieces[0] != BOS_SYMBOL):
                pieces = [BOS_SYMBOL, *pieces]
            unknown = [piece for piece in pieces if piece not in self.ids]
            if unknown:
                shown = " ".join(self.symbols[:8]) + (" ..." if len(self.symbols) > 8 else "")
                raise bad_argument(
                    "text" if len(texts) == 1 else f"texts[{index}]",
                    f"symbols of the model's vocabulary ({shown}), separated by spaces",
                    f"{unknown[0]!r}",
                    f"write the text in the model's {len(self.symbols)} symbols, e.g. {' '.join(self.symbols[1:4])!r}",
                )
            piece_ids, kept = self._fit(
                texts, index, [[self.ids[piece] for piece in pieces], pieces], limit, truncate=truncate, closing=0
            )
            ids.append(piece_ids)
            pieces_of_text.append(Pieces.each_own_word(kept, [piece == BOS_SYMBOL for piece in kept]))
            full_lengths.append(len(pieces))
            whole = text if isinstance(text, str) else " ".join(text)
            analysed.append(" ".join(kept) if len(kept) < len(pieces) else whole)
        return self._padded(ids, [[0] * len(row) for row in ids], pieces_of_text, analysed, full_lengths)

    def save(self, folder: str | Path) -> Path:
        """Write ``symbols.json`` (the symbols, id by id) into ``folder``; returns its path."""
        path = Path(folder) / SYMBOLS_FILE
        path.write_text(json.dumps({"symbols": self.symbols}, indent=1))
        return path


def read_symbols(folder: Path, vocab_size: int | None = None) -> list[str] | None:
    """The symbols saved in ``folder`` (None when it has no ``symbols.json``); a damaged file, or one without
    ``vocab_size`` symbols (the model's, when given), raises, naming it."""
    path = folder / SYMBOLS_FILE
    if path_kind(path) != "file":
        return None
    saved = read_json(
        SYMBOLS_FILE,
        path,
        what="the symbols of a multihead train checkpoint",
        schema={"symbols": ListOf(STRING)},
        fix="train the model again (multihead train writes the file)",
    )
    symbols = list(saved["symbols"])
    if vocab_size is not None and len(symbols) != vocab_size:
        raise bad_argument(
            SYMBOLS_FILE,
            f"{vocab_size} symbols (the model's vocab_size)",
            f"{len(symbols)}",
            "train the model again (multihead train writes both files)",
        )
    return symbols


class DecoderReader(TextEncoder):
    """A :class:`~multihead.lab.models.Decoder` as a text reader (:class:`TextEncoder`), so inspect, capture, the
    statistics and the importance tools open it like any encoder. Its one part, "self", is causal.

    ``decoder``: the model; ``tokenizer``: its :class:`SymbolTokenizer` (or any :class:`TextTokenizer` whose ids
    it reads). ``forward(input_ids, attention_mask, token_type_ids)`` returns the decoder's (b, n, hidden)
    final states; padding must be on the right (the tokenizers pad there), where causal attention never
    reaches it from a real token, so the mask needs no other use.
    """

    is_causal = True
    described_as = "a decoder saved by Decoder.save (a multihead train checkpoint)"

    def __init__(self, decoder: Decoder, *, tokenizer: TextTokenizer | None = None, name: str | None = None):
        if not isinstance(decoder, Decoder):
            raise bad_argument(
                "decoder", "a Decoder", describe(decoder), "pass a multihead.lab.models.Decoder", kind=TypeError
            )
        super().__init__(tokenizer=tokenizer, name=name or decoder.name)
        self.decoder = decoder

    @property
    def attention_layers(self) -> list[MultiHeadAttention]:
        return self.decoder.attention_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(b, n) ids, (b, n) right-padding mask (1 = real token) -> (b, n, hidden) final states."""
        if attention_mask is not None:
            mask = attention_mask.bool()
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):  # a real token after padding: it would attend to it
                raise bad_argument(
                    "attention_mask",
                    "padding on the right only (a causal model's real tokens never see it there)",
                    "a real token after a padded one",
                    "pad each sequence at its end",
                )
        return self.decoder.hidden_states(input_ids)


def load_decoder_reader(folder: str | Path, *, dtype: torch.dtype | None = None) -> DecoderReader:
    """The decoder saved in ``folder`` (:meth:`Decoder.save`) as a :class:`DecoderReader`, with the
    :class:`SymbolTokenizer` of its ``symbols.json`` when the folder has one (else no tokenizer: ids only)."""
    decoder = load_decoder(folder, dtype=dtype)
    symbols = read_symbols(Path(folder), decoder.config.vocab_size)
    tokenizer = None if symbols is None else SymbolTokenizer(symbols, max_length=decoder.config.max_positions)
    return DecoderReader(decoder, tokenizer=tokenizer).eval()
