"""Real models built only from :class:`multihead.MultiHeadAttention`, and their checkpoint loaders.

Every reader of a model (inspect, importance, syntax) takes a :class:`TextEncoder`: a module with its
``tokenizer`` and ``name``. :class:`Encoder` is one; :func:`load_minilm` gives it with its tokenizer.
:class:`Decoder` is a GPT-style language model (:meth:`Decoder.generate`, :func:`load_decoder`).
:class:`Seq2Seq` is an encoder-decoder transformer with cross-attention (:meth:`Seq2Seq.generate`,
:func:`load_seq2seq`); its attention is captured in parts "encoder", "decoder" and "cross".
The models of ``multihead train`` read symbols (:class:`SymbolTokenizer`); :class:`DecoderReader` and
:class:`Seq2SeqReader` present a decoder and an encoder-decoder to the readers as text encoders.
"""

from multihead.lab.extra import require_lab

require_lab("multihead.lab.models")  # one line naming the extra, before any lab import fails

from multihead.lab.models.bert import Encoder, EncoderBlock, EncoderConfig
from multihead.lab.models.contract import TextEncoder, evaluating, text_tokenizer
from multihead.lab.models.decoder import (
    DECODER_CONFIG,
    Decoder,
    DecoderBlock,
    DecoderCache,
    DecoderConfig,
    load_decoder,
)
from multihead.lab.models.loading import MODEL_PACKAGE, find_model_dir, load_encoder, load_minilm
from multihead.lab.models.seq2seq import SEQ2SEQ_CONFIG, Seq2Seq, Seq2SeqConfig, load_seq2seq
from multihead.lab.models.seq2seq_reader import Seq2SeqReader, SourceTokenizer, load_seq2seq_reader
from multihead.lab.models.symbols import DecoderReader, SymbolTokenizer, load_decoder_reader, task_symbols
from multihead.lab.models.tokenizer import Pieces, TextTokenizer, TokenBatch, Tokenizer

__all__ = [
    "DecoderReader",
    "Seq2SeqReader",
    "SourceTokenizer",
    "SymbolTokenizer",
    "load_decoder_reader",
    "load_seq2seq_reader",
    "task_symbols",
    "DECODER_CONFIG",
    "Decoder",
    "DecoderBlock",
    "DecoderCache",
    "DecoderConfig",
    "Encoder",
    "EncoderBlock",
    "EncoderConfig",
    "MODEL_PACKAGE",
    "SEQ2SEQ_CONFIG",
    "Seq2Seq",
    "Seq2SeqConfig",
    "TextEncoder",
    "Pieces",
    "TextTokenizer",
    "TokenBatch",
    "Tokenizer",
    "evaluating",
    "find_model_dir",
    "load_decoder",
    "load_encoder",
    "load_minilm",
    "load_seq2seq",
    "text_tokenizer",
]
