"""Real models built only from :class:`multihead.MultiHeadAttention`, and their checkpoint loaders.

Every reader of a model (inspect, importance, syntax) takes a :class:`TextEncoder`: a module with its
``tokenizer`` and ``name``. :class:`Encoder` is one; :func:`load_minilm` gives it with its tokenizer.
"""

from multihead.models.bert import Encoder, EncoderBlock, EncoderConfig
from multihead.models.contract import TextEncoder, evaluating, text_tokenizer
from multihead.models.loading import MODEL_PACKAGE, find_model_dir, load_encoder, load_minilm
from multihead.models.tokenizer import TextTokenizer, TokenBatch, Tokenizer

__all__ = [
    "Encoder",
    "EncoderBlock",
    "EncoderConfig",
    "MODEL_PACKAGE",
    "TextEncoder",
    "TextTokenizer",
    "TokenBatch",
    "Tokenizer",
    "evaluating",
    "find_model_dir",
    "load_encoder",
    "load_minilm",
    "text_tokenizer",
]
