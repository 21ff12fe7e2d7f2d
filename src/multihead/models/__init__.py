"""Real models built only from :class:`multihead.MultiHeadAttention`, and their checkpoint loaders."""

from multihead.models.bert import Encoder, EncoderBlock, EncoderConfig
from multihead.models.loading import MODEL_PACKAGE, TokenBatch, Tokenizer, find_model_dir, load_encoder, load_minilm

__all__ = [
    "Encoder",
    "EncoderBlock",
    "EncoderConfig",
    "MODEL_PACKAGE",
    "TokenBatch",
    "Tokenizer",
    "find_model_dir",
    "load_encoder",
    "load_minilm",
]
