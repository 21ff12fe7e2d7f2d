"""A GPT-style decoder built only from :class:`multihead.MultiHeadAttention`.

    x = embed[ids] (+ position[offset .. offset + n) with learned positions)
    for each block:  x = x + W^O causal_attention(LN(x));  x = x + W_2 gelu(W_1 LN(x))   (pre-LN)
    logits = LN(x) W_vocab^T

Positions are rotary (applied inside every attention layer to q and k, as in GPT-NeoX/LLaMA) or a learned
table added to the embeddings (GPT-2). ``kv_heads < heads`` is grouped-query attention (1: multi-query).
``mlp=None`` (or 0) drops the feed-forward sublayers: the attention-only transformers of the interpretability
papers (Elhage et al. 2021; Olsson et al. 2022). Decoding keeps one :class:`multihead.KVCache` per layer
(:class:`DecoderCache`); causal masks are bottom-right aligned, so a call with n new tokens over a cache of
m tokens lets new token t see the m cached keys and new tokens 0..t::

    new \\ keys   0 .. m-1   m  m+1 m+2
    m             x ... x    x   .   .
    m+1           x ... x    x   x   .
    m+2           x ... x    x   x   x
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from multihead import masks
from multihead._errors import InputError, bad_argument, describe, floating_dtype, positive_int
from multihead._limits import check_fits
from multihead._userfiles import (
    BOOLEAN,
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    Rule,
    existing_folder,
    nullable,
    one_of,
    path_kind,
    read_json,
)
from multihead.backends.paged import KeptValues
from multihead.cache import KVCache
from multihead.lab.models.contract import evaluating
from multihead.lab.models.files import reading
from multihead.layer import MultiHeadAttention
from multihead.masks import Mask
from multihead.paged import PagedBatch, PagedKVCache
from multihead.positional import LearnedPositions

__all__ = ["DecoderConfig", "DecoderBlock", "DecoderCache", "Decoder", "load_decoder", "DECODER_CONFIG"]

DECODER_CONFIG = "multihead_decoder.json"  # written by Decoder.save beside model.safetensors
_WEIGHTS = "model.safetensors"
_POSITIONS = ("rotary", "learned")
_FIX_FOLDER = "point at a folder written by Decoder.save (save the model again if it was damaged)"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ids(name: str, ids: object, vocab: int, device: torch.device) -> torch.Tensor:
    """ids (b, n) of int32/int64 with b, n >= 1, every id in 0..vocab - 1, on ``device``; else an InputError naming
    ``name``."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise bad_argument(
            name,
            "an integer tensor (b, n) of token ids",
            describe(ids),
            "pass torch.tensor([[...]])",
            kind=TypeError,
        )
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise bad_argument(name, "at least one sequence of one token", f"shape {tuple(ids.shape)}", "pass a token")
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise bad_argument(
            name,
            f"token ids in 0..{vocab - 1}",
            f"ids from {int(ids.min())} to {int(ids.max())}",
            "tokenize with the model's vocabulary",
        )
    if ids.device != device:
        raise bad_argument(name, f"a tensor on {device} (the model's)", f"one on {ids.device}", f"use {name}.to(...)")
    return ids


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes and options of a :class:`Decoder`, validated on construction (a ValueError or TypeError naming the field).

    Fields:
        vocab_size: tokens in the vocabulary.
        max_positions: longest sequence with learned positions (the table's rows); with rotary, the default
            length of :meth:`Decoder.new_cache`.
        hidden: residual stream width (hidden / heads even with rotary positions).
        layers: number of blocks.
        heads: query heads h per layer (hidden % heads == 0).
        kv_heads: key/value heads g (None: = heads; heads % kv_heads == 0; g < h is GQA, 1 is MQA).
        mlp: the feed-forward width, or None / 0 for an attention-only model (no MLP blocks).
        positions: "rotary" (RoPE in every attention layer) or "learned" (a table added to the embeddings).
        dropout: on the attention weights and on each sublayer's output, in training mode only.
        layer_norm_eps: epsilon of every LayerNorm.
        tie_embeddings: the LM head reads the token embedding matrix (no separate output matrix).
    """

    vocab_size: int = 256
    max_positions: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int | None = None
    mlp: int | None = 256
    positions: str = "rotary"
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_positions", "hidden", "layers", "heads"):
            positive_int(name, getattr(self, name))
        if self.kv_heads is not None:
            positive_int("kv_heads", self.kv_heads)
            if self.heads % self.kv_heads:
                divisors = [n for n in range(1, self.heads + 1) if self.heads % n == 0]
                raise bad_argument(
                    "kv_heads", f"a divisor of heads = {self.heads}", self.kv_heads, f"use one of {divisors}"
                )
        if self.hidden % self.heads:
            raise bad_argument(
                "hidden", f"a multiple of heads = {self.heads}", self.hidden, "pick hidden = heads * head size"
            )
        head_size = self.hidden // self.heads
        if self.positions == "rotary" and head_size % 2:
            raise bad_argument(
                "hidden",
                f"hidden / heads even with rotary positions (sin/cos come in pairs; heads = {self.heads})",
                f"{self.hidden} (head size {head_size})",
                f"pick hidden = heads * an even head size, e.g. {self.heads * (head_size + 1)}",
            )
        if self.mlp is not None:
            if not _is_int(self.mlp):
                raise bad_argument(
                    "mlp",
                    "an int width, or None/0 for attention-only",
                    describe(self.mlp),
                    "pass e.g. mlp=256",
                    kind=TypeError,
                )
            if self.mlp < 0:
                raise bad_argument("mlp", "a width >= 0 (0 or None: attention-only)", self.mlp, "pass e.g. mlp=256")
        if self.positions not in _POSITIONS:
            raise bad_argument("positions", '"rotary" or "learned"', repr(self.positions), 'pass positions="rotary"')
        dropout = self.dropout
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0.0 <= dropout < 1.0:
            raise bad_argument("dropout", "a probability in [0, 1)", describe(dropout), "pass e.g. dropout=0.1")
        eps = self.layer_norm_eps
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0.0 < eps < 1.0:
            raise bad_argument("layer_norm_eps", "a number in (0, 1)", describe(eps), "pass e.g. layer_norm_eps=1e-5")
        if not isinstance(self.tie_embeddings, bool):
            raise bad_argument(
                "tie_embeddings",
                "True or False",
                describe(self.tie_embeddings),
                "pass tie_embeddings=True",
                kind=TypeError,
            )

    @property
    def num_kv_heads(self) -> int:
        """g: the key/value heads (``kv_heads``, or ``heads`` when None)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def attention_only(self) -> bool:
        """True when the blocks have no MLP (``mlp`` None or 0)."""
        return not self.mlp


class DecoderBlock(nn.Module):
    """One pre-LayerNorm block: ``x + attention(LN(x))`` (causal), then ``x + W_2 gelu(W_1 LN(x))`` unless
    attention-only (``mlp_in``, ``mlp_out`` and ``mlp_norm`` are then None)."""

    attention: MultiHeadAttention

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.attention = MultiHeadAttention(
            config.hidden,
            config.heads,
            num_kv_heads=config.num_kv_heads,
            dropout=config.dropout,
            rotary=config.positions == "rotary",
        )
        self.mlp_norm: nn.LayerNorm | None = None
        self.mlp_in: nn.Linear | None = None
        self.mlp_out: nn.Linear | None = None
        if not config.attention_only:
            width = cast(int, config.mlp)
            self.mlp_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
            self.mlp_in = nn.Linear(config.hidden, width)
            self.mlp_out = nn.Linear(width, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        *,
        mask: Mask | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (b, n, hidden) -> (b, n, hidden); with ``cache`` the new keys are appended and attended with the
        cached ones. ``mask`` is and-ed with causal (packed documents); ``positions`` (b, n) are the rotary
        positions (default: in order)."""
        attended, _ = self.attention(
            self.attention_norm(x),
            causal=True,
            cache=cache,
            mask=mask,
            positions=positions if self.attention.rotary is not None else None,
        )
        return self.feed_forward(x + self.dropout(attended))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP sublayer: x (b, n, hidden) -> ``x + W_2 gelu(W_1 LN(x))`` (b, n, hidden); x itself when
        attention-only."""
        if self.mlp_in is not None and self.mlp_out is not None and self.mlp_norm is not None:
            hidden = F.gelu(self.mlp_in(self.mlp_norm(x)))  # (b, n, mlp)
            x = x + self.dropout(self.mlp_out(hidden))
        return x


class DecoderCache:
    """One :class:`multihead.KVCache` per layer of a :class:`Decoder` (build it with :meth:`Decoder.new_cache`).

    ``seen`` is the number of tokens decoded so far, i.e. the absolute position of the next one.
    """

    def __init__(self, layers: list[KVCache]):
        self.layers = layers

    @property
    def seen(self) -> int:
        return self.layers[0].seen

    @property
    def batch_size(self) -> int:
        return self.layers[0].batch_size

    @property
    def max_len(self) -> int:
        return self.layers[0].max_len

    def reset(self) -> None:
        """Forget every layer's keys (the storage is kept)."""
        for layer in self.layers:
            layer.reset()

    def __repr__(self) -> str:
        return (
            f"DecoderCache(layers={len(self.layers)}, batch_size={self.batch_size}, max_len={self.max_len}, "
            f"seen={self.seen})"
        )


class PagedDecoderCache:
    """One :class:`multihead.paged.PagedKVCache` per layer of a :class:`Decoder`, sharing sequence handles (build
    it with :meth:`Decoder.new_paged_cache`): :meth:`add` a sequence, run the model on :meth:`batch` views (one
    row per sequence, each at its own length), :meth:`free` it when it is done."""

    def __init__(self, pools: list[PagedKVCache]):
        self.pools = pools

    def add(self) -> int:
        """A new, empty sequence in every layer: its handle."""
        handles = {pool.add() for pool in self.pools}
        assert len(handles) == 1, "the layers' pools hand out handles together"
        return handles.pop()

    def free(self, handle: int) -> None:
        """Retire a sequence: its pages go back to every layer's pool."""
        for pool in self.pools:
            pool.free(handle)

    def seen(self, handle: int) -> int:
        """Tokens the sequence holds: its next token's position."""
        return self.pools[0].seen(handle)

    @property
    def pages_in_use(self) -> int:
        """Pages held in all layers together."""
        return sum(pool.pages_in_use for pool in self.pools)

    def batch(self, handles: list[int]) -> PagedDecoderBatch:
        """The sequences ``handles``, one per batch row, as the model's ``cache``."""
        plans = KeptValues()  # the layers' pools hold equal tables: each append's plan is made once, for all
        return PagedDecoderBatch([pool.batch(handles, shared=plans) for pool in self.pools], list(handles))


class PagedDecoderBatch:
    """Sequences of a :class:`PagedDecoderCache`, one per batch row: ``layers`` the per-layer views."""

    def __init__(self, layers: list[PagedBatch], handles: list[int]):
        self.layers, self.handles = layers, handles


def cache_offset(cache: object, layers: int, batch_size: int, new_tokens: int) -> int:
    """The position of the first new token: ``cache.seen`` for a :class:`DecoderCache` of ``layers`` layers and
    ``batch_size`` rows with room for ``new_tokens`` more in every layer (checked before any is appended, so a
    refusal changes nothing), 0 without a cache."""
    if cache is None:
        return 0
    if isinstance(cache, PagedDecoderBatch):  # each sequence at its own position: read from the layer's view
        if len(cache.layers) != layers or len(cache.handles) != batch_size:
            raise bad_argument(
                "cache",
                f"a paged batch of {layers} layers and {batch_size} sequences (one per row)",
                f"one of {len(cache.layers)} layers and {len(cache.handles)} sequences",
                "pass model.new_paged_cache(...).batch(handles) with one handle per row",
            )
        for view in cache.layers:
            view.check_room(new_tokens)
        return 0
    if not isinstance(cache, DecoderCache):
        raise bad_argument(
            "cache",
            "a DecoderCache (model.new_cache(b)) or a paged batch (model.new_paged_cache(...).batch(handles))",
            describe(cache),
            "build one with model.new_cache",
            kind=TypeError,
        )
    if len(cache.layers) != layers or cache.batch_size != batch_size:
        raise bad_argument(
            "cache",
            f"a cache of {layers} layers for batch size {batch_size}",
            f"one of {len(cache.layers)} layers for batch size {cache.batch_size}",
            "build it with model.new_cache(batch_size) for this model and batch",
        )
    for layer in cache.layers:
        layer.check_room(new_tokens)
    return cache.seen


def save_model(model: nn.Module, directory: str | Path, config_file: str, kind: str) -> Path:
    """Write ``model``'s weights (``model.safetensors``) and ``config_file``, holding ``{"format":
    "multihead-<kind>", "version": 1, "name": model.name, <kind>: model.config}``, to ``directory`` (created if
    needed): the save of :class:`Decoder` and of :class:`~multihead.lab.models.Seq2Seq`. Returns the folder."""
    from safetensors.torch import save_file  # imported here: only saving needs it

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}, str(folder / _WEIGHTS)
    )
    saved = {
        "format": f"multihead-{kind}",
        "version": 1,
        "name": model.name,
        kind: dataclasses.asdict(model.config),  # type: ignore[call-overload]
    }
    (folder / config_file).write_text(json.dumps(saved, indent=1))
    return folder


