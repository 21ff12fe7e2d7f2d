"""An encoder-decoder (seq2seq) transformer built only from :class:`multihead.MultiHeadAttention`.

    memory = LN(encoder blocks(embed[source]))              bidirectional, source padding masked
    for each decoder block:                                  (pre-LN)
        y = y + W^O causal_self_attention(LN(y))
        y = y + W^O cross_attention(LN(y), memory, memory)   queries from y, keys/values from memory
        y = y + W_2 gelu(W_1 LN(y))                          (unless attention-only)
    logits = LN(y) W_vocab^T

The token embedding is shared by the source and the target (one vocabulary) and, with ``tie_embeddings``,
read by the LM head. Positions are rotary in every self-attention layer (encoder and decoder), or two learned
tables added to the embeddings (one for source positions, one for target positions). Cross-attention never
takes rotary: a target position and a source position are unrelated.

The blocks reuse :class:`multihead.lab.models.decoder.DecoderBlock` (its self-attention and MLP sublayers); the
KV cache of the decoder's self-attention is a :class:`multihead.lab.models.DecoderCache`. Cross-attention keys and
values are recomputed from ``memory`` at every decoding step (not cached): one (n_src, hidden) projection per
layer and step, and nothing to keep in sync when ``memory`` changes.

Attention sites (:func:`multihead.lab.inspect.attention_sites`) come in three parts, each numbered from 0:
"encoder" (encoder self-attention), "decoder" (decoder causal self-attention) and "cross"
(decoder-to-encoder attention), so ``capture(model, part="cross")`` records (b, h, n_tgt, n_src) weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from multihead._errors import InputError, bad_argument, describe, floating_dtype, positive_int
from multihead._limits import check_fits
from multihead._userfiles import (
    BOOLEAN,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    Rule,
    nullable,
    one_of,
)
from multihead.attend import AttentionSite, register_site_finder
from multihead.cache import KVCache
from multihead.lab.models.contract import evaluating
from multihead.lab.models.decoder import (
    _POSITIONS,
    _PROBABILITY,
    Decoder,
    DecoderBlock,
    DecoderCache,
    DecoderConfig,
    _check_generation,
    _check_ids,
    _is_int,
    _read_saved,
    _read_weights,
    cache_offset,
    save_model,
)
from multihead.layer import MultiHeadAttention
from multihead.masks import Mask, padding
from multihead.positional import LearnedPositions

__all__ = ["Seq2SeqConfig", "Seq2SeqEncoderBlock", "Seq2SeqDecoderBlock", "Seq2Seq", "load_seq2seq", "SEQ2SEQ_CONFIG"]

SEQ2SEQ_CONFIG = "multihead_seq2seq.json"  # written by Seq2Seq.save beside model.safetensors
_FIX_FOLDER = "point at a folder written by Seq2Seq.save (save the model again if it was damaged)"


@dataclass(frozen=True)
class Seq2SeqConfig:
    """Sizes and options of a :class:`Seq2Seq`, validated on construction (a ValueError or TypeError naming the field).

    Fields:
        vocab_size: tokens in the vocabulary, shared by source and target.
        max_positions: longest source and longest target with learned positions (each table's rows); with
            rotary, the default length of :meth:`Seq2Seq.new_cache`.
        hidden: residual stream width (hidden / heads even with rotary positions).
        encoder_layers: encoder blocks.
        decoder_layers: decoder blocks (each with a self-attention and a cross-attention layer).
        heads: query heads h per attention layer (hidden % heads == 0).
        kv_heads: key/value heads g (None: = heads; heads % kv_heads == 0; g < h is GQA, 1 is MQA), in every
            attention layer, cross-attention included.
        mlp: the feed-forward width, or None / 0 for an attention-only model (no MLP sublayers).
        positions: "rotary" (RoPE in every self-attention layer) or "learned" (tables added to the embeddings).
        dropout: on the attention weights and on each sublayer's output, in training mode only.
        layer_norm_eps: epsilon of every LayerNorm.
        tie_embeddings: the LM head reads the token embedding matrix (no separate output matrix).
    """

    vocab_size: int = 256
    max_positions: int = 256
    hidden: int = 64
    encoder_layers: int = 2
    decoder_layers: int = 2
    heads: int = 4
    kv_heads: int | None = None
    mlp: int | None = 256
    positions: str = "rotary"
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_positions", "hidden", "encoder_layers", "decoder_layers"):
            positive_int(name, getattr(self, name))
        self.block_config()  # the fields a decoder shares, checked by DecoderConfig (same names, same messages)

    def block_config(self) -> DecoderConfig:
        """The :class:`DecoderConfig` of one block: these sizes and options (``layers`` is unused by a block)."""
        return DecoderConfig(
            vocab_size=self.vocab_size,
            max_positions=self.max_positions,
            hidden=self.hidden,
            layers=1,
            heads=self.heads,
            kv_heads=self.kv_heads,
            mlp=self.mlp,
            positions=self.positions,
            dropout=self.dropout,
            layer_norm_eps=self.layer_norm_eps,
            tie_embeddings=self.tie_embeddings,
        )

    @property
    def num_kv_heads(self) -> int:
        """g: the key/value heads (``kv_heads``, or ``heads`` when None)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def attention_only(self) -> bool:
        """True when the blocks have no MLP (``mlp`` None or 0)."""
        return not self.mlp


class Seq2SeqEncoderBlock(DecoderBlock):
    """One pre-LN encoder block: ``x + attention(LN(x))`` over every source position (bidirectional, padded keys
    masked), then the MLP sublayer of :class:`DecoderBlock` unless attention-only."""

    def forward(self, x: torch.Tensor, mask: Mask | None = None) -> torch.Tensor:  # type: ignore[override]
        """x (b, n_src, hidden) -> (b, n_src, hidden); ``mask`` is the source padding mask over keys."""
        attended, _ = self.attention(self.attention_norm(x), mask=mask)
        return self.feed_forward(x + self.dropout(attended))


class Seq2SeqDecoderBlock(DecoderBlock):
    """One pre-LN decoder block: causal self-attention (``attention``), then cross-attention to the encoder's
    memory (``cross_attention``: queries from the target, keys and values from the memory, never rotary), then
    the MLP sublayer unless attention-only."""

    def __init__(self, config: DecoderConfig):
        super().__init__(config)
        self.cross_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.cross_attention = MultiHeadAttention(
            config.hidden, config.heads, num_kv_heads=config.num_kv_heads, dropout=config.dropout, rotary=False
        )

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        memory_mask: Mask | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x (b, n_tgt, hidden), memory (b, n_src, hidden) -> (b, n_tgt, hidden). With ``cache`` the new
        self-attention keys are appended and attended with the cached ones; ``memory_mask`` masks padded source
        keys in the cross-attention."""
        attended, _ = self.attention(self.attention_norm(x), causal=True, cache=cache)
        x = x + self.dropout(attended)
        crossed, _ = self.cross_attention(self.cross_norm(x), memory, mask=memory_mask)  # (b, n_tgt, hidden)
        return self.feed_forward(x + self.dropout(crossed))


class Seq2Seq(nn.Module):
    """An encoder-decoder transformer: shared token embedding, ``encoder_layers`` pre-LN encoder blocks and a
    final LN (the memory), ``decoder_layers`` pre-LN decoder blocks with cross-attention, final LN, LM head.

    Attention layers: :attr:`encoder_layers` (``encoder_blocks[l].attention``), :attr:`decoder_layers`
    (``decoder_blocks[l].attention``, causal) and :attr:`cross_layers` (``decoder_blocks[l].cross_attention``);
    :func:`multihead.lab.inspect.capture` records them as parts "encoder", "decoder" and "cross".

    Example:
        >>> model = Seq2Seq(Seq2SeqConfig(vocab_size=50, hidden=32, heads=4, kv_heads=2, mlp=None))
        >>> source, target = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 9, 10]])
        >>> model(source, target).shape                            # (b, n_tgt, vocab)
        torch.Size([1, 3, 50])
        >>> model.generate(source, 4).shape                        # (b, 1 + new): the start token, then 4
        torch.Size([1, 5])
    """

    def __init__(self, config: Seq2SeqConfig = Seq2SeqConfig(), *, name: str = "seq2seq"):
        super().__init__()
        if not isinstance(config, Seq2SeqConfig):
            raise bad_argument(
                "config", "a Seq2SeqConfig", describe(config), "pass Seq2SeqConfig(vocab_size=..., ...)", kind=TypeError
            )
        self.config = config
        self.name = name
        block = config.block_config()
        learned = config.positions == "learned"
        self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.source_positions = LearnedPositions(config.max_positions, config.hidden) if learned else None
        self.target_positions = LearnedPositions(config.max_positions, config.hidden) if learned else None
        self.dropout = nn.Dropout(config.dropout)
        self.encoder_blocks = nn.ModuleList(Seq2SeqEncoderBlock(block) for _ in range(config.encoder_layers))
        self.encoder_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.decoder_blocks = nn.ModuleList(Seq2SeqDecoderBlock(block) for _ in range(config.decoder_layers))
        self.final_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        # tied: the logits read token_embeddings.weight (one matrix, saved once)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden, config.vocab_size, bias=False)
        nn.init.normal_(self.token_embeddings.weight, std=0.02)  # GPT-2's scale: tied logits start near 0
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=0.02)

    # ------------------------------------------------------------------------------ attention layers

    @property
    def encoder_layers(self) -> list[MultiHeadAttention]:
        """The self-attention layer of every encoder block, in order."""
        return [cast(Seq2SeqEncoderBlock, block).attention for block in self.encoder_blocks]

    @property
    def decoder_layers(self) -> list[MultiHeadAttention]:
        """The causal self-attention layer of every decoder block, in order."""
        return [cast(Seq2SeqDecoderBlock, block).attention for block in self.decoder_blocks]

    @property
    def cross_layers(self) -> list[MultiHeadAttention]:
        """The cross-attention layer (decoder to encoder) of every decoder block, in order."""
        return [cast(Seq2SeqDecoderBlock, block).cross_attention for block in self.decoder_blocks]

    @property
    def attention_layers(self) -> list[MultiHeadAttention]:
        """Every attention layer: the encoder's, then the decoder's self-attention, then the cross-attention."""
        return self.encoder_layers + self.decoder_layers + self.cross_layers

    def attention_sites(self) -> list[AttentionSite]:
        """The attention steps in parts "encoder", "decoder" and "cross", each numbered from 0 (what
        :func:`multihead.lab.inspect.attention_sites` returns for this model)."""
        sites = []
        for part, prefix, layers in (
            ("encoder", "encoder_blocks.{}.attention", self.encoder_layers),
            ("decoder", "decoder_blocks.{}.attention", self.decoder_layers),
            ("cross", "decoder_blocks.{}.cross_attention", self.cross_layers),
        ):
            for index, layer in enumerate(layers):
                name = prefix.format(index)
                sites.append(AttentionSite(layer.attend, layer.num_heads, layer.num_kv_heads, part, index, name))
        return sites

    # ------------------------------------------------------------------------------ checks

    def _ids(self, name: str, ids: object) -> torch.Tensor:
        return _check_ids(name, ids, self.config.vocab_size, self.token_embeddings.weight.device)

    def _check_length(self, name: str, length: int, what: str) -> None:
        if self.source_positions is not None and length > self.config.max_positions:
            raise bad_argument(
                name,
                f"at most max_positions = {self.config.max_positions} {what} (learned positions)",
                length,
                "shorten the sequence, or build the model with a larger max_positions",
            )

    def _source_mask(self, source_mask: object, b: int, n_src: int, of: str) -> Mask | None:
        """source_mask (b, n_src) bool or 0/1 ints -> a padding mask over source keys (None: all real)."""
        if source_mask is None:
            return None
        if not isinstance(source_mask, torch.Tensor) or not (
            source_mask.dtype == torch.bool or source_mask.dtype in (torch.int32, torch.int64, torch.uint8)
        ):
            raise bad_argument(
                "source_mask",
                "a bool or integer tensor (b, n_src), 1/True for real tokens",
                describe(source_mask),
                "pass e.g. source_ids != pad_id",
                kind=TypeError,
            )
        if tuple(source_mask.shape) != (b, n_src):
            raise bad_argument(
                "source_mask",
                f"shape (b, n_src) = ({b}, {n_src}) (from {of})",
                f"shape {tuple(source_mask.shape)}",
                f"give one flag per token of {of}",
            )
        device = self.token_embeddings.weight.device
        if source_mask.device != device:
            raise bad_argument(
                "source_mask", f"a tensor on {device} (the model's)", f"one on {source_mask.device}", "move it there"
            )
        if source_mask.dtype != torch.bool and bool(((source_mask != 0) & (source_mask != 1)).any()):
            raise bad_argument(
                "source_mask", "0 (padding) or 1 (real token) values", "other values", "pass source_ids != pad_id"
            )
        real = source_mask.bool()
        if not bool(real.any(dim=1).all()):
            raise bad_argument(
                "source_mask",
                "at least one real token in every row",
                f"rows {real.any(dim=1).logical_not().nonzero().flatten().tolist()} all padding",
                "drop empty source sequences from the batch",
            )
        # A padding mask only when something is padded: an all-real batch takes the unmasked (fastest) path.
        return None if bool(real.all()) else padding(real)

    def _check_memory(self, memory: object, b: int) -> torch.Tensor:
        weight = self.token_embeddings.weight
        if not isinstance(memory, torch.Tensor) or not memory.is_floating_point():
            raise bad_argument(
                "memory",
                f"a floating tensor (b, n_src, {self.config.hidden}) from model.encode",
                describe(memory),
                "pass memory = model.encode(source_ids)",
                kind=TypeError,
            )
        if memory.ndim != 3 or memory.shape[0] != b or memory.shape[1] == 0 or memory.shape[2] != self.config.hidden:
            raise bad_argument(
                "memory",
                f"shape (b, n_src, hidden) = ({b}, n_src >= 1, {self.config.hidden}) (b from decoder_input_ids)",
                f"shape {tuple(memory.shape)}",
                "pass memory = model.encode(source_ids) for the same batch",
            )
        if memory.device != weight.device:
            raise bad_argument(
                "memory", f"a tensor on {weight.device} (the model's)", f"one on {memory.device}", "move it there"
            )
        return memory

    # ------------------------------------------------------------------------------ forward

    def encode(self, source_ids: torch.Tensor, source_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's memory.

        Args:
            source_ids: (b, n_src) token ids.
            source_mask: (b, n_src) bool or 0/1, True/1 for real tokens (default: all real). Padded keys get
                zero weight, so the memory at real positions equals that of the unpadded sequence; the memory
                at padded positions is meaningless.

        Returns:
            (b, n_src, hidden): the last encoder block's output after the encoder's final LayerNorm.
        """
        ids = self._ids("source_ids", source_ids)
        b, n_src = ids.shape
        self._check_length("source_ids", n_src, "source tokens")
        mask = self._source_mask(source_mask, b, n_src, "source_ids")
        x = self.token_embeddings(ids)  # (b, n_src, hidden)
        if self.source_positions is not None:
            x = self.source_positions(x, 0)
        x = self.dropout(x)
        for block in self.encoder_blocks:
            x = block(x, mask)
        return self.encoder_norm(x)

    def new_cache(self, batch_size: int, max_len: int | None = None) -> DecoderCache:
        """A cache of the decoder's self-attention keys for ``batch_size`` target sequences of up to ``max_len``
        tokens (default ``max_positions``). Cross-attention keys are not cached (see the module docstring)."""
        max_len = self.config.max_positions if max_len is None else positive_int("max_len", max_len)
        if self.target_positions is not None and max_len > self.config.max_positions:
            raise bad_argument(
                "max_len",
                f"at most max_positions = {self.config.max_positions} (learned positions)",
                max_len,
                "decode shorter sequences, or build the model with a larger max_positions",
            )
        return DecoderCache([layer.new_cache(batch_size, max_len) for layer in self.decoder_layers])

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        memory: torch.Tensor,
        source_mask: torch.Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """Next-token logits of the target given the encoder's memory.

        Args:
            decoder_input_ids: (b, n_tgt) target ids (the target shifted right after a start token); with
                ``cache``, the n_tgt tokens after the ``cache.seen`` already there.
            memory: (b, n_src, hidden) from :meth:`encode`.
            source_mask: (b, n_src) the source padding mask given to :meth:`encode` (default: all real).
            cache: a :class:`DecoderCache` from :meth:`new_cache`: the new self-attention keys are appended in
                every decoder layer and each token attends to the cached ones too (positions continue from
                ``cache.seen``). A refused call leaves it as it was.

        Returns:
            (b, n_tgt, vocab_size) logits; position t predicts the target token after decoder_input_ids[:, t].
        """
        ids = self._ids("decoder_input_ids", decoder_input_ids)
        b, n = ids.shape
        memory = self._check_memory(memory, b)
        mask = self._source_mask(source_mask, b, memory.shape[1], "memory")
        offset = cache_offset(cache, len(self.decoder_blocks), b, n)
        if self.target_positions is not None and offset + n > self.config.max_positions:
            raise bad_argument(
                "decoder_input_ids",
                f"at most max_positions = {self.config.max_positions} positions in all (learned positions)",
                f"{offset} cached + {n} new tokens",
                "shorten the target, or build the model with a larger max_positions",
            )
        y = self.token_embeddings(ids)  # (b, n_tgt, hidden)
        if self.target_positions is not None:
            y = self.target_positions(y, offset)
        y = self.dropout(y)
        for index, block in enumerate(self.decoder_blocks):
            y = block(y, memory, mask, None if cache is None else cache.layers[index])
        y = self.final_norm(y)
        weight = self.token_embeddings.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(y, weight)  # (b, n_tgt, vocab)

    def forward(
        self, source_ids: torch.Tensor, decoder_input_ids: torch.Tensor, source_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``decode(decoder_input_ids, encode(source_ids, source_mask), source_mask)``: source_ids (b, n_src),
        decoder_input_ids (b, n_tgt), source_mask (b, n_src) or None -> logits (b, n_tgt, vocab_size)."""
        target = self._ids("decoder_input_ids", decoder_input_ids)
        memory = self.encode(source_ids, source_mask)  # (b, n_src, hidden)
        if target.shape[0] != memory.shape[0]:
            raise bad_argument(
                "decoder_input_ids",
                f"batch size {memory.shape[0]} (from source_ids)",
                target.shape[0],
                "give source and target the same batch size",
            )
        return self.decode(decoder_input_ids, memory, source_mask)

    # ------------------------------------------------------------------------------ generation

    def generate(
        self,
        source_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        source_mask: torch.Tensor | None = None,
        start_id: int = 0,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Decode ``max_new_tokens`` target tokens for ``source_ids`` (eval mode, no autograd; the mode is
        restored). The source is encoded once; each step decodes one token.

        Args:
            source_ids: (b, n_src) token ids.
            max_new_tokens: tokens to generate (>= 0); there is no stop token, every row gets them all.
            source_mask: (b, n_src) bool or 0/1, True/1 for real source tokens (default: all real).
            start_id: the token the target starts with (the decoder's first input).
            temperature: 0 picks the most likely token (greedy); > 0 samples from softmax(logits / temperature).
            top_k: sample among the k most likely tokens only (sampling only).
            seed: seeds the sampler's own torch.Generator, so a run is reproducible (sampling only; None: the
                global RNG).
            use_cache: keep the decoder's self-attention keys in a :class:`DecoderCache` (one token per step);
                False recomputes the whole target prefix every step (the reference the cache is tested
                against). Either way the cross-attention keys and values are recomputed from the memory.

        Returns:
            (b, 1 + max_new_tokens) ids: ``start_id`` followed by the new tokens.
        """
        ids = self._ids("source_ids", source_ids)
        b = ids.shape[0]
        _check_generation(max_new_tokens, temperature, top_k, seed, use_cache, self.config.vocab_size)
        if not _is_int(start_id) or not 0 <= start_id < self.config.vocab_size:
            raise bad_argument(
                "start_id",
                f"a token id (int) in 0..{self.config.vocab_size - 1}",
                describe(start_id),
                "pass the vocabulary's start (or BOS/pad) id",
                kind=TypeError if not _is_int(start_id) else ValueError,
            )
        total = 1 + max_new_tokens
        if self.target_positions is not None and total > self.config.max_positions:
            raise bad_argument(
                "max_new_tokens",
                f"1 + new tokens <= max_positions = {self.config.max_positions} (learned positions)",
                f"1 + {max_new_tokens} = {total}",
                "ask for fewer tokens",
            )
        generator = None
        if seed is not None:
            generator = torch.Generator(device=ids.device)
            generator.manual_seed(seed)
        # sizes that cannot fit are refused before anything is allocated (the cache checks its own)
        check_fits("max_new_tokens", (b, total), torch.int64, ids.device, "ask for fewer tokens", what="the ids")
        with evaluating(self):
            memory = self.encode(ids, source_mask)  # (b, n_src, hidden): validates source_mask too
            out = torch.full((b, total), start_id, dtype=torch.long, device=ids.device)  # (b, 1 + new)
            if max_new_tokens == 0:
                return out
            cache = self.new_cache(b, total) if use_cache else None
            logits = self.decode(out[:, :1], memory, source_mask, cache)[:, -1]  # (b, vocab)
            for step in range(max_new_tokens):
                position = 1 + step
                out[:, position] = Decoder._pick(logits, float(temperature), top_k, generator)
                if step + 1 < max_new_tokens:
                    if cache is not None:
                        logits = self.decode(out[:, position : position + 1], memory, source_mask, cache)[:, -1]
                    else:
                        logits = self.decode(out[:, : position + 1], memory, source_mask)[:, -1]
        return out

    # ------------------------------------------------------------------------------ saving

    def save(self, directory: str | Path) -> Path:
        """Write ``multihead_seq2seq.json`` (the config) and ``model.safetensors`` (the weights) to ``directory``
        (created if needed), which :func:`load_seq2seq` reads back. Returns the folder."""
        return save_model(self, directory, SEQ2SEQ_CONFIG, "seq2seq")


def _sites(model: nn.Module) -> list[AttentionSite] | None:
    return model.attention_sites() if isinstance(model, Seq2Seq) else None


register_site_finder(_sites)


_SAVED_SCHEMA = {
    "format": one_of("multihead-seq2seq"),
    "version": one_of(1),
    "name": nullable(Rule("a string", lambda value: isinstance(value, str))),
    "seq2seq": {
        "vocab_size": POSITIVE_INT,
        "max_positions": POSITIVE_INT,
        "hidden": POSITIVE_INT,
        "encoder_layers": POSITIVE_INT,
        "decoder_layers": POSITIVE_INT,
        "heads": POSITIVE_INT,
        "kv_heads": nullable(POSITIVE_INT),
        "mlp": nullable(NON_NEGATIVE_INT),
        "positions": one_of(*_POSITIONS),
        "dropout": _PROBABILITY,
        "layer_norm_eps": POSITIVE_NUMBER,
        "tie_embeddings": BOOLEAN,
    },
}


def load_seq2seq(directory: str | Path, *, dtype: torch.dtype | None = None) -> Seq2Seq:
    """The :class:`Seq2Seq` written by :meth:`Seq2Seq.save` to ``directory``, in eval mode.

    ``dtype``: cast the parameters (default: as saved). A missing or damaged file, a config the model refuses,
    or weights that do not match the config raise one InputError naming the file, before a model is built.
    """
    floating_dtype("dtype", dtype)
    folder, saved = _read_saved(
        directory,
        config_file=SEQ2SEQ_CONFIG,
        schema=_SAVED_SCHEMA,
        folder_what="a folder written by Seq2Seq.save",
        what="a seq2seq model saved by multihead",
        fix=_FIX_FOLDER,
    )
    try:
        config = Seq2SeqConfig(**saved["seq2seq"])
    except InputError as error:
        raise bad_argument(SEQ2SEQ_CONFIG, "a valid seq2seq config", str(error), _FIX_FOLDER) from None
    state = _read_weights(
        folder, lambda: Seq2Seq(config), config_file=SEQ2SEQ_CONFIG, what="the seq2seq model", fix=_FIX_FOLDER
    )
    model = Seq2Seq(config, name=saved["name"] or folder.resolve().name)
    model.to(next(iter(state.values())).dtype)
    model.load_state_dict(state)  # names and shapes were checked: a failure here is our bug
    if dtype is not None:
        model.to(dtype)
    return model.eval()
