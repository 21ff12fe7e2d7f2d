"""Multi-head Latent Attention (MLA: DeepSeek-V2 and V3, Kimi K2) and its latent cache.

Every head's key and value come from one low-rank latent per token, and the rotary part of the key is one
vector shared by all heads. Sizes: h heads, c = kv_lora_rank (the latent), r = qk_rope_head_dim (the rotary
part of a query or key), dn = qk_nope_head_dim (the rest of it), e = v_head_dim (a value)::

    [c_kv, k_pe] = x W^DKV                c_kv (c), k_pe (r)                     kv_a_proj_with_mqa
    c_kv = RMSNorm(c_kv)                                                          kv_a_layernorm
    [k_nope_n, v_n] = c_kv W^UKV_n        per head n: k_nope (dn), v (e)          kv_b_proj
    [q_nope_n, q_pe_n] = x W^Q_n          or RMSNorm(x W^DQ) W^UQ_n (q_lora_rank)  q_proj, or q_a_proj -> q_b_proj
    head_n = softmax([q_nope_n, rope(q_pe_n)] . [k_nope_n, rope(k_pe)] * scale) v_n
    out = Concat(head_1, ..., head_h) W^O                                         o_proj

with scale = 1 / sqrt(dn + r). The module names are those of transformers' ``DeepseekV3Attention``, so its
``state_dict()`` loads as it is (:meth:`LatentAttention.from_transformers`).

A :class:`LatentCache` keeps per token only what the keys and values are made from: c_kv after the norm and
k_pe after rotary, c + r numbers whatever the number of heads (576 for DeepSeek-V3, against
h (dn + r + e) = 40960 for a standard KV cache of its 128 heads).

Two ways to attend, equal up to rounding (tested in float64):

- **plain**: expand the latent to per-head keys (b, h, j, dn + r) and values (b, h, j, e) with kv_b_proj, then
  multi-head attention (g = h);
- **absorbed** (DeepSeek's inference trick): since q_nope . (W^UK c_kv) = (W^UK^T q_nope) . c_kv, fold W^UK into
  the query and W^UV into the output: multi-query attention (g = 1) straight over the latent, with query
  [W^UK^T q_nope, rope(q_pe)] (c + r), key [c_kv, rope(k_pe)] (c + r) and value c_kv (c); each head's output
  (c) then goes through W^UV to its value size e.

Both are one call of the layer's :class:`~multihead.attend.Attend`, so forward hooks, head gates and ablations
see every head. In the absorbed call the hooks see the latent query, key and value (d = c + r, e = c, g = 1),
and the weights are the same as the plain call's.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from multihead._errors import (
    bad_argument,
    checked_flag,
    checked_probability,
    describe,
    floating_dtype,
    positive_int,
    usable_device,
)
from multihead._inputs import like_parameters, matching, tensor_argument
from multihead._limits import check_fits
from multihead.attend import Attend
from multihead.backends import registry
from multihead.cache import check_fitting
from multihead.functional import autocast_on
from multihead.heads import HeadSurgery
from multihead.masks import Mask
from multihead.positional import RotaryEmbedding, check_positions

__all__ = ["LatentAttention", "LatentCache", "PendingLatent"]


# --------------------------------------------------------------------------- the cache


@dataclass
class PendingLatent:
    """An append prepared by :meth:`LatentCache.stage`: what to attend over now, and how to make it count.

    ``keys`` (b, 1, L, c + r) is every token the new queries attend over (the held ones, then the new ones):
    the latent c_kv in ``keys[..., :c]`` and the rotated shared key in ``keys[..., c:]``.
    """

    keys: torch.Tensor
    cache: LatentCache
    new: int  # tokens appended
    held_before: int
    committed: bool = False

    @property
    def latent(self) -> torch.Tensor:
        """(b, 1, L, c): the latents, which are also the absorbed call's values."""
        return self.keys[..., : self.cache.kv_lora_rank]

    @property
    def rope_keys(self) -> torch.Tensor:
        """(b, 1, L, r): the rotated shared keys."""
        return self.keys[..., self.cache.kv_lora_rank :]

    def commit(self) -> None:
        """Make the append count: the cache now holds the new tokens."""
        self.cache._commit(self)


