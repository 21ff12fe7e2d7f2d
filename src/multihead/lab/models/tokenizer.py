"""What the readers need of a tokenizer (:class:`TextTokenizer`), and the WordPiece tokenizer of a BERT
checkpoint (its ``tokenizer.json``, read with ``tokenizers``), with its batches.

Every batch says how its pieces group into words (:class:`Pieces`), as the tokenizer itself splits the text:
its pre-tokenizer's words (``word_ids``), split again where the text has white space between two pieces
(a SentencePiece tokenizer such as Llama's has no pre-tokenizer: for it the whole text is one "word"). A
piece that is only white space (GPT-2's lone "\u0120", SentencePiece's lone "\u2581" before a number or an
emoji) belongs to the word it precedes. Each word's text is the text's own characters (accents and case as
typed), read through the tokenizer's character offsets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from multihead._errors import bad_argument
from multihead._userfiles import read_text
from multihead.lab.models.files import FIX_MODEL_FOLDER, reading

__all__ = ["Pieces", "TokenBatch", "TextTokenizer", "Tokenizer", "FIX_MODEL_FOLDER", "WORD_MARKERS"]

# GPT-2's byte-level "\u0120" and SentencePiece's "\u2581" begin a word: the only word boundaries a list of
# raw pieces shows when the tokenizer's own words are not known
WORD_MARKERS = ("\u0120", "\u2581")


def _is_special_piece(piece: str) -> bool:
    return len(piece) > 2 and piece[0] in "[<" and piece[-1] in "]>"  # [CLS], [SEP], <s>, </s>, <pad> ...


def _white_space_between(text: str, before: tuple[int, int], after: tuple[int, int]) -> bool:
    """True when white space lies between the last character of the piece at ``before`` and the first of the
    piece at ``after`` (their offsets): "bank" " paid", GPT-2's "Ġpaid", a SentencePiece merge ending in
    "▁". Pieces of one character (the bytes of an emoji) overlap: nothing lies between them."""
    last = before[0] + len(text[before[0] : before[1]].rstrip())
    first = after[0] + len(text[after[0] : after[1]]) - len(text[after[0] : after[1]].lstrip())
    return any(ch.isspace() for ch in text[last:first])


@dataclass(frozen=True)
class Pieces:
    """One text's pieces along an attention axis, and the words they make.

    ``tokens[k]``: piece k as reports show it; ``word_ids[k]``: the word it belongs to (0, 1, ... in text
    order), None for a special token ([CLS], <s>, ...); ``words[w]``: word w as it stands in the text.

        >>> Pieces.from_markers(["[CLS]", "una", "##ff", "##able", "flat", "[SEP]"])
        Pieces(tokens=['[CLS]', 'una', '##ff', '##able', 'flat', '[SEP]'], word_ids=[None, 0, 0, 0, 1, None], \
words=['unaffable', 'flat'])
    """

    tokens: list[str]
    word_ids: list[int | None]
    words: list[str]

    def __post_init__(self) -> None:
        if len(self.word_ids) != len(self.tokens):
            raise bad_argument(
                "word_ids", f"one entry per piece ({len(self.tokens)})", f"{len(self.word_ids)}", "pass one per piece"
            )

    @classmethod
    def of(cls, pieces: Pieces | Sequence[str]) -> Pieces:
        """``pieces`` as they are, or a list of raw pieces grouped by their markers (:meth:`from_markers`)."""
        return pieces if isinstance(pieces, Pieces) else cls.from_markers(pieces)

    @classmethod
    def from_markers(cls, tokens: Sequence[str], *, special: Sequence[bool] | None = None) -> Pieces:
        """Words read from raw pieces alone, for a tokenizer that cannot say (a slow tokenizer, a bare list).

        A piece continues the previous word when it carries WordPiece's "##", or, in a text whose pieces mark
        word starts (GPT-2's "\u0120", SentencePiece's "\u2581"), when it lacks the marker. ``special[k]``:
        piece k is a special token (default: a piece like "[CLS]" or "<s>"). Words are the pieces' characters
        without the markers.
        """
        tokens = list(tokens)
        special = [_is_special_piece(piece) for piece in tokens] if special is None else list(special)
        marked = any(piece.startswith(WORD_MARKERS) for piece in tokens)
        word_ids: list[int | None] = []
        words: list[str] = []
        previous_special = True
        for piece, is_special in zip(tokens, special, strict=True):
            if is_special:
                word_ids.append(None)
                previous_special = True
                continue
            if marked:
                continues, text = not piece.startswith(WORD_MARKERS), piece.lstrip("".join(WORD_MARKERS))
            else:  # a "##" piece starting a word (first, after a special) keeps its "##"
                continues = piece.startswith("##") and len(piece) > 2
                text = piece[2:] if continues and not previous_special and words else piece
            if continues and not previous_special and words:
                words[-1] += text
            else:
                words.append(text)
            word_ids.append(len(words) - 1)
            previous_special = False
        return cls(tokens, word_ids, [word or "\u2423" for word in words])  # a blank word shows as "\u2423"

    @classmethod
    def each_own_word(cls, tokens: Sequence[str], special: Sequence[bool]) -> Pieces:
        """Every piece a word of its own (symbols), except the ``special`` ones."""
        word_ids: list[int | None] = []
        words: list[str] = []
        for piece, is_special in zip(tokens, special, strict=True):
            word_ids.append(None if is_special else len(words))
            if not is_special:
                words.append(piece)
        return cls(list(tokens), word_ids, words)

    @classmethod
    def from_offsets(
        cls,
        tokens: Sequence[str],
        text: str,
        tokenizer_words: Sequence[int | None],
        offsets: Sequence[tuple[int, int]],
    ) -> Pieces:
        """The words of ``text`` as its tokenizer split it (see the module docstring).

        ``tokenizer_words[k]``: the pre-tokenizer's word of piece k (None for a special token);
        ``offsets[k]``: piece k's characters in ``text``, (start, end).
        """
        word_ids: list[int | None] = [None] * len(tokens)
        spans: list[list[int]] = []  # each word's characters, [start, end)
        previous: int | None = None  # the last piece with characters, in the current run of non-special pieces
        blank: list[int] = []  # white-space pieces waiting for the word they precede

        def close_run() -> None:  # trailing white-space pieces join the word before them, else stand alone
            nonlocal previous
            for piece in blank:
                if previous is None:
                    spans.append(list(offsets[piece]))
                    previous = piece
                word_ids[piece] = len(spans) - 1
            blank.clear()
            previous = None

        for k, tokenizer_word in enumerate(tokenizer_words):
            if tokenizer_word is None:
                close_run()
                continue
            start, end = offsets[k]
            characters = text[start:end]
            if not characters.strip():
                blank.append(k)
                continue
            if (
                previous is None
                or tokenizer_word != tokenizer_words[previous]
                or _white_space_between(text, offsets[previous], (start, end))
            ):
                spans.append([start, end])
            else:
                spans[-1][1] = max(spans[-1][1], end)
            for piece in [*blank, k]:
                word_ids[piece] = len(spans) - 1
            blank.clear()
            previous = k
        close_run()
        words = [text[start:end].strip() or "\u2423" for start, end in spans]
        return cls(list(tokens), word_ids, words)

    def shifted_right(self, start: str) -> Pieces:
        """These pieces after a special ``start`` piece, the last dropped (a decoder's input: the text shifted
        right); words keep their texts and are numbered again from 0."""
        kept = [None, *self.word_ids[:-1]]
        order = {word: index for index, word in enumerate(dict.fromkeys(w for w in kept if w is not None))}
        return Pieces(
            [start, *self.tokens[:-1]],
            [None if word is None else order[word] for word in kept],
            [self.words[word] for word in order],
        )

    def groups(self) -> tuple[list[int], list[str], list[bool]]:
        """The words as groups of pieces, a special piece a group of its own: (each piece's group, each group's
        label, whether each group is special).

            >>> Pieces.from_markers(["[CLS]", "una", "##ff", "flat", "[SEP]"]).groups()
            ([0, 1, 1, 2, 3], ['[CLS]', 'unaff', 'flat', '[SEP]'], [True, False, False, True])
        """
        index: list[int] = []
        labels: list[str] = []
        special: list[bool] = []
        previous: int | None = None
        for piece, word in zip(self.tokens, self.word_ids, strict=True):
            if word is None or word != previous:
                labels.append(piece if word is None else self.words[word])
                special.append(word is None)
            index.append(len(labels) - 1)
            previous = word
        return index, labels, special

    def word_starts(self) -> list[tuple[str, int]]:
        """Each word with the index of its first piece, in text order."""
        first: dict[int, int] = {}
        for position, word in enumerate(self.word_ids):
            if word is not None:
                first.setdefault(word, position)
        return [(self.words[word], position) for word, position in first.items()]

    def present_words(self) -> list[int]:
        """The words that have pieces here, in text order (a truncated or shifted text may lack some)."""
        return list(dict.fromkeys(word for word in self.word_ids if word is not None))

    def span(self, word: int) -> tuple[int, int]:
        """The first and the last piece of word ``word`` (a word's pieces are neighbours)."""
        positions = [position for position, owner in enumerate(self.word_ids) if owner == word]
        if not positions:
            raise bad_argument(
                "word", f"a word index in 0..{len(self.words) - 1}", word, "pick one of the words of word_ids"
            )
        return positions[0], positions[-1]

    def query_piece(self, word: int, *, causal: bool) -> int:
        """The piece that stands for word ``word`` as a query: the first of its pieces with characters that has
        read all of the word's characters. Every piece of a bidirectional part sees the whole word, so that is
        the word's first piece (WordPiece's "una" of "una ##ff ##able", GPT-2's "\u0120b" of "\u0120b an k"),
        past a lone "\u0120" before it; a causal piece sees only itself and what comes before it, so that is
        the word's last piece with characters.

            >>> text = Pieces.from_markers(["The", "\u0120b", "an", "k"])
            >>> text.query_piece(1, causal=False), text.query_piece(1, causal=True)
            (1, 3)
        """
        first, last = self.span(word)
        markers = "".join(WORD_MARKERS)  # a piece of white space alone shows as its marker, or as nothing
        written = [k for k in range(first, last + 1) if self.tokens[k].strip().strip(markers)] or [first]
        return written[-1] if causal else written[0]


@dataclass
class TokenBatch:
    """Tokenized texts, padded to the longest.

    input_ids, attention_mask (1 = real token), token_type_ids: (b, n) int64;
    pieces: each text's :class:`Pieces` (without padding): its pieces and their words, the words given when
    the texts were lists of words, else the tokenizer's own;
    analysed: each text as far as its kept pieces reach (cut where truncation cut it);
    full_lengths: each text's piece count before truncation.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    pieces: list[Pieces]
    # each text as far as its kept pieces reach (the whole text unless truncated), and how many pieces it had
    # before truncation (its piece count when whole)
    analysed: list[str]
    full_lengths: list[int]

    @property
    def truncated(self) -> list[bool]:
        """For each text, True when truncation cut pieces off it."""
        return [len(text.tokens) < full for text, full in zip(self.pieces, self.full_lengths, strict=True)]

    @property
    def tokens(self) -> list[list[str]]:
        """The pieces of each text, without padding."""
        return [text.tokens for text in self.pieces]

    @property
    def word_ids(self) -> list[list[int | None]]:
        """For each piece of each text, the index of its word (None for [CLS]/[SEP] and the like)."""
        return [text.word_ids for text in self.pieces]


class TextTokenizer(ABC):
    """What every reader of text asks of a model's tokenizer: padded batches of ids with their pieces.

    ``max_length``: the model's position limit; longer texts raise unless truncated.
    ``sentence_max_length``: where embeddings truncate (at most ``max_length``).
    """

    max_length: int
    sentence_max_length: int
    pad_id: int
    bos_id: int | None = None  # the id a sequence starts with, where the vocabulary has one

    @property
    @abstractmethod
    def vocabulary_size(self) -> int:
        """How many token ids the tokenizer makes: they run 0 .. vocabulary_size - 1."""

    @abstractmethod
    def batch(
        self, texts: list[str] | list[list[str]], *, truncate: bool = False, max_length: int | None = None
    ) -> TokenBatch:
        """Tokenize and pad ``texts`` (strings, or lists of words already split); see :meth:`Tokenizer.batch`."""

    @staticmethod
    def _analysed(text: str | list[str], offsets: Sequence[tuple[int, int]] | None, kept: int, full: int) -> str:
        """``text`` as far as its kept pieces reach: whole when nothing was cut; else cut after the last kept
        character (``offsets``: the kept pieces'), or, for words given as a list, the kept words joined."""
        if kept >= full:
            return text if isinstance(text, str) else " ".join(text)
        if isinstance(text, str) and offsets:
            return text[: max(end for _, end in offsets)]
        return text if isinstance(text, str) else " ".join(text)

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
                "shorten the text, or truncate it (truncate=True)",
            )
        return [column[: limit - closing] + column[length - closing :] for column in columns]

    def _padded(
        self,
        ids: list[list[int]],
        types: list[list[int]],
        pieces: list[Pieces],
        analysed: list[str],
        full_lengths: list[int],
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
        return TokenBatch(input_ids, attention_mask, token_type_ids, pieces, analysed, full_lengths)

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

    @property
    def vocabulary_size(self) -> int:
        return int(self._wordpiece.get_vocab_size())

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
        ids, types, pieces, analysed, full_lengths = [], [], [], [], []
        for index, encoding in enumerate(encodings):
            # over the limit: keep the first limit - 1 pieces and the final [SEP]
            piece_ids, piece_types, tokens, piece_words, offsets = self._fit(
                texts,
                index,
                [list(encoding.ids), list(encoding.type_ids), list(encoding.tokens)]
                + [list(encoding.word_ids), list(encoding.offsets)],
                limit,
                truncate=truncate,
                closing=1,
            )
            ids.append(piece_ids)
            types.append(piece_types)
            text = texts[index]
            if isinstance(text, str):
                pieces.append(Pieces.from_offsets(tokens, text, piece_words, offsets))
            else:  # the words given
                pieces.append(Pieces(tokens, piece_words, [str(word) for word in text]))
            full_lengths.append(len(encoding.ids))
            analysed.append(self._analysed(text, offsets, len(piece_ids), len(encoding.ids)))
        return self._padded(ids, types, pieces, analysed, full_lengths)


def _read_wordpiece(path: Path):
    """tokenizer.json parsed by ``tokenizers``; a corrupt file is an InputError naming it."""
    from tokenizers import Tokenizer as WordPiece  # imported here: only reading a tokenizer needs it

    text = read_text("tokenizer.json", path, what="a tokenizers JSON file", fix=FIX_MODEL_FOLDER)
    with reading(path.parent, [path.name], what="a tokenizer file of the tokenizers library"):
        return WordPiece.from_str(text)