class Decoder(nn.Module):
    """A GPT-style language model: token embedding, ``layers`` pre-LN :class:`DecoderBlock` s, final LN, LM head.

    ``decoder.blocks[l].attention`` (also ``decoder.attention_layers[l]``) is layer l's
    :class:`multihead.MultiHeadAttention`, so :func:`multihead.lab.inspect.capture` records its heads.

    Example:
        >>> model = Decoder(DecoderConfig(vocab_size=50, hidden=32, layers=2, heads=4, kv_heads=2, mlp=None))
        >>> model(torch.tensor([[1, 2, 3]])).shape                 # (b, n, vocab)
        torch.Size([1, 3, 50])
        >>> model.generate([1, 2, 3], 4).shape                     # (b, n + new)
        torch.Size([1, 7])
    """

    def __init__(self, config: DecoderConfig = DecoderConfig(), *, name: str = "decoder"):
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise bad_argument(
                "config", "a DecoderConfig", describe(config), "pass DecoderConfig(vocab_size=..., ...)", kind=TypeError
            )
        self.config = config
        self.name = name
        self.token_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.positions = (
            LearnedPositions(config.max_positions, config.hidden) if config.positions == "learned" else None
        )
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        # tied: the logits read token_embeddings.weight (one matrix, saved once)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden, config.vocab_size, bias=False)
        nn.init.normal_(self.token_embeddings.weight, std=0.02)  # GPT-2's scale: tied logits start near 0
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=0.02)

    @property
    def attention_layers(self) -> list[MultiHeadAttention]:
        """The attention layer of every block, in order (index = layer number)."""
        return [cast(DecoderBlock, block).attention for block in self.blocks]

    def new_cache(self, batch_size: int, max_len: int | None = None) -> DecoderCache:
        """A cache for ``batch_size`` sequences of up to ``max_len`` tokens (default ``max_positions``)."""
        max_len = self.config.max_positions if max_len is None else positive_int("max_len", max_len)
        if self.positions is not None and max_len > self.config.max_positions:
            raise bad_argument(
                "max_len",
                f"at most max_positions = {self.config.max_positions} (learned positions)",
                max_len,
                "decode shorter sequences, or build the model with a larger max_positions",
            )
        return DecoderCache([layer.new_cache(batch_size, max_len) for layer in self.attention_layers])

    def new_paged_cache(self, num_pages: int, page_size: int = 16) -> PagedDecoderCache:
        """A :class:`PagedDecoderCache`: a pool of ``num_pages`` pages of ``page_size`` tokens in every layer."""
        return PagedDecoderCache([layer.new_paged_cache(num_pages, page_size) for layer in self.attention_layers])

    def _check_ids(self, name: str, ids: object) -> torch.Tensor:
        return _check_ids(name, ids, self.config.vocab_size, self.token_embeddings.weight.device)

    def forward(
        self, input_ids: torch.Tensor, *, cache: DecoderCache | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Next-token logits.

        Args:
            input_ids: (b, n) token ids; with ``cache``, the n tokens after the ``cache.seen`` already there.
            cache: a :class:`DecoderCache` from :meth:`new_cache`: the tokens' keys are appended in every
                layer and each attends to the cached ones too (positions continue from ``cache.seen``).
            document_ids: (b, n) packed documents (each one run of equal indices): a token attends only to its
                own document, and positions restart at each (:func:`multihead.masks.document_positions`), so
                every document gives the logits it would alone. Not with a cache.

        Returns:
            (b, n, vocab_size) logits; position t predicts the token after input_ids[:, t].
        """
        x = self.hidden_states(input_ids, cache=cache, document_ids=document_ids)  # (b, n, hidden)
        weight = self.token_embeddings.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight)  # (b, n, vocab)

    def hidden_states(
        self, input_ids: torch.Tensor, *, cache: DecoderCache | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final LayerNorm's output, which the LM head reads: (b, n) ids -> (b, n, hidden) (arguments as
        :meth:`forward`)."""
        ids = self._check_ids("input_ids", input_ids)
        b, n = ids.shape
        offset = cache_offset(cache, len(self.blocks), b, n)
        mask, positions = self._packed(document_ids, ids, cache)
        if isinstance(cache, PagedDecoderBatch) and self.positions is not None:  # learned: each row at its own
            positions = cache.layers[0].positions(n, ids.device)
        # packed documents: each document's own positions count, checked by the table (on the host)
        if self.positions is not None and positions is None and offset + n > self.config.max_positions:
            raise bad_argument(
                "input_ids",
                f"at most max_positions = {self.config.max_positions} positions in all (learned positions)",
                f"{offset} cached + {n} new tokens",
                "shorten the sequence, or build the model with a larger max_positions",
            )
        x = self.token_embeddings(ids)  # (b, n, hidden)
        if self.positions is not None:
            x = self.positions(x, offset, positions)
        x = self.dropout(x)
        rotary_positions = None if isinstance(cache, PagedDecoderBatch) else positions  # the paged view gives its own
        for index, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache.layers[index], mask=mask, positions=rotary_positions)
        return self.final_norm(x)

    def _packed(
        self, document_ids: object, ids: torch.Tensor, cache: DecoderCache | None
    ) -> tuple[Mask | None, torch.Tensor | None]:
        """The documents mask and the positions that restart at each document, or (None, None) unpacked."""
        if document_ids is None:
            return None, None
        if cache is not None:
            raise bad_argument(
                "document_ids",
                "no cache beside it (packed documents are a training or scoring call)",
                "a cache",
                "drop cache=, or document_ids= and decode each document on its own",
            )
        if not isinstance(document_ids, torch.Tensor) or tuple(document_ids.shape) != tuple(ids.shape):
            raise bad_argument(
                "document_ids",
                f"a tensor of input_ids' shape {tuple(ids.shape)}",
                describe(document_ids),
                "give one document index per token",
            )
        document_ids = document_ids.to(ids.device)
        return masks.documents(document_ids), masks.document_positions(document_ids)

    # ------------------------------------------------------------------------------ generation

    def _prompt(self, prompt_ids: object) -> torch.Tensor:
        device = self.token_embeddings.weight.device
        if isinstance(prompt_ids, (list, tuple)):
            if not prompt_ids or not all(_is_int(token) for token in prompt_ids):
                raise bad_argument(
                    "prompt_ids",
                    "a non-empty list of int token ids, or a (b, n) tensor",
                    describe(prompt_ids),
                    "pass e.g. [1, 2, 3]",
                    kind=TypeError,
                )
            prompt_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # (1, n)
        return self._check_ids("prompt_ids", prompt_ids).long()

    @staticmethod
    def _check_sampling(temperature: object, top_k: object, seed: object) -> None:
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
            raise bad_argument(
                "temperature",
                "a number >= 0",
                describe(temperature),
                "pass temperature=0 (greedy) or e.g. 0.8",
                kind=TypeError,
            )
        if not temperature >= 0 or temperature == float("inf"):
            raise bad_argument(
                "temperature", "a finite number >= 0 (0: greedy)", temperature, "pass temperature=0 or e.g. 0.8"
            )
        if top_k is not None:
            positive_int("top_k", top_k)
        if seed is not None and not _is_int(seed):
            raise bad_argument("seed", "an int or None", describe(seed), "pass e.g. seed=0", kind=TypeError)
        if temperature == 0 and (top_k is not None or seed is not None):
            raise bad_argument(
                "top_k" if top_k is not None else "seed",
                "None with greedy decoding (temperature=0)",
                top_k if top_k is not None else seed,
                "pass temperature > 0 to sample, or drop top_k and seed",
            )

    @staticmethod
    def _pick(
        logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
    ) -> torch.Tensor:
        """logits (b, vocab) of the last position -> next ids (b,)."""
        if temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits / temperature
        if top_k is not None:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (b, 1): the k-th largest logit
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # (b, vocab)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    def generate(
        self,
        prompt_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int | None = None,
        use_cache: bool = True,
    ) -> torch.Tensor:
        """Continue ``prompt_ids`` by ``max_new_tokens`` tokens (eval mode, no autograd; the mode is restored).

        Args:
            prompt_ids: (b, n) token ids, or a list of ids (b = 1).
            max_new_tokens: tokens to add (>= 0).
            temperature: 0 picks the most likely token (greedy); > 0 samples from softmax(logits / temperature).
            top_k: sample among the k most likely tokens only (sampling only).
            seed: seeds the sampler's own torch.Generator, so a run is reproducible (sampling only; None: the
                global RNG).
            use_cache: decode with a KV cache (one token per step); False recomputes the whole prefix every
                step (the reference the cache is tested against).

        Returns:
            (b, n + max_new_tokens) ids: the prompt followed by the new tokens.
        """
        ids = self._prompt(prompt_ids)
        _check_generation(max_new_tokens, temperature, top_k, seed, use_cache, self.config.vocab_size)
        b, n = ids.shape
        total = n + max_new_tokens
        if self.positions is not None and total > self.config.max_positions:
            name = "prompt_ids" if n > self.config.max_positions else "max_new_tokens"
            raise bad_argument(
                name,
                f"prompt + new tokens <= max_positions = {self.config.max_positions} (learned positions)",
                f"{n} + {max_new_tokens} = {total}",
                "shorten the prompt or ask for fewer tokens",
            )
        generator = None
        if seed is not None:
            generator = torch.Generator(device=ids.device)
            generator.manual_seed(seed)
        if max_new_tokens == 0:
            return ids.clone()
        # sizes that cannot fit are refused before anything is allocated (the cache checks its own)
        check_fits("max_new_tokens", (b, total), torch.int64, ids.device, "ask for fewer tokens", what="the ids")
        out = torch.empty(b, total, dtype=torch.long, device=ids.device)  # (b, n + new), filled as we go
        out[:, :n] = ids
        with evaluating(self):
            cache = self.new_cache(b, total) if use_cache else None
            logits = self(ids, cache=cache)[:, -1]  # (b, vocab): the prompt's last position
            for step in range(max_new_tokens):
                position = n + step
                out[:, position] = self._pick(logits, float(temperature), top_k, generator)
                if step + 1 < max_new_tokens:
                    if cache is not None:
                        logits = self(out[:, position : position + 1], cache=cache)[:, -1]
                    else:
                        logits = self(out[:, : position + 1])[:, -1]
        return out

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        max_new_tokens: int | Sequence[int],
        *,
        eos_id: int | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        seeds: Sequence[int] | None = None,
        max_batch: int = 16,
        page_size: int = 16,
    ) -> list[torch.Tensor]:
        """Continue every prompt, decoding up to ``max_batch`` of them at once (continuous batching).

        Each prompt is prefilled alone into a paged KV cache, then joins the running batch; every step decodes one
        token for every sequence in it, each at its own length (the ``paged`` backend, through each layer's
        ``Attend``). A sequence stops at its own ``eos_id`` or length, its pages go back to the pool, and the next
        prompt waiting takes its place. Each sequence gets the tokens :meth:`generate` gives its prompt alone (greedy,
        or sampled with its own seed), cut after its first ``eos_id``.

        Args:
            prompts: token id lists (or 1-D tensors), of any lengths.
            max_new_tokens: tokens to add to each (one int for all, or one per prompt).
            eos_id: a token that ends a sequence (kept in its output), or None.
            temperature, top_k: as for :meth:`generate`.
            seeds: one seed per prompt for sampling (None: the global RNG, in the order tokens are drawn).
            max_batch: the most sequences decoded at once.
            page_size: tokens per page of the cache.

        Returns:
            A list of 1-D id tensors, in the prompts' order: each prompt followed by its new tokens.
        """
        device = self.token_embeddings.weight.device
        ids, budgets = self._batch_prompts(prompts, max_new_tokens)
        self._check_batch_options(budgets, eos_id, temperature, top_k, seeds)
        max_batch = positive_int("max_batch", max_batch)
        longest = max(len(p) + budget for p, budget in zip(ids, budgets, strict=True))
        if self.positions is not None and longest > self.config.max_positions:
            raise bad_argument(
                "max_new_tokens",
                f"prompt + new tokens <= max_positions = {self.config.max_positions} (learned positions)",
                longest,
                "shorten the prompts or ask for fewer tokens",
            )
        generators = _seeded_generators(seeds, len(ids), device)
        # pages for max_batch sequences at their longest: the pool never runs out mid-way
        pages = min(max_batch, len(ids)) * -(-longest // positive_int("page_size", page_size))
        with evaluating(self):
            cache = self.new_paged_cache(pages, page_size)
            outputs = self._decode_continuously(
                cache,
                ids,
                budgets,
                generators,
                max_batch=max_batch,
                eos_id=eos_id,
                temperature=temperature,
                top_k=top_k,
            )
        return [torch.tensor(tokens, dtype=torch.long, device=device) for tokens in outputs]

    def _batch_prompts(
        self, prompts: object, max_new_tokens: int | Sequence[int]
    ) -> tuple[list[torch.Tensor], list[int]]:
        """generate_batch's prompts as 1-D id tensors (n_i,) on the model's device, and the number of tokens to add
        to each, one per prompt (their values are checked by :meth:`_check_batch_options`)."""
        device = self.token_embeddings.weight.device
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise bad_argument(
                "prompts", "a non-empty list of token id lists", describe(prompts), "pass e.g. [[1, 2], [3]]"
            )
        ids = [self._prompt(list(p) if isinstance(p, (list, tuple)) else p)[0].to(device) for p in prompts]
        budgets: list[int] = (
            list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(ids)  # type: ignore[list-item]
        )
        if len(budgets) != len(ids):
            raise bad_argument(
                "max_new_tokens", f"one int, or {len(ids)} (one per prompt)", len(budgets), "give one per prompt"
            )
        return ids, budgets

    def _check_batch_options(
        self,
        budgets: list[int],
        eos_id: int | None,
        temperature: float,
        top_k: int | None,
        seeds: Sequence[int] | None,
    ) -> None:
        """generate_batch's per-prompt budgets and sampling options (as for :meth:`generate`), one seed per prompt
        when seeds are given, and eos_id; an InputError naming the first bad one."""
        for budget in budgets:
            _check_generation(budget, temperature, top_k, None, True, self.config.vocab_size)
        if seeds is not None and (not isinstance(seeds, (list, tuple)) or len(seeds) != len(budgets)):
            raise bad_argument(
                "seeds", f"{len(budgets)} seeds (one per prompt), or None", describe(seeds), "one per prompt"
            )
        for seed in seeds or []:
            Decoder._check_sampling(temperature, top_k, seed)
        if eos_id is not None and not (_is_int(eos_id) and 0 <= eos_id < self.config.vocab_size):
            raise bad_argument(
                "eos_id", f"a token id in [0, {self.config.vocab_size})", describe(eos_id), "pass the EOS token's id"
            )

    def _decode_continuously(
        self,
        cache: PagedDecoderCache,
        ids: list[torch.Tensor],
        budgets: list[int],
        generators: list[torch.Generator | None],
        *,
        max_batch: int,
        eos_id: int | None,
        temperature: float,
        top_k: int | None,
    ) -> list[list[int]]:
        """generate_batch's decoding loop over ``cache`` (in eval mode): each prompt ids[i] (n_i,) with tokens still
        to add is prefilled alone, then decoded one token per step with the running batch of at most ``max_batch``
        sequences until it reaches budgets[i] new tokens or eos_id. Returns every prompt's ids followed by its new
        tokens, in the prompts' order."""
        device = self.token_embeddings.weight.device
        outputs: list[list[int]] = [p.tolist() for p in ids]
        waiting = [index for index, budget in enumerate(budgets) if budget > 0]
        running: dict[int, int] = {}  # handle -> prompt index

        def take(index: int, logits: torch.Tensor) -> bool:
            """Append the next token of prompt ``index`` from its logits (1, vocab); whether it is done."""
            token = int(self._pick(logits, float(temperature), top_k, generators[index])[0])
            outputs[index].append(token)
            new = len(outputs[index]) - len(ids[index])
            return new == budgets[index] or token == eos_id

        while waiting or running:
            while waiting and len(running) < max_batch:  # admit: prefill alone, then join the batch
                index = waiting.pop(0)
                handle = cache.add()
                logits = self(ids[index][None], cache=cache.batch([handle]))[:, -1]
                if take(index, logits):
                    cache.free(handle)
                else:
                    running[handle] = index
            if not running:
                continue
            handles = list(running)
            last = torch.tensor([[outputs[running[h]][-1]] for h in handles], device=device)  # (S, 1)
            logits = self(last, cache=cache.batch(handles))[:, -1]  # (S, vocab)
            for row, handle in enumerate(handles):
                if take(running[handle], logits[row : row + 1]):
                    cache.free(handle)
                    del running[handle]
        return outputs

    # ------------------------------------------------------------------------------ saving

    def save(self, directory: str | Path) -> Path:
        """Write ``multihead_decoder.json`` (the config) and ``model.safetensors`` (the weights) to ``directory``
        (created if needed), which :func:`load_decoder` reads back. Returns the folder."""
        return save_model(self, directory, DECODER_CONFIG, "decoder")


def _check_generation(
    max_new_tokens: int, temperature: float, top_k: int | None, seed: int | None, use_cache: bool, vocab_size: int
) -> None:
    """The options of ``generate`` (see :meth:`Decoder.generate`); an InputError naming the first bad one."""
    if not _is_int(max_new_tokens):
        raise bad_argument(
            "max_new_tokens",
            "an int >= 0",
            describe(max_new_tokens),
            "pass e.g. max_new_tokens=20",
            kind=TypeError,
        )
    if max_new_tokens < 0:
        raise bad_argument("max_new_tokens", "an int >= 0", max_new_tokens, "pass e.g. max_new_tokens=20")
    Decoder._check_sampling(temperature, top_k, seed)
    if top_k is not None and top_k > vocab_size:
        raise bad_argument("top_k", f"at most vocab_size = {vocab_size}", top_k, "pass a smaller top_k, or None")
    if not isinstance(use_cache, bool):
        raise bad_argument("use_cache", "True or False", describe(use_cache), "pass use_cache=True", kind=TypeError)


def _seeded_generators(seeds: Sequence[int] | None, count: int, device: torch.device) -> list[torch.Generator | None]:
    """One torch.Generator on ``device`` per prompt, seeded with its seed; ``count`` Nones (the global RNG) when
    ``seeds`` is None."""
    generators: list[torch.Generator | None] = [None] * count
    for index, seed in enumerate(seeds or []):
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        generators[index] = generator
    return generators


_PROBABILITY = Rule(
    "a number in [0, 1)",
    lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0,
)
_SAVED_SCHEMA = {
    "format": one_of("multihead-decoder"),
    "version": one_of(1),
    "name": nullable(Rule("a string", lambda value: isinstance(value, str))),
    "decoder": {
        "vocab_size": POSITIVE_INT,
        "max_positions": POSITIVE_INT,
        "hidden": POSITIVE_INT,
        "layers": POSITIVE_INT,
        "heads": POSITIVE_INT,
        "kv_heads": nullable(POSITIVE_INT),
        "mlp": nullable(NON_NEGATIVE_INT),
        "positions": one_of(*_POSITIONS),
        "dropout": _PROBABILITY,
        "layer_norm_eps": POSITIVE_NUMBER,
        "tie_embeddings": BOOLEAN,
    },
}


def load_decoder(directory: str | Path, *, dtype: torch.dtype | None = None) -> Decoder:
    """The :class:`Decoder` written by :meth:`Decoder.save` to ``directory``, in eval mode.

    ``dtype``: cast the parameters (default: as saved). A missing or damaged file, a config the decoder
    refuses, or weights that do not match the config raise one InputError naming the file, before a model
    is built.
    """
    floating_dtype("dtype", dtype)
    folder, saved = _read_saved(
        directory,
        config_file=DECODER_CONFIG,
        schema=_SAVED_SCHEMA,
        folder_what="a folder written by Decoder.save",
        what="a decoder saved by multihead",
        fix=_FIX_FOLDER,
    )
    try:
        config = DecoderConfig(**saved["decoder"])
    except InputError as error:
        raise bad_argument(DECODER_CONFIG, "a valid decoder config", str(error), _FIX_FOLDER) from None
    state = _read_weights(
        folder, lambda: Decoder(config), config_file=DECODER_CONFIG, what="the decoder", fix=_FIX_FOLDER
    )
    model = Decoder(config, name=saved["name"] or folder.resolve().name)
    model.to(next(iter(state.values())).dtype)
    model.load_state_dict(state)  # names and shapes were checked: a failure here is our bug
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def _read_saved(
    directory: str | Path, *, config_file: str, schema: Any, folder_what: str, what: str, fix: str
) -> tuple[Path, Any]:
    """The folder written by a model's ``save`` and its JSON config, checked against ``schema``: a missing folder or
    file, or a config not of the schema's shape, raises an InputError naming it."""
    folder = existing_folder("directory", directory, what=folder_what, fix=fix)
    for name in (config_file, _WEIGHTS):
        if path_kind(folder / name) != "file":
            raise bad_argument(
                "directory",
                f"a folder with {config_file} and {_WEIGHTS}",
                f"{str(folder)!r} without {name}",
                fix,
            )
    return folder, read_json(config_file, folder / config_file, what=what, schema=schema, fix=fix)


def _read_weights(
    folder: Path, build: Callable[[], nn.Module], *, config_file: str, what: str, fix: str
) -> dict[str, torch.Tensor]:
    """The tensors of ``folder/model.safetensors``, checked against the parameter names and shapes of ``build()``
    (built on the meta device: nothing is allocated). An unreadable file, missing or unexpected names, or a
    wrong shape raise an InputError naming the file; ``what`` is the model ``config_file`` describes."""
    from safetensors import safe_open  # imported here: only loading needs it

    with reading(folder, [_WEIGHTS], what="a safetensors file of the weights", fix=fix):
        with safe_open(str(folder / _WEIGHTS), framework="pt") as weights:
            state = {name: weights.get_tensor(name) for name in weights.keys()}
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in build().state_dict().items()}
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    if missing or unexpected:
        raise bad_argument(
            _WEIGHTS,
            f"the parameters of {what} {config_file} describes",
            f"missing {missing[:4]}, unexpected {unexpected[:4]}",
            fix,
        )
    for name, shape in expected.items():
        tensor = state[name]
        if tuple(tensor.shape) != shape or not tensor.is_floating_point():
            raise bad_argument(
                _WEIGHTS,
                f"{name!r}: floating, of shape {shape}",
                f"{tensor.dtype} of shape {tuple(tensor.shape)}",
                fix,
            )
    return state