class LatentCache:
    """What an MLA layer keeps of each token: the latent c_kv (c) and the rotated shared key k_pe (r).

    One preallocated tensor ``storage`` (b, 1, max_len, c + r): token t of batch row s is
    ``storage[s, 0, t]`` = [c_kv, k_pe]. The unit axis is the one key/value head of the absorbed
    multi-query call, which reads the held tokens in place (key: all c + r numbers, value: the first c).
    Nothing per head is stored. Build one with ``layer.new_cache(batch_size, max_len)``, then call
    ``layer(x, causal=True, cache=cache)`` for the prompt and once per new token (or several).

    Nothing is lost on failure: :meth:`stage` checks and writes the new tokens in the free slots past
    ``len(cache)`` (which hold nothing yet) and :meth:`PendingLatent.commit` makes them count; the layer commits
    only once its whole call has succeeded. ``len(cache)`` is the number of tokens held, which is also the
    absolute position of the next one (:attr:`seen`).

    Example:
        >>> cache = LatentCache(batch_size=2, max_len=16, kv_lora_rank=8, rope_head_dim=4)
        >>> latent, rope_keys = cache.append(torch.randn(2, 5, 8), torch.randn(2, 5, 4))
        >>> latent.shape, rope_keys.shape, len(cache)
        (torch.Size([2, 5, 8]), torch.Size([2, 5, 4]), 5)
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        kv_lora_rank: int,
        rope_head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        self.batch_size = positive_int("batch_size", batch_size)
        self.max_len = positive_int("max_len", max_len)
        self.kv_lora_rank = positive_int("kv_lora_rank", kv_lora_rank)
        self.rope_head_dim = positive_int("rope_head_dim", rope_head_dim)
        dtype = floating_dtype("dtype", dtype, allow_none=False)
        device = usable_device("device", device)
        shape = (self.batch_size, 1, self.max_len, self.kv_lora_rank + self.rope_head_dim)
        check_fits("max_len", shape, dtype, device, "use a smaller max_len or batch_size", what="the cache's storage")
        self.storage = torch.zeros(shape, dtype=dtype, device=device)  # (b, 1, max_len, c + r)
        self._held = 0

    def __len__(self) -> int:
        """Tokens held (per batch row)."""
        return self._held

    @property
    def seen(self) -> int:
        """The absolute position of the next token: the tokens appended since the last :meth:`reset`."""
        return self._held

    def __repr__(self) -> str:
        return (
            f"LatentCache(batch_size={self.batch_size}, max_len={self.max_len}, kv_lora_rank={self.kv_lora_rank}, "
            f"rope_head_dim={self.rope_head_dim}, dtype={self.storage.dtype}, held={len(self)})"
        )

    @property
    def latent(self) -> torch.Tensor:
        """(b, L, c): the held latents c_kv (after kv_a_layernorm), a view of the storage."""
        return self.storage[:, 0, : self._held, : self.kv_lora_rank]

    @property
    def rope_keys(self) -> torch.Tensor:
        """(b, L, r): the held shared keys k_pe (after rotary, at their absolute positions), a view."""
        return self.storage[:, 0, : self._held, self.kv_lora_rank :]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes per batch row: (c + r) x the element size."""
        return (self.kv_lora_rank + self.rope_head_dim) * self.storage.element_size()

    def positions(self, n: int) -> torch.Tensor:
        """(n,) the absolute positions the next ``n`` tokens take: seen .. seen + n - 1 (on the CPU)."""
        return torch.arange(self.seen, self.seen + positive_int("n", n))

    def reset(self) -> None:
        """Forget every token; the storage is kept for reuse."""
        self._held = 0

    def check_compatible(
        self, batch_size: int, kv_lora_rank: int, rope_head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Raise, naming ``cache``, unless latents of these sizes, dtype and device can go into this cache."""
        check_fitting(
            "a latent cache",
            (
                ("batch size", self.batch_size, batch_size),
                ("kv_lora_rank c", self.kv_lora_rank, kv_lora_rank),
                ("rope head dim r", self.rope_head_dim, rope_head_dim),
            ),
            (self.storage.dtype, self.storage.device),
            (dtype, torch.device(device)),
            "build the cache with layer.new_cache(batch_size, max_len) for this layer and batch",
            "build the cache with layer.new_cache after moving or casting the layer",
        )

    def check_room(self, new_tokens: int) -> None:
        """Raise, naming ``cache``, if ``new_tokens`` more tokens would pass max_len."""
        if self._held + new_tokens > self.max_len:
            raise bad_argument(
                "cache",
                f"room for {new_tokens} more token(s) (max_len = {self.max_len})",
                f"{self._held} already held",
                "build the cache with a larger max_len, or call cache.reset() to start a new sequence",
            )

    def _check_new(self, name: str, t: object, last: int, axis: str, n: int | None) -> int:
        """Validate latent (b, n, c) or rope_keys (b, n, r): a tensor of the storage's dtype and device, exactly
        that shape (no broadcast, no cast), n >= 1 (and the other one's n); returns n."""
        layout = f"(b, n, {axis}) = ({self.batch_size}, n, {last})"
        t = tensor_argument(name, t, fix=f"pass {name} as a tensor {layout}")
        fix = f"convert with {name}.to(cache.storage), or build the cache to match"
        matching(name, t, self.storage, "the cache", fix=fix)
        if t.ndim != 3 or t.shape[0] != self.batch_size or t.shape[2] != last or t.shape[1] < 1:
            raise bad_argument(
                name, f"shape {layout} with n >= 1", f"shape {tuple(t.shape)}", "give every batch row, one per token"
            )
        if n is not None and t.shape[1] != n:
            raise bad_argument(name, f"n = {n} new tokens (from latent)", t.shape[1], "give both the same tokens")
        return t.shape[1]

    def stage(self, latent: torch.Tensor, rope_keys: torch.Tensor) -> PendingLatent:
        """Check and prepare appending latent (b, n, c) and rope_keys (b, n, r); nothing counts until
        :meth:`PendingLatent.commit` (``len(self)`` and the tokens held are unchanged here).

        The pending append's ``keys`` (b, 1, L, c + r), L = len(cache) + n, are every token to attend over.
        """
        n = self._check_new("latent", latent, self.kv_lora_rank, "c", None)
        self._check_new("rope_keys", rope_keys, self.rope_head_dim, "r", n)
        self.check_room(n)
        held, c = self._held, self.kv_lora_rank
        # the free slots past len(self) hold nothing yet: writing there changes nothing that counts
        self.storage[:, 0, held : held + n, :c] = latent
        self.storage[:, 0, held : held + n, c:] = rope_keys
        return PendingLatent(self.storage[:, :, : held + n], self, n, held)

    def _commit(self, pending: PendingLatent) -> None:
        if pending.committed:
            raise RuntimeError("this latent cache append was already committed")
        if self._held != pending.held_before:
            raise RuntimeError(
                "the cache changed between stage() and commit(): another append or reset came in between; stage again"
            )
        self._held += pending.new
        pending.committed = True

    def append(self, latent: torch.Tensor, rope_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add latent (b, n, c) and rope_keys (b, n, r) now; returns every held latent (b, L, c) and rope key
        (b, L, r), L = len(cache) after the append. Bad input raises before anything is written."""
        self.stage(latent, rope_keys).commit()
        return self.latent, self.rope_keys


# --------------------------------------------------------------------------- the layer


def _real(name: str, value: object, expected: str, fix: str) -> float:
    """A positive finite real number (not bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad_argument(name, expected, describe(value), fix, kind=TypeError)
    if not math.isfinite(value) or value <= 0:
        raise bad_argument(name, expected, value, fix)
    return float(value)


def _even(name: str, value: object) -> int:
    size = positive_int(name, value)
    if size % 2:
        raise bad_argument(name, "a positive even int (rotary turns pairs)", size, f"use an even size, e.g. {size + 1}")
    return size


class LatentAttention(HeadSurgery, nn.Module):
    """Multi-head Latent Attention over batch-first inputs (b, i, hidden_size): transformers'
    ``DeepseekV3Attention`` (the same module names and weights), with its attention run by :class:`Attend`.

    Head surgery (``head_gate``, ``ablate_heads``) is :class:`multihead.heads.HeadSurgery`'s. Zero, uniform and a
    gate act the same on the plain and the absorbed call (W^UV is linear); a mean of values (e) has no latent (c)
    counterpart, so a layer with a mean ablation runs the plain call.

    Args:
        hidden_size: input and output features.
        num_heads: query heads h (every head has its own key and value, made from the shared latent).
        kv_lora_rank: c, the size of the latent c_kv each token keeps in a :class:`LatentCache`.
        qk_nope_head_dim: dn, the part of each query and key without rotary.
        qk_rope_head_dim: r (even), the rotary part of each query, and of the one key part all heads share.
        v_head_dim: e, each head's value size.
        q_lora_rank: the query's low rank (q_a_proj -> q_a_layernorm -> q_b_proj), or None for one q_proj.
        bias: biases on q_a_proj, kv_a_proj_with_mqa and o_proj (transformers' ``attention_bias``; q_proj,
            q_b_proj and kv_b_proj never have one).
        rope_base: the rotary wavelength base (``rope_theta``); rotary of the default kind only (no yarn or other
            scaling: :meth:`from_transformers` refuses those).
        rope_interleave: True (DeepSeek's layout, transformers' default ``rope_interleave``): the rotary part
            turns the pairs (x[2m], x[2m + 1]); False: the pairs (x[m], x[m + r/2]).
        norm_eps: the epsilon of the two RMSNorms (transformers builds them with its default 1e-6).
        scale: the softmax scale, default 1 / sqrt(dn + r).
        dropout: dropout on the attention weights, in training mode only.
        backend: the attention kernel, "auto" or a registered name (see :func:`multihead.explain`).

    Example:
        >>> layer = LatentAttention(64, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
        >>> x = torch.randn(2, 5, 64)                                  # (b, i, hidden_size)
        >>> cache = layer.new_cache(batch_size=2, max_len=8)
        >>> out, _ = layer(x, causal=True, cache=cache)                # prompt: the latents go in the cache
        >>> step, _ = layer(torch.randn(2, 1, 64), causal=True, cache=cache)   # one more token, absorbed
        >>> out.shape, step.shape, cache.storage.shape                 # (b, 1, max_len, c + r) cached
        (torch.Size([2, 5, 64]), torch.Size([2, 1, 64]), torch.Size([2, 1, 8, 20]))
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        rope_base: float = 10000.0,
        rope_interleave: bool = True,
        norm_eps: float = 1e-6,
        scale: float | None = None,
        dropout: float = 0.0,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.hidden_size = positive_int("hidden_size", hidden_size)
        self.num_heads = positive_int("num_heads", num_heads)
        self.kv_lora_rank = positive_int("kv_lora_rank", kv_lora_rank)
        self.qk_nope_head_dim = positive_int("qk_nope_head_dim", qk_nope_head_dim)
        self.qk_rope_head_dim = _even("qk_rope_head_dim", qk_rope_head_dim)
        self.v_head_dim = positive_int("v_head_dim", v_head_dim)
        self.value_head_dim = self.v_head_dim  # the name head surgery reads (HeadSurgery, as MultiHeadAttention's)
        self.q_lora_rank = None if q_lora_rank is None else positive_int("q_lora_rank", q_lora_rank)
        self.rope_interleave = checked_flag("rope_interleave", rope_interleave)
        checked_flag("bias", bias)
        base = _real("rope_base", rope_base, "a positive finite float", "pass e.g. rope_base=10000.0")
        eps = _real("norm_eps", norm_eps, "a positive finite float", "pass e.g. norm_eps=1e-6")
        # the softmax scale: 1 / sqrt(dn + r) unless given
        self.scale = (
            self.qk_head_dim**-0.5
            if scale is None
            else _real("scale", scale, "a positive finite float or None", "drop scale=")
        )
        checked_probability("dropout", dropout)
        if not isinstance(backend, str):
            raise bad_argument(
                "backend", "a backend name (str)", describe(backend), "pass backend='auto'", kind=TypeError
            )
        if backend != "auto":
            registry.get_backend(backend)  # raises with the list of names
        self.attend: Attend = Attend(float(dropout), backend)  # every attention of the layer: hooks, gates, ablations
        self.rotary = RotaryEmbedding(self.qk_rope_head_dim, base)  # DeepSeek's frequencies: base^(-2m/r)
        self._build(bias, float(eps), usable_device("device", device), floating_dtype("dtype", dtype))
        self.reset_parameters()

    @property
    def qk_head_dim(self) -> int:
        """dn + r: the size of each head's query and key in the plain call."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_kv_heads(self) -> int:
        """g of the plain call: h, every head its own key and value (the absorbed call has g = 1)."""
        return self.num_heads

    def _build(self, bias: bool, eps: float, device: torch.device | None, dtype: torch.dtype | None) -> None:
        """The projections, with transformers' names and shapes (nn.Linear weights are (out, in))."""
        hidden, h, c, r = self.hidden_size, self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        dn, e, q_rank = self.qk_nope_head_dim, self.v_head_dim, self.q_lora_rank
        q_weights = hidden * h * (dn + r) if q_rank is None else q_rank * (hidden + h * (dn + r))
        weights = q_weights + hidden * (c + r) + c * h * (dn + e) + h * e * hidden
        fix = "use smaller sizes (hidden_size, num_heads, the ranks and head dims)"
        check_fits("hidden_size", (weights,), dtype or torch.get_default_dtype(), device, fix, what="the weights")
        options: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: nn.RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if q_rank is None:
            self.q_proj = nn.Linear(hidden, h * (dn + r), bias=False, **options)  # W^Q of every head, stacked
        else:
            self.q_a_proj = nn.Linear(hidden, q_rank, bias=bias, **options)  # W^DQ
            self.q_a_layernorm = nn.RMSNorm(q_rank, eps=eps, **options)
            self.q_b_proj = nn.Linear(q_rank, h * (dn + r), bias=False, **options)  # W^UQ
        self.kv_a_proj_with_mqa = nn.Linear(hidden, c + r, bias=bias, **options)  # W^DKV: [c_kv, k_pe]
        self.kv_a_layernorm = nn.RMSNorm(c, eps=eps, **options)
        self.kv_b_proj = nn.Linear(c, h * (dn + e), bias=False, **options)  # W^UKV: per head [W^UK (dn), W^UV (e)]
        self.o_proj = nn.Linear(h * e, hidden, bias=bias, **options)  # W^O

    def reset_parameters(self) -> None:
        """Xavier-uniform projection weights, zero biases, unit norm weights."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.RMSNorm):
                module.reset_parameters()

    def extra_repr(self) -> str:
        parts = [
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}",
            f"q_lora_rank={self.q_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}",
            f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}",
        ]
        if not self.rope_interleave:
            parts.append("rope_interleave=False")
        if self.attend.dropout:
            parts.append(f"dropout={self.attend.dropout}")
        return ", ".join(parts)

    def config(self) -> dict:
        """The constructor arguments that rebuild this layer: ``LatentAttention(**layer.config())``."""
        norm = self.kv_a_layernorm
        return {
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "bias": self.o_proj.bias is not None,
            "rope_base": self.rotary.base,
            "rope_interleave": self.rope_interleave,
            "norm_eps": norm.eps,
            "scale": self.scale,
            "dropout": self.attend.dropout,
            "backend": self.attend.backend,
        }

    @classmethod
    def from_transformers(cls, module: nn.Module) -> LatentAttention:
        """This layer with the weights of a transformers ``DeepseekV3Attention`` (read by its attributes and its
        ``config``; transformers itself is not imported). Rotary of the default kind only: a config with
        ``rope_parameters`` of another type (DeepSeek-V3's released yarn) is refused, not run differently."""
        source: Any = module  # read by name: another library's module
        config = getattr(source, "config", None)
        sizes = ("hidden_size", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
        names = (*sizes, "v_head_dim", "scaling", "o_proj", "kv_a_layernorm", "kv_b_proj")
        if not isinstance(module, nn.Module) or config is None or not all(hasattr(source, n) for n in names):
            raise bad_argument(
                "module",
                "a transformers DeepseekV3Attention (an MLA module with its config)",
                describe(module),
                "pass model.model.layers[n].self_attn of a DeepSeek-V3 model",
                kind=TypeError,
            )
        rope = dict(getattr(config, "rope_parameters", None) or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise bad_argument(
                "module",
                "rotary of the default kind (rope_type 'default')",
                f"rope_type {kind!r}",
                "use a config without rope scaling; LatentAttention has no yarn frequencies yet",
            )
        if getattr(config, "num_key_value_heads", source.num_heads) != source.num_heads:
            raise bad_argument(
                "module",
                f"num_key_value_heads = num_attention_heads = {source.num_heads} (MLA expands every head's key)",
                config.num_key_value_heads,
                "set num_key_value_heads to num_attention_heads in the config",
            )
        weight = source.o_proj.weight
        layer = cls(
            source.hidden_size,
            source.num_heads,
            kv_lora_rank=source.kv_lora_rank,
            qk_nope_head_dim=source.qk_nope_head_dim,
            qk_rope_head_dim=source.qk_rope_head_dim,
            v_head_dim=source.v_head_dim,
            q_lora_rank=source.q_lora_rank,
            bias=source.o_proj.bias is not None,
            rope_base=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
            rope_interleave=bool(getattr(config, "rope_interleave", True)),
            norm_eps=source.kv_a_layernorm.variance_epsilon,
            scale=float(source.scaling),
            dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
            device=weight.device,
            dtype=weight.dtype,
        )
        layer.load_state_dict(module.state_dict())
        return layer

    # ----------------------------------------------------------------------- forward

    def new_cache(self, batch_size: int, max_len: int) -> LatentCache:
        """A :class:`LatentCache` for this layer: storage (b, 1, max_len, c + r) in the layer's dtype and device."""
        weight = self.kv_a_proj_with_mqa.weight
        return LatentCache(
            batch_size, max_len, self.kv_lora_rank, self.qk_rope_head_dim, dtype=weight.dtype, device=weight.device
        )

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: Mask | torch.Tensor | None = None,
        causal: bool = False,
        need_weights: bool = False,
        cache: LatentCache | None = None,
        positions: torch.Tensor | None = None,
        absorb: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Self-attention of ``x`` (with the tokens of ``cache`` before it).

        Args:
            x: (b, i, hidden_size).
            mask: typed mask or tensor broadcastable to (b, h, i, j) over every key attended (the cached ones
                included). True = may attend.
            causal: causal mask aligned bottom-right: with j keys (held and new) and i new queries, query q sees
                keys 0 .. j - i + q. For i = 2, j = 5 (3 tokens held)::

                    keys     0 1 2 3 4
                    query 0  x x x x .
                    query 1  x x x x x

            need_weights: also return the attention weights (b, h, i, j) (the same on both calls). Never changes
                the output.
            cache: a :class:`LatentCache` (:meth:`new_cache`): this call's latents and rotated keys are appended
                and the queries attend over every token held.
            positions: absolute positions of the new tokens for rotary, (i,) or (b, i); default
                ``len(cache) + arange(i)`` with a cache, ``arange(i)`` without.
            absorb: True: the absorbed call (multi-query attention over the latent); False: the plain call
                (per-head keys and values). None (default): absorbed with a cache, plain without. With a cache,
                the absorbed call reads the held latents in place, where the plain one would expand every held
                token through kv_b_proj at every step, h (dn + e) numbers each (what the latent cache saves),
                which is DeepSeek's decoding. Without one (training, scoring a sequence, prefill), the plain call
                attends over dn + r numbers per key instead of c + r (fewer multiply-adds in all from
                i ~ c (dn + e) / (2c - dn - e) on: 171 tokens at DeepSeek-V3's sizes) and its per-head q, k, v
                are what capture records. A mean ablation always runs the plain call.

        Returns:
            (output (b, i, hidden_size), weights (b, h, i, j) or None)
        """
        absorbed = self._check_call(x, causal, need_weights, cache, positions, absorb)
        b, i = x.shape[:2]
        q_nope, q_pe = self._queries(x)  # (b, h, i, dn), (b, h, i, r)
        latent, k_pe = self._latents(x)  # (b, i, c), (b, i, r)
        where = positions if positions is not None else (0 if cache is None else len(cache))
        # the tables grow only once the call has succeeded (below): a failed call leaves them as they were
        q_pe = self._rope(q_pe, where)
        k_pe = self._rope(k_pe[:, None], where)[:, 0]  # (b, i, r), as one key head
        if cache is None:
            pending, keys = None, torch.cat((latent, k_pe), dim=-1)[:, None]  # (b, 1, i, c + r)
        else:  # staged, not appended: the tokens count once the whole call has succeeded (commit below)
            pending = cache.stage(latent, k_pe)
            keys = pending.keys  # (b, 1, j, c + r): every token held, then these
        if absorbed:
            heads, weights = self._attend_absorbed(q_nope, q_pe, keys, mask, causal, need_weights)
        else:
            heads, weights = self._attend_plain(q_nope, q_pe, keys, mask, causal, need_weights)
        out = self.o_proj(heads.transpose(1, 2).reshape(b, i, self.num_heads * self.v_head_dim))  # heads, then W^O
        if isinstance(where, int):
            self.rotary.reserve(where + i, q_pe)
        if pending is not None:
            pending.commit()
        return out, weights

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope (b, h, i, dn) and q_pe (b, h, i, r), before rotary."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        b, i = x.shape[:2]
        q = q.view(b, i, self.num_heads, self.qk_head_dim).transpose(1, 2)  # (b, h, i, dn + r)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return q_nope, q_pe

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent c_kv (b, i, c), normalised, and the shared key k_pe (b, i, r), before rotary."""
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(latent), k_pe

    def _rope(self, x: torch.Tensor, where: int | torch.Tensor) -> torch.Tensor:
        """Rotary on x (b, heads, i, r) at ``where`` (an offset, or positions (i,) or (b, i)).

        DeepSeek's interleaved layout turns the pairs (x[2m], x[2m + 1]) by pos * base^(-2m/r) and writes the
        results as halves, [x[2m] cos - x[2m+1] sin ..., x[2m+1] cos + x[2m] sin ...] (transformers'
        ``apply_rotary_pos_emb_interleave``). That is :class:`RotaryEmbedding`'s rotate-half layout, pairs
        (y[m], y[m + r/2]), applied to y = [x[0::2], x[1::2]]: reordering the input is all it takes, so the
        rotary tables are ours. The keys are cached in that rotated order, as transformers caches them.
        """
        if self.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)  # (b, heads, i, r): even features, then odd
        return self.rotary.rotate(x, where, grow=False)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W^UK (h, dn, c) and W^UV (h, e, c): kv_b_proj's weight (h (dn + e), c), head by head."""
        h, dn, c = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
        per_head = self.kv_b_proj.weight.view(h, dn + self.v_head_dim, c)  # (h, dn + e, c)
        return per_head[:, :dn], per_head[:, dn:]

    def _attend_plain(self, q_nope, q_pe, keys, mask, causal, need_weights):
        """Per-head keys and values from the latents keys[..., :c] (b, 1, j, c): multi-head attention (g = h).
        Returns each head's output (b, h, i, e) and the weights (b, h, i, j) or None."""
        b, h, _, _ = q_nope.shape
        j, c, r = keys.shape[2], self.kv_lora_rank, self.qk_rope_head_dim
        kv = self.kv_b_proj(keys[:, 0, :, :c])  # (b, j, h (dn + e))
        kv = kv.view(b, j, h, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)  # (b, h, j, dn + e)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # (b, h, j, dn), (b, h, j, e)
        k = torch.cat((k_nope, keys[:, :, :, c:].expand(b, h, j, r)), dim=-1)  # (b, h, j, dn + r)
        q = torch.cat((q_nope, q_pe), dim=-1)  # (b, h, i, dn + r)
        result = self.attend(q, k, v, mask=mask, causal=causal, scale=self.scale, return_weights=need_weights)
        return result.output, result.weights

    def _attend_absorbed(self, q_nope, q_pe, keys, mask, causal, need_weights):
        """W^UK folded into the query, W^UV into the output: multi-query attention (g = 1) over the latents, key
        keys (b, 1, j, c + r) and value keys[..., :c] (b, 1, j, c). Returns each head's output (b, h, i, e) and
        the weights (b, h, i, j) or None."""
        w_uk, w_uv = self._up_weights()  # (h, dn, c), (h, e, c)
        q_latent = torch.einsum("bhid,hdc->bhic", q_nope, w_uk)  # (b, h, i, c): W^UK^T q_nope, per head
        q = torch.cat((q_latent, q_pe), dim=-1)  # (b, h, i, c + r)
        values = keys[..., : self.kv_lora_rank]  # (b, 1, j, c): the latents themselves
        result = self.attend(q, keys, values, mask=mask, causal=causal, scale=self.scale, return_weights=need_weights)
        out = torch.einsum("bhic,hec->bhie", result.output, w_uv)  # (b, h, i, e): W^UV per head
        return out, result.weights

    # ----------------------------------------------------------------------- checks

    def _check_call(self, x, causal, need_weights, cache, positions, absorb) -> bool:
        """Every check of a call before the first matmul; returns whether it runs the absorbed call."""
        x = tensor_argument("x", x)
        weight = self.o_proj.weight
        like_parameters("x", x, weight, "the layer's parameters", autocast=autocast_on(x.device))
        if x.ndim != 3 or x.shape[-1] != self.hidden_size or x.shape[0] == 0 or x.shape[1] == 0:
            raise bad_argument(
                "x",
                f"shape (b, i, {self.hidden_size}) with b, i >= 1",
                f"shape {tuple(x.shape)}",
                f"pass batch-first input whose last dim is hidden_size = {self.hidden_size}",
            )
        for name, switch in (("causal", causal), ("need_weights", need_weights)):
            checked_flag(name, switch)
        if absorb is not None:
            checked_flag("absorb", absorb)
        mean_ablation = self.head_ablation is not None and self.head_ablation.how == "mean"
        if absorb is True and mean_ablation:
            raise bad_argument(
                "absorb",
                "False or None with a mean ablation (a mean of values has no latent counterpart)",
                True,
                "pass absorb=False (or None), or ablate with how='zero' or 'uniform'",
            )
        b, i = x.shape[:2]
        if cache is not None:
            self._check_cache(cache, x, b, i)
        if positions is not None:
            check_positions(positions, b, i)
        if absorb is None:
            return cache is not None and not mean_ablation
        return absorb

    def _check_cache(self, cache: object, x: torch.Tensor, b: int, i: int) -> None:
        if not isinstance(cache, LatentCache):
            raise bad_argument(
                "cache",
                "a multihead.LatentCache (layer.new_cache(batch_size, max_len))",
                describe(cache),
                "build one with layer.new_cache(batch_size, max_len)",
                kind=TypeError,
            )
        # the projections' dtype: autocast's for float32 and half inputs (it leaves float64 alone)
        autocast = autocast_on(x.device) and x.dtype != torch.float64
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        cache.check_compatible(b, self.kv_lora_rank, self.qk_rope_head_dim, dtype, x.device)
        cache.check_room(i)
