"""A BERT-style encoder built only from :class:`multihead.MultiHeadAttention`.

    x = LayerNorm(word[ids] + position[0..n) + token_type[types])
    for each block:  x = LayerNorm(x + W^O attention(x));  x = LayerNorm(x + W_2 gelu(W_1 x))
    sentence = normalize(mean of x over real tokens)

This is the architecture of BERT (Devlin et al. 2019) with post-LayerNorm residual blocks and the
exact (erf) GELU, and of the sentence-transformers mean-pooling head on top. Padding is a typed
:func:`multihead.masks.padding` mask over keys, so padded keys get exactly zero weight.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from multihead._errors import bad_argument, describe
from multihead.lab.models.contract import TextEncoder
from multihead.lab.models.tokenizer import Tokenizer
from multihead.layer import MultiHeadAttention
from multihead.masks import padding

__all__ = ["EncoderConfig", "EncoderBlock", "Encoder", "SAVED_CONFIG"]

SAVED_CONFIG = "multihead_config.json"  # written by Encoder.save (a pruned model), read by the loader


@dataclass(frozen=True)
class EncoderConfig:
    """Sizes of a BERT-style encoder (the fields of a Hugging Face ``config.json`` we use)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    dropout: float = 0.1
    attention_dropout: float = 0.1
    pad_token_id: int = 0

    @classmethod
    def from_hf(cls, config: dict) -> EncoderConfig:
        """From a parsed Hugging Face BERT ``config.json``."""
        if (
            config.get("model_type", "bert") != "bert"
            or config.get("position_embedding_type", "absolute") != "absolute"
        ):
            raise bad_argument(
                "config.json",
                "a BERT model with absolute positions",
                f"model_type={config.get('model_type')!r}, "
                f"position_embedding_type={config.get('position_embedding_type')!r}",
                "point --model at a BERT-style checkpoint such as all-MiniLM-L6-v2",
            )
        if config.get("hidden_act", "gelu") != "gelu":
            raise bad_argument(
                "config.json hidden_act",
                '"gelu"',
                repr(config.get("hidden_act")),
                "this encoder implements BERT's exact GELU only",
            )
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_positions=config["max_position_embeddings"],
            type_vocab_size=config["type_vocab_size"],
            layer_norm_eps=config["layer_norm_eps"],
            dropout=config["hidden_dropout_prob"],
            attention_dropout=config["attention_probs_dropout_prob"],
            pad_token_id=config.get("pad_token_id", 0),
        )


class EncoderBlock(nn.Module):
    """One post-LayerNorm transformer block: self-attention, then a GELU feed-forward, each residual."""

    attention: MultiHeadAttention

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.attention = MultiHeadAttention(config.hidden_size, config.num_heads, dropout=config.attention_dropout)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.feed_forward_out = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        """x (b, n, hidden) -> (b, n, hidden); ``mask`` is the padding mask over keys."""
        attended, _ = self.attention(x, mask=mask)
        x = self.attention_norm(x + self.dropout(attended))
        hidden = F.gelu(self.feed_forward_in(x))  # (b, n, intermediate): the exact erf GELU, as BERT
        return self.output_norm(x + self.dropout(self.feed_forward_out(hidden)))


