"""What the readers need of a tokenizer (:class:`TextTokenizer`), and the WordPiece tokenizer of a BERT
checkpoint (its ``tokenizer.json``, read with ``tokenizers``), with its batches."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from multihead._errors import bad_argument
from multihead._userfiles import read_text
from multihead.models.files import FIX_MODEL_FOLDER, reading

__all__ = ["TokenBatch", "TextTokenizer", "Tokenizer", "FIX_MODEL_FOLDER"]


@dataclass
class TokenBatch:
    """Tokenized texts, padded to the longest.

    input_ids, attention_mask (1 = real token), token_type_ids: (b, n) int64;
    tokens: the word pieces of each text, without padding;
    word_ids: for each piece, the index of the word it came from (None for [CLS]/[SEP]); words are the
    pre-tokenized words when the texts were given as word lists, else the tokenizer's own words.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    tokens: list[list[str]]
    word_ids: list[list[int | None]]


class TextTokenizer(ABC):
    """What every reader of text asks of a model's tokenizer: padded batches of ids with their pieces.

    ``max_length``: the model's position limit; longer texts raise unless truncated.
    ``sentence_max_length``: where embeddings truncate (at most ``max_length``).
    """

    max_length: int
    sentence_max_length: int
    pad_id: int

    @abstractmethod
    def batch(
        self, texts: list[str] | list[list[str]], *, truncate: bool = False, max_length: int | None = None
    ) -> TokenBatch:
        """Tokenize and pad ``texts`` (strings, or lists of words already split); see :meth:`Tokenizer.batch`."""

    def _fit(
        self, texts: list, index: int, columns: list[list], limit: int, *, truncate: bool, closing: int
    ) -> list[list]:
        """Text ``index``'s per-piece lists (``columns``: ids, types, pieces, words, all one length) within
        ``limit`` pieces: as they are, or cut keeping the last ``closing`` (the closing special token) when
        ``truncate``; a longer text without it raises, naming the text."""
        length = len(columns[0])
        if length <= limit:
            return columns
        if not truncate:
            raise bad_argument(
                "text" if len(texts) == 1 else f"texts[{index}]",
                f"at most {limit} tokens (the model's {self.max_length} positions)",
                f"{length} tokens",
                "shorten the text, or truncate it (truncate=True, or --truncate)",
            )
        return [column[: limit - closing] + column[length - closing :] for column in columns]

    def _padded(
        self, ids: list[list[int]], types: list[list[int]], tokens: list[list[str]], words: list[list[int | None]]
    ) -> TokenBatch:
        """The batch of the texts' ids and segment ids padded to the longest with ``pad_id``, and its mask."""
        longest = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), longest), self.pad_id, dtype=torch.long)  # (b, n)
        token_type_ids = torch.zeros((len(ids), longest), dtype=torch.long)
        attention_mask = torch.zeros((len(ids), longest), dtype=torch.long)
        for row, (piece_ids, piece_types) in enumerate(zip(ids, types, strict=True)):
            input_ids[row, : len(piece_ids)] = torch.tensor(piece_ids, dtype=torch.long)
            token_type_ids[row, : len(piece_types)] = torch.tensor(piece_types, dtype=torch.long)
            attention_mask[row, : len(piece_ids)] = 1
        return TokenBatch(input_ids, attention_mask, token_type_ids, tokens, words)

    def tokenize(self, text: str) -> list[str]:
        """The pieces of ``text`` as the model reads them, special tokens included."""
        return self.batch([text], max_length=None).tokens[0]

    def __call__(self, texts: str | list[str], *, truncate: bool = False) -> TokenBatch:
        return self.batch([texts] if isinstance(texts, str) else list(texts), truncate=truncate)


class Tokenizer(TextTokenizer):
    """The checkpoint's WordPiece tokenizer (``tokenizer.json``), with [CLS] ... [SEP] added.

    ``max_length``: the model's position limit; longer texts raise unless truncated.
    ``sentence_max_length``: where sentence-transformers truncates (``sentence_bert_config.json``).
    """

    def __init__(self, path: str | Path, *, max_length: int, sentence_max_length: int | None = None):
        self._wordpiece = _read_wordpiece(Path(path))
        self._wordpiece.no_truncation()  # the file fixes padding/truncation at 128: we do our own
        self._wordpiece.no_padding()
        self.max_length = max_length
        self.sentence_max_length = min(sentence_max_length or max_length, max_length)
        self.special_tokens = {"[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"}
        self.pad_id = self._wordpiece.token_to_id("[PAD]") or 0

    def save(self, path: str | Path) -> None:
        """Write the tokenizer's ``tokenizer.json`` to ``path``."""
        self._wordpiece.save(str(path))

    def tokenize(self, text: str) -> list[str]:
        """The word pieces of ``text`` with [CLS] and [SEP]: e.g. ['[CLS]', 'the', 'bank', ..., '[SEP]']."""
        return super().tokenize(text)

    def batch(
        self, texts: list[str] | list[list[str]], *, truncate: bool = False, max_length: int | None = None
    ) -> TokenBatch:
        """Tokenize and pad ``texts`` (strings, or lists of words already split, e.g. a treebank's).

        Texts longer than ``max_length`` (default: the model's limit) raise, or are cut to it
        (keeping [SEP]) with ``truncate=True``; ``encode`` truncates at ``sentence_max_length`` as
        sentence-transformers does.
        """
        limit = self.max_length if max_length is None else max_length
        pretokenized = bool(texts) and not isinstance(texts[0], str)
        for index, text in enumerate(texts):
            for piece in [text] if isinstance(text, str) else text:
                try:
                    piece.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates: what Python makes of bytes that are not UTF-8
                    raise bad_argument(
                        "text" if len(texts) == 1 else f"texts[{index}]",
                        "valid Unicode text",
                        f"{piece!r}, which holds bytes that are not UTF-8",
                        "pass the text as UTF-8 (check the terminal's or the file's encoding)",
                    ) from None
        try:
            encodings = self._wordpiece.encode_batch(texts, is_pretokenized=pretokenized)
        except Exception as error:  # tokenizers reports a broken tokenizer.json as a plain Exception
            if type(error) is not Exception:
                raise
            reason = str(error).splitlines()[0] if str(error) else "no reason given"
            raise bad_argument(
                "tokenizer.json", "a tokenizer that can encode text", f"one that fails ({reason})", FIX_MODEL_FOLDER
            ) from None
        ids, types, tokens, words = [], [], [], []
        for index, encoding in enumerate(encodings):
            piece_ids, piece_types, pieces = list(encoding.ids), list(encoding.type_ids), list(encoding.tokens)
            piece_words = list(encoding.word_ids)
            # over the limit: keep the first limit - 1 pieces and the final [SEP]
            piece_ids, piece_types, pieces, piece_words = self._fit(
                texts, index, [piece_ids, piece_types, pieces, piece_words], limit, truncate=truncate, closing=1
            )
            ids.append(piece_ids)
            types.append(piece_types)
            tokens.append(pieces)
            words.append(piece_words)
        return self._padded(ids, types, tokens, words)


def _read_wordpiece(path: Path):
    """tokenizer.json parsed by ``tokenizers``; a corrupt file is an InputError naming it."""
    from tokenizers import Tokenizer as WordPiece  # imported here: only reading a tokenizer needs it

    text = read_text("tokenizer.json", path, what="a tokenizers JSON file", fix=FIX_MODEL_FOLDER)
    with reading(path.parent, [path.name], what="a tokenizer file of the tokenizers library"):
        return WordPiece.from_str(text)