class Encoder(TextEncoder):
    """Token + position + type embeddings, ``num_layers`` :class:`EncoderBlock` s, mean pooling.

    ``encoder.blocks[l].attention`` is layer l's :class:`multihead.MultiHeadAttention`. Use
    :func:`multihead.lab.models.load_minilm` for the pretrained all-MiniLM-L6-v2 and its tokenizer.

    A :class:`~multihead.lab.models.contract.TextEncoder`: ``tokenizer`` (None: the encoder runs on
    token ids only, and :meth:`encode` refuses text) and ``name`` (what reports call it) are given
    to the constructor, as the loader does.
    """

    described_as = "a BERT-style encoder on multihead's layer"

    tokenizer: Tokenizer | None  # the checkpoint's own WordPiece tokenizer, which save() writes

    def __init__(
        self, config: EncoderConfig = EncoderConfig(), *, tokenizer: Tokenizer | None = None, name: str = "encoder"
    ):
        super().__init__(tokenizer=tokenizer, name=name)
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_positions, config.hidden_size)
        self.type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embedding_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.num_layers))
        # for each layer, the original index of every head still there (prune_heads removes some)
        self.head_ids = [list(range(config.num_heads)) for _ in range(config.num_layers)]

    def prune_heads(self, heads: dict[int, list[int]]) -> None:
        """Remove heads: ``{layer: [original head indices]}`` (indices as in the unpruned checkpoint).

        Raises before changing anything when an index is unknown (or already pruned) or a layer would
        lose every head.
        """
        if not isinstance(heads, dict):
            raise bad_argument(
                "heads",
                "a dict {layer: [head indices]}",
                describe(heads),
                "pass e.g. {0: [2, 5], 3: [1]}",
                kind=TypeError,
            )
        plan = {}
        for layer, originals in heads.items():
            if not isinstance(layer, int) or not 0 <= layer < len(self.blocks):
                raise bad_argument(
                    "heads", f"layer indices in 0..{len(self.blocks) - 1}", layer, "use the model's layer numbers"
                )
            present = self.head_ids[layer]
            missing = [h for h in originals if h not in present]
            if missing:
                raise bad_argument(
                    f"heads[{layer}]",
                    f"heads still in layer {layer}: {present}",
                    missing,
                    "drop heads that were pruned already or do not exist",
                )
            if len(set(originals)) >= len(present):
                raise bad_argument(
                    f"heads[{layer}]",
                    f"fewer than all {len(present)} heads of layer {layer}",
                    sorted(originals),
                    "keep at least one head in every layer",
                )
            plan[layer] = [present.index(h) for h in originals]
        for layer, positions in plan.items():
            if positions:
                kept = self.attention_layers[layer].prune_heads(positions)
                self.head_ids[layer] = [self.head_ids[layer][n] for n in kept]

    def save(self, directory: str | Path) -> Path:
        """Write this (possibly pruned) encoder to ``directory``: ``multihead_config.json`` (sizes, every
        layer's heads), ``model.safetensors`` (our parameter names) and the tokenizer's files, so that
        :func:`multihead.lab.models.load_minilm` (``--model DIR``) loads it back. Returns the folder."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        save_file(
            {name: tensor.detach().contiguous() for name, tensor in self.state_dict().items()},
            str(folder / "model.safetensors"),
        )
        config = {
            "format": "multihead-encoder",
            "version": 1,
            "name": self.name,
            "encoder": dataclasses.asdict(self.config),
            "head_ids": self.head_ids,
            "sentence_max_length": None if self.tokenizer is None else self.tokenizer.sentence_max_length,
        }
        (folder / SAVED_CONFIG).write_text(json.dumps(config, indent=1))
        if self.tokenizer is not None:
            self.tokenizer.save(folder / "tokenizer.json")
        return folder

    @property
    def attention_layers(self) -> list[MultiHeadAttention]:
        """The attention layer of every block, in order (index = layer number)."""
        return [cast(EncoderBlock, block).attention for block in self.blocks]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token states.

        Args:
            input_ids: (b, n) token ids.
            attention_mask: (b, n), 1/True for real tokens and 0/False for padding (default: all real).
            token_type_ids: (b, n) segment ids (default: all 0).

        Returns:
            (b, n, hidden) the last block's token states.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point():
            raise bad_argument(
                "input_ids",
                "an integer tensor (b, n)",
                describe(input_ids),
                "tokenize the text first (model.tokenizer.batch(texts))",
                kind=TypeError,
            )
        b, n = input_ids.shape
        if n > self.config.max_positions:
            raise bad_argument(
                "input_ids",
                f"at most {self.config.max_positions} positions (the model's limit)",
                f"{n} tokens",
                "shorten the text or truncate it",
            )
        positions = torch.arange(n, device=input_ids.device)
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.type_embeddings(types)
        x = self.dropout(self.embedding_norm(x))  # (b, n, hidden)
        # A padding mask only when something is padded: an all-real batch takes the unmasked (fastest) path.
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = padding(attention_mask.bool())
        for block in self.blocks:
            x = block(x, mask)
        return x
