"""``MultiHeadAttention``: projections, attention per head, concatenation, output projection.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,   head_n = attention(Q W_n^Q, K W_n^K, V W_n^V)

Each projection is one matrix for all heads: W^Q (h*d, embed_dim), W^K (g*d, kdim),
W^V (g*e, vdim), W^O (out_dim, h*e). With the defaults, d = e = embed_dim / h,
g = h and out_dim = embed_dim: the classic layer, 4 * embed_dim^2 weights.

Options of recent models, each equal to the transformers module that ships it with the same weights copied in
(tests/lab/test_layer_options_hf.py): ``qk_norm`` (Qwen3's per-head RMSNorm of q and k), ``output_gate`` (Qwen3-Next's
sigmoid gate on each head's output), ``rotary_dim`` (partial rotary, Qwen3-Next's partial_rotary_factor) and
``sinks`` (gpt-oss's learned sink logit per head).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
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
from multihead._symbolic import surely
from multihead.attend import Attend
from multihead.backends import registry
from multihead.cache import KVCache, PendingAppend
from multihead.functional import AttentionResult, autocast_on
from multihead.heads import HeadSurgery, prune_layer
from multihead.masks import Mask, as_mask, host_readable, window
from multihead.paged import PagedBatch, PagedKVCache, PagedPending
from multihead.positional import RotaryEmbedding, check_positions


def _size(name: str, value: object, *, default: int | None = None) -> int:
    """A positive int option (None takes the default)."""
    if value is None and default is not None:
        return default
    return positive_int(name, value)


# Self-attention stacks W^Q, W^K, W^V for one matmul only from this many rows (b * i) on: the stack copies the
# three weights on every call (a cached one could not see updates made through .data), which costs more than the
# products on short calls. Measured on this project's AMD EPYC (2 threads, float32, embed 512): one row (a decode
# step) 308 us stacked against 53 us for three matmuls, 64 rows 921 against 598, 512 rows 3.84 ms both, 2048 rows
# 15.5 ms both; at embed 64 the stack was 3-4% faster from 2048 rows on
FUSED_QKV_MIN_ROWS = 2048

# output_gate's kinds: one gate logit per head, or one per output element of each head
OUTPUT_GATES = ("headwise", "elementwise")
QK_NORM_EPS = 1e-6  # transformers' default rms_norm_eps (Qwen3, Qwen3-Next, Gemma 3)


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's d values with a learned weight (d,) initialised to ones (Qwen3's q_norm/k_norm)::

        y = x / sqrt(mean(x^2 over d) + eps) * weight

    This is the plain-weight convention of Qwen3 (and OLMo 2/3, though their norm spans all h*d values of a token
    at once, which a per-head norm does not reproduce). Gemma 3 and Qwen3-Next store the weight as an offset from 1
    (``x_normed * (1 + w)``, w initialised to zeros): load theirs as ``weight = w + 1``. Computed in float32 for
    half-precision inputs (float64 stays float64), cast back to x's dtype, then scaled, as Qwen3RMSNorm does.

    Args:
        head_dim: d. eps: added to the mean square (transformers' default 1e-6).
    """

    def __init__(
        self, head_dim: int, eps: float, *, device: torch.device | None = None, dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))  # (d,)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., d) -> (..., d) in x's dtype: q (b, h, i, d) or k (b, g, j, d)."""
        xt = x if x.dtype == torch.float64 else x.float()
        normed = xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., d)
        return normed.to(x.dtype) * self.weight.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def _norm_eps(qk_norm: object, qk_norm_eps: object) -> float | None:
    """The qk_norm epsilon (None without qk_norm), checked: a positive finite float, given only with qk_norm."""
    checked_flag("qk_norm", qk_norm)
    if qk_norm_eps is None:
        return QK_NORM_EPS if qk_norm else None
    if not qk_norm:
        raise bad_argument(
            "qk_norm_eps", "None unless qk_norm=True", describe(qk_norm_eps), "pass qk_norm=True, or drop qk_norm_eps"
        )
    expected = "a positive finite float (added to the mean square)"
    if isinstance(qk_norm_eps, bool) or not isinstance(qk_norm_eps, numbers.Real):
        raise bad_argument("qk_norm_eps", expected, describe(qk_norm_eps), "pass e.g. qk_norm_eps=1e-6", kind=TypeError)
    if not math.isfinite(qk_norm_eps) or qk_norm_eps <= 0:
        raise bad_argument("qk_norm_eps", expected, qk_norm_eps, "pass e.g. qk_norm_eps=1e-6")
    return float(qk_norm_eps)


def _gate_kind(output_gate: object) -> str | None:
    """output_gate checked: None, "headwise" or "elementwise"."""
    expected = 'None, "headwise" or "elementwise"'
    if output_gate is not None and not isinstance(output_gate, str):
        raise bad_argument(
            "output_gate", expected, describe(output_gate), 'pass output_gate="elementwise"', kind=TypeError
        )
    if output_gate is not None and output_gate not in OUTPUT_GATES:
        raise bad_argument("output_gate", expected, repr(output_gate), 'pass output_gate="headwise" or "elementwise"')
    return output_gate


# what from_torch reads of a torch-layout module (torch.nn.MultiheadAttention, multihead.compat.MultiheadAttention)
_TORCH_LAYOUT = (
    "embed_dim",
    "num_heads",
    "kdim",
    "vdim",
    "dropout",
    "_qkv_same_embed_dim",
    "in_proj_bias",
    "out_proj",
    "bias_k",
    "add_zero_attn",
)


class SequenceSplitLike(Protocol):
    """What the layer asks of a sequence split across ranks (:class:`multihead.parallel.sequence.SequenceSplit`):
    the global positions of this rank's shard (for rotary), and the kernel ``Attend`` runs in place of the
    one-process one (with :func:`multihead.attention_result`'s arguments; it refuses those it cannot serve)."""

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """(length,) the global positions of this rank's ``length`` positions."""
        ...

    @property
    def __call__(self) -> Callable[..., AttentionResult]:
        """(q, k, v, **attention_result's keywords) -> AttentionResult (a property: any signature matches)."""
        ...


class MultiHeadAttention(HeadSurgery, nn.Module):
    """Multi-head attention over batch-first inputs (b, seq, features).

    Args:
        embed_dim: query feature size (and the default output size).
        num_heads: query heads h.
        kdim, vdim: key and value input sizes for cross-attention from another model (default embed_dim).
        head_dim: query/key size per head d (default embed_dim / num_heads; need not divide embed_dim).
        value_head_dim: value size per head e (default head_dim).
        out_dim: output size (default embed_dim).
        num_kv_heads: key/value heads g (default h); h % g == 0. g < h is grouped-query attention,
            g == 1 multi-query.
        bias: biases on all four projections.
        dropout: dropout on the attention weights, in training mode only.
        rotary: True (or a :class:`RotaryEmbedding` of size head_dim, or of size rotary_dim) to rotate queries
            and keys by position (self-attention only).
        qk_norm: RMS-normalise each head's query and key over d after the projections and before rotary, each with
            a learned weight (d,) initialised to ones: parameters ``q_norm.weight`` and ``k_norm.weight``, Qwen3's
            q_norm/k_norm (see :class:`HeadRMSNorm`; Gemma 3 / Qwen3-Next's (1 + w) weights load as w + 1).
        qk_norm_eps: the norm's epsilon (default 1e-6, transformers' default); only with qk_norm.
        output_gate: "elementwise" or "headwise": W^Q also produces, per head, e gate logits (one per output
            element) or 1 (one per head), and each head's output is multiplied by sigmoid(gate) before W^O
            (Qwen3-Next's gated attention). q_proj then has h * (d + c) rows, c = e or 1, laid out per head:
            head n's d query rows, then its c gate rows (Qwen3-Next's q_proj layout: view(..., h, 2d), chunk).
            The gate acts after the attention step: weights, captured outputs, head gates and ablations are the
            ungated ones.
        rotary_dim: partial rotary: rotate only the first rotary_dim of each head's d query/key dims (even,
            <= head_dim; frequencies base^(-2m/rotary_dim) over them), the rest pass through unrotated, as
            Qwen3-Next's partial_rotary_factor (rotary_dim = d * factor). Needs rotary. (Gemma 4's "proportional"
            RoPE is another layout: pairs (m, m + d/2) with frequencies over the whole d.)
        sinks: a learned sink logit per query head, parameter ``sinks`` (h,) initialised to 0, which joins every
            row's softmax and is dropped (gpt-oss's sinks; :func:`multihead.attention`'s ``sinks=``): rows then
            sum to less than 1, the rest on a zero value.
        backend: attention kernel, "auto" or a registered name (see :func:`multihead.explain`).

    Example:
        >>> layer = multihead.MultiHeadAttention(64, 8, num_kv_heads=2, rotary=True)
        >>> x = torch.randn(3, 10, 64)                       # (b, i, embed_dim)
        >>> out, weights = layer(x, causal=True, need_weights=True)
        >>> out.shape, weights.shape                         # (b, i, out_dim), (b, h, i, j)
        (torch.Size([3, 10, 64]), torch.Size([3, 8, 10, 10]))
    """

    sinks: nn.Parameter | None  # (h,) learned sink logits, registered as a parameter when asked for

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        head_dim: int | None = None,
        value_head_dim: int | None = None,
        out_dim: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        rotary: bool | RotaryEmbedding | None = None,
        qk_norm: bool = False,
        qk_norm_eps: float | None = None,
        output_gate: str | None = None,
        rotary_dim: int | None = None,
        sinks: bool = False,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.embed_dim = _size("embed_dim", embed_dim)
        self.num_heads = _size("num_heads", num_heads)
        if head_dim is None and embed_dim % num_heads != 0:
            raise bad_argument(
                "num_heads",
                f"a divisor of embed_dim = {embed_dim}",
                num_heads,
                "pick num_heads that divides embed_dim, or pass head_dim explicitly",
            )
        self.head_dim = _size("head_dim", head_dim, default=embed_dim // num_heads)
        self.value_head_dim = _size("value_head_dim", value_head_dim, default=self.head_dim)
        self.num_kv_heads = _size("num_kv_heads", num_kv_heads, default=num_heads)
        if num_heads % self.num_kv_heads != 0:
            divisors = [n for n in range(1, num_heads + 1) if num_heads % n == 0]
            raise bad_argument(
                "num_kv_heads", f"a divisor of num_heads = {num_heads}", self.num_kv_heads, f"use one of {divisors}"
            )
        self.kdim = _size("kdim", kdim, default=embed_dim)
        self.vdim = _size("vdim", vdim, default=embed_dim)
        self.out_dim = _size("out_dim", out_dim, default=embed_dim)
        checked_flag("bias", bias)
        checked_probability("dropout", dropout)
        if not isinstance(backend, str):
            raise bad_argument(
                "backend", "a backend name (str)", describe(backend), "pass e.g. backend='auto'", kind=TypeError
            )
        if backend != "auto":
            registry.get_backend(backend)  # raises with the list of names
        # the attention step: holds dropout, backend and head surgery (HeadSurgery's properties)
        self.attend: Attend = Attend(float(dropout), backend)
        # None: the layer attends over the keys it is given; a split (set by multihead.parallel.ContextParallel): its
        # input is this rank's shard of a sequence split across ranks, attended over the whole sequence
        self.sequence_split: SequenceSplitLike | None = None
        eps, self.output_gate = _norm_eps(qk_norm, qk_norm_eps), _gate_kind(output_gate)
        self.rotary = self._rotary(rotary, rotary_dim)
        checked_flag("sinks", sinks)
        device, dtype = usable_device("device", device), floating_dtype("dtype", dtype)
        h, g, d, e = self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim
        c = {None: 0, "headwise": 1, "elementwise": e}[self.output_gate]  # gate logits per head
        weights = h * (d + c) * self.embed_dim + g * d * self.kdim + g * e * self.vdim + self.out_dim * h * e
        check_fits(
            "embed_dim",
            (weights,),
            dtype or torch.get_default_dtype(),
            device,
            "use smaller sizes (embed_dim, num_heads, head_dim, kdim, vdim, out_dim)",
            what="the projection weights",
        )
        # W^Q of every head, stacked; with an output gate each head's d rows are followed by its c gate rows
        self.q_proj = nn.Linear(embed_dim, h * (d + c), bias=bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(self.kdim, g * d, bias=bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(self.vdim, g * e, bias=bias, device=device, dtype=dtype)
        self.out_proj = nn.Linear(h * e, self.out_dim, bias=bias, device=device, dtype=dtype)
        # (d,) weights shared by the heads, or None; (h,) sink logits, or None (not in the state dict then)
        self.q_norm = None if eps is None else HeadRMSNorm(d, eps, device=device, dtype=dtype)
        self.k_norm = None if eps is None else HeadRMSNorm(d, eps, device=device, dtype=dtype)
        self.register_parameter("sinks", nn.Parameter(torch.empty(h, device=device, dtype=dtype)) if sinks else None)
        self.reset_parameters()

    def _rotary(self, rotary: bool | RotaryEmbedding | None, rotary_dim: int | None) -> RotaryEmbedding | None:
        """The rotary embedding (None without), of size rotary_dim (partial) or head_dim."""
        if rotary is not None and not isinstance(rotary, (bool, RotaryEmbedding)):
            raise bad_argument(
                "rotary",
                "True, False/None or a multihead.positional.RotaryEmbedding",
                describe(rotary),
                "pass rotary=True",
                kind=TypeError,
            )
        if rotary is None or rotary is False:
            if rotary_dim is not None:
                raise bad_argument(
                    "rotary_dim",
                    "None without rotary positions (rotary_dim is the part of each head that rotary rotates)",
                    describe(rotary_dim),
                    "pass rotary=True too, or drop rotary_dim",
                )
            return None
        size = self.head_dim if rotary_dim is None else self._rotary_size(rotary_dim)
        if rotary is True:
            return RotaryEmbedding(size)
        if rotary.head_dim != size:
            partial = rotary.head_dim < self.head_dim
            raise bad_argument(
                "rotary",
                f"a RotaryEmbedding of head_dim = {size} ({'rotary_dim' if rotary_dim else 'the head_dim'})",
                f"one of head_dim = {rotary.head_dim}",
                f"use RotaryEmbedding({size})" + (f", or pass rotary_dim={rotary.head_dim}" if partial else ""),
            )
        return rotary

    def _rotary_size(self, rotary_dim: object) -> int:
        """rotary_dim checked: a positive even int, at most head_dim."""
        size = positive_int("rotary_dim", rotary_dim)
        if size % 2 or size > self.head_dim:
            raise bad_argument(
                "rotary_dim",
                f"an even int <= head_dim = {self.head_dim} (rotary turns pairs of dims)",
                size,
                f"pass an even rotary_dim up to {self.head_dim}, e.g. {max(2, min(size - size % 2, self.head_dim))}",
            )
        return size

    @property
    def rotary_dim(self) -> int | None:
        """The dims of each head that rotary rotates (the first ones): head_dim, fewer when partial, None without
        rotary."""
        return None if self.rotary is None else self.rotary.head_dim

    @property
    def qk_norm_eps(self) -> float | None:
        """The epsilon of the query/key RMSNorm, or None without ``qk_norm``."""
        return None if self.q_norm is None else self.q_norm.eps

    @property
    def dropout(self) -> float:
        """Dropout probability on the attention weights (training mode only)."""
        return self.attend.dropout

    @dropout.setter
    def dropout(self, value: float) -> None:
        self.attend.dropout = value

    @property
    def backend(self) -> str:
        """Attention kernel name, "auto" or a registered backend."""
        return self.attend.backend

    @backend.setter
    def backend(self, value: str) -> None:
        self.attend.backend = value

    def config(self) -> dict:
        """The constructor arguments that rebuild this layer's shape: ``MultiHeadAttention(**layer.config())``
        then ``load_state_dict`` restores it (a pruned layer included)."""
        return {
            "embed_dim": self.embed_dim,
            "num_heads": self.num_heads,
            "kdim": self.kdim,
            "vdim": self.vdim,
            "head_dim": self.head_dim,
            "value_head_dim": self.value_head_dim,
            "out_dim": self.out_dim,
            "num_kv_heads": self.num_kv_heads,
            "bias": self.q_proj.bias is not None,
            "dropout": self.dropout,
            "rotary": self.rotary is not None,
            "qk_norm": self.q_norm is not None,
            "qk_norm_eps": self.qk_norm_eps,
            "output_gate": self.output_gate,
            "rotary_dim": self.rotary_dim if self.rotary_dim != self.head_dim else None,
            "sinks": self.sinks is not None,
            "backend": self.backend,
        }

    def prune_heads(self, heads: list[int] | int) -> list[int]:
        """Remove ``heads`` (W^Q/W^K/W^V rows with their gate rows, W^O columns, sink logits); returns the old
        indices of the heads kept.

        Same outputs as zero-ablating them, with proportionally less work. See :func:`multihead.heads.prune_layer`.
        """
        return prune_layer(self, heads)

    def reset_parameters(self) -> None:
        """Xavier-uniform projection weights and zero biases (torch.nn.MultiheadAttention's scheme); norm weights
        of ones and sink logits of zero."""
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        parts.append(f"head_dim={self.head_dim}")
        if self.value_head_dim != self.head_dim:
            parts.append(f"value_head_dim={self.value_head_dim}")
        if self.rotary_dim is not None and self.rotary_dim != self.head_dim:
            parts.append(f"rotary_dim={self.rotary_dim}")
        if self.output_gate is not None:
            parts.append(f"output_gate={self.output_gate!r}")
        if self.sinks is not None:
            parts.append("sinks=True")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)

    @classmethod
    def from_torch(cls, module: nn.Module) -> MultiHeadAttention:
        """This layer (batch first) with the weights of a ``torch.nn.MultiheadAttention``.

        Any module with torch's parameter layout is accepted (``multihead.compat.MultiheadAttention`` too);
        add_bias_kv and add_zero_attn have no equivalent here and are refused.
        """
        if not isinstance(module, nn.Module) or not all(hasattr(module, name) for name in _TORCH_LAYOUT):
            raise bad_argument(
                "module",
                "a torch.nn.MultiheadAttention",
                describe(module),
                "pass the torch module to convert",
                kind=TypeError,
            )
        if module.bias_k is not None or module.add_zero_attn:
            raise bad_argument(
                "module",
                "a module without add_bias_kv or add_zero_attn",
                "add_bias_kv" if module.bias_k is not None else "add_zero_attn",
                "use multihead.compat.MultiheadAttention, which supports them",
            )
        weight = module.out_proj.weight
        layer = cls(
            module.embed_dim,
            module.num_heads,
            kdim=module.kdim,
            vdim=module.vdim,
            bias=module.in_proj_bias is not None,
            dropout=module.dropout,
            device=weight.device,
            dtype=weight.dtype,
        )
        if module._qkv_same_embed_dim:
            projections = module.in_proj_weight.chunk(3)
        else:
            projections = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        biases = (None, None, None) if module.in_proj_bias is None else module.in_proj_bias.chunk(3)
        with torch.no_grad():
            for proj, w, b in zip((layer.q_proj, layer.k_proj, layer.v_proj), projections, biases, strict=True):
                proj.weight.copy_(w)
                if b is not None:
                    proj.bias.copy_(b)
            layer.out_proj.load_state_dict(module.out_proj.state_dict())
        return layer

    def to_torch(self) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention(batch_first=True)`` with these weights, where torch can express them
        (h = g heads of size embed_dim / h, out_dim = embed_dim, no rotary, qk_norm, output_gate or sinks)."""
        unsupported = []
        if self.num_kv_heads != self.num_heads:
            unsupported.append(f"num_kv_heads = {self.num_kv_heads} != num_heads")
        if self.head_dim * self.num_heads != self.embed_dim or self.value_head_dim != self.head_dim:
            unsupported.append("head sizes other than embed_dim / num_heads")
        if self.out_dim != self.embed_dim:
            unsupported.append(f"out_dim = {self.out_dim} != embed_dim")
        if self.rotary is not None:
            unsupported.append("rotary embedding")
        unsupported += [
            name
            for name, used in (("qk_norm", self.q_norm), ("output_gate", self.output_gate), ("sinks", self.sinks))
            if used is not None
        ]
        if unsupported:
            raise bad_argument(
                "layer",
                "a configuration torch.nn.MultiheadAttention can express",
                ", ".join(unsupported),
                "keep the layer in multihead, or build it with the classic options",
            )
        weight = self.out_proj.weight
        module = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=self.q_proj.bias is not None,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=True,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
            if module._qkv_same_embed_dim:
                module.in_proj_weight.copy_(torch.cat(weights))
            else:
                targets = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
                for target, w in zip(targets, weights, strict=True):
                    target.copy_(w)
            if module.in_proj_bias is not None:
                module.in_proj_bias.copy_(torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
            module.out_proj.load_state_dict(self.out_proj.state_dict())
        return module

    def new_paged_cache(self, num_pages: int, page_size: int = 16, *, window: int | None = None) -> PagedKVCache:
        """A :class:`~multihead.paged.PagedKVCache` for this layer: a pool of ``num_pages`` pages of
        ``page_size`` keys, (num_pages, g, page_size, d) keys and (num_pages, g, page_size, e) values."""
        weight = self.k_proj.weight
        return PagedKVCache(
            num_pages,
            page_size,
            self.num_kv_heads,
            self.head_dim,
            self.value_head_dim,
            window=window,
            dtype=weight.dtype,
            device=weight.device,
        )

    def new_cache(self, batch_size: int, max_len: int, *, window: int | None = None) -> KVCache:
        """A :class:`KVCache` shaped for this layer: (b, g, max_len, d) keys, (b, g, max_len, e) values."""
        weight = self.k_proj.weight
        return KVCache(
            batch_size,
            max_len,
            self.num_kv_heads,
            self.head_dim,
            self.value_head_dim,
            window=window,
            dtype=weight.dtype,
            device=weight.device,
        )

    # ----------------------------------------------------------------------- forward

    def _check_input(self, name: str, x: object, features: int, like: torch.Tensor | None) -> None:
        """x is (b, seq, features) with b, seq >= 1, on the layer's device, in the dtype the call computes in:
        the layer's (any floating dtype under autocast), and the query's for key and value."""
        x = tensor_argument(name, x)
        if like is None:  # the query: checked against the layer's parameters
            weight = self.out_proj.weight
            like_parameters(name, x, weight, "the layer's parameters", autocast=autocast_on(x.device))
        else:
            matching(name, x, like, "the query", fix=f"convert with {name}.to(query)")
        if x.ndim != 3 or x.shape[-1] != features:
            raise bad_argument(
                name,
                f"shape (b, seq, {features})",
                f"shape {tuple(x.shape)}",
                f"pass batch-first input whose last dim is {features}",
            )
        if like is not None and x.shape[0] != like.shape[0]:
            raise bad_argument(
                name,
                f"batch size {like.shape[0]} (from query)",
                x.shape[0],
                "give query, key and value the same batch size",
            )
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise bad_argument(
                name,
                "at least one batch row and one position",
                f"shape {tuple(x.shape)}",
                "drop empty batches and sequences before calling the layer",
            )

    def _project(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None):
        """q (b, i, h*(d + c)), k (b, j, g*d), v (b, j, g*e): one fused matmul for self-attention of at least
        FUSED_QKV_MIN_ROWS rows, else three."""
        # surely: for a traced length (torch.compile, torch.export) the three matmuls, with no guard
        if key is None and surely(query.shape[0] * query.shape[1] >= FUSED_QKV_MIN_ROWS):
            weight, bias = self._fused_qkv()
            return F.linear(query, weight, bias).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], dim=-1
            )
        key = query if key is None else key
        return self.q_proj(query), self.k_proj(key), self.v_proj(key if value is None else value)

    def _heads(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None):
        """Per head: q (b, h, i, d), the output gate's logits (b, h, i, c) (c = 1 headwise, e elementwise) or None,
        k (b, g, j, d), v (b, g, j, e); q and k RMS-normed over d with ``qk_norm`` (before rotary, as Qwen3)."""
        (b, i), h, g, d, e = query.shape[:2], self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim
        q, k, v = self._project(query, key, value)
        q = q.view(b, i, h, -1).transpose(1, 2)  # (b, h, i, d + c): each head's query, then its gate logits
        gate = None if self.output_gate is None else q[..., d:]  # (b, h, i, c)
        q = q[..., :d]  # (b, h, i, d)
        k = k.view(b, -1, g, d).transpose(1, 2)  # (b, g, j, d)
        v = v.view(b, -1, g, e).transpose(1, 2)  # (b, g, j, e)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, gate, k, v

    def _rotate(self, x: torch.Tensor, where: int | torch.Tensor) -> torch.Tensor:
        """x (b, h or g, n, d) with its first rotary_dim dims rotated to positions ``where``, the rest as they are."""
        assert self.rotary is not None  # called only with a rotary
        r = self.rotary.head_dim
        if r == self.head_dim:
            return self.rotary.rotate(x, where, grow=False)
        return torch.cat((self.rotary.rotate(x[..., :r], where, grow=False), x[..., r:]), dim=-1)  # (.., n, d)

    def _fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W^Q, W^K, W^V stacked (h*(d + c) + g*d + g*e, embed_dim; c gate rows per head with an output gate), and
        their biases, for one self-attention matmul.

        Stacked on every call: a cached stack cannot see in-place updates made through ``.data`` (they
        do not bump the version counter), and a silently stale weight is worse than copying 3 d^2 values.
        """
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weights: list[torch.Tensor] = [p.weight for p in projections]
        # None in all three under bias=False (torch annotates Linear.bias as a Parameter, never None)
        biases: list[torch.Tensor] = [p.bias for p in projections]
        return (torch.cat(weights), None if biases[0] is None else torch.cat(biases))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        mask: Mask | torch.Tensor | None = None,
        causal: bool = False,
        need_weights: bool = False,
        average_weights: bool = False,
        cache: KVCache | PagedBatch | None = None,
        positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` (or to itself).

        Args:
            query: (b, i, embed_dim).
            key: (b, j, kdim), or None for self-attention (one fused QKV matmul).
            value: (b, j, vdim); None takes ``key``.
            mask: typed mask or tensor broadcastable to (b, h, i, j), over every key attended (the
                cached ones included). True = may attend.
            causal: bottom-right causal mask (what decoding with a cache needs).
            need_weights: also return the attention weights, (b, h, i, j), or (b, i, j) averaged over
                heads with ``average_weights``. Never changes the output.
            cache: a :class:`KVCache` from :meth:`new_cache`: this call's keys/values are appended
                and the queries attend over everything cached so far. Or a paged cache's
                ``batch(handles)`` (:meth:`new_paged_cache`): batch row s appends to sequence handles[s]
                and attends over its own keys at its own length (no mask: causal and the cache's window say
                which keys; weight column c is the key at the sequence's c-th held position, 0 past its length).
            positions: absolute positions of the new tokens for rotary, (i,) or (b, i); default:
                ``cache.seen + arange(i)`` with a cache, ``arange(i)`` without.

        Returns:
            (output (b, i, out_dim), weights or None)
        """
        self._check_call(query, key, value, causal, need_weights, average_weights, cache, positions)
        (b, i), h, e = query.shape[:2], self.num_heads, self.value_head_dim
        q, gate, k, v = self._heads(query, key, value)  # (b, h, i, d), (b, h, i, c) or None, (b, g, j, d), (b, g, j, e)
        rotary_end = rotary_asked = None  # what the rotary tables must cover after this call, for how many positions
        split = self.sequence_split
        if self.rotary is not None:
            # a shard of a split sequence sits at its global positions (the split's layout)
            where = self._positions(positions, b, i, cache) if split is None else split.positions(i, query.device)
            # tables grow only once the call has succeeded (below): a failed call leaves them as they were
            q, k = self._rotate(q, where), self._rotate(k, where)
            rotary_end, rotary_asked = _positions_end(where, i)
        # staged, not appended: the keys count only once the whole call has succeeded (commit below), so a call
        # that raises leaves the cache exactly as it was
        pending, k, v, seen = self._staged(cache, k, v, mask)  # the hooks on Attend read q, k, v as positionals
        result = self.attend(
            q, k, v, **seen, causal=causal, return_weights=need_weights, sinks=self.sinks, kernel=split
        )
        out = result.output if gate is None else result.output * torch.sigmoid(gate)  # (b, h, i, e)
        out = self.out_proj(out.transpose(1, 2).reshape(b, i, h * e))  # heads concatenated, then W^O
        weights = result.weights
        if weights is not None and average_weights:
            weights = weights.mean(dim=1)  # (b, i, j)
        if self.rotary is not None and rotary_end is not None:  # rotary_end is set only with a rotary
            self.rotary.reserve(rotary_end, q, asked=rotary_asked)
        if pending is not None:
            pending.commit()
        return out, weights

    def _check_call(self, query, key, value, causal, need_weights, average_weights, cache, positions) -> None:
        """Every check of a forward call that is the layer's own, before the first matmul: the inputs' shapes,
        dtypes and devices, key and value given together, the flags, and the cache's sizes and room (the
        attention call's own checks follow in :func:`multihead.attention`)."""
        self._check_input("query", query, self.embed_dim, None)
        if key is None:
            self._check_self_attention(value)
        else:
            self._check_cross_attention(query, key, value)
        for name, switch in (("need_weights", need_weights), ("average_weights", average_weights), ("causal", causal)):
            checked_flag(name, switch)
        if cache is not None and not isinstance(cache, (KVCache, PagedBatch)):
            raise bad_argument(
                "cache",
                "a multihead.KVCache (layer.new_cache(...)) or a paged cache's batch (paged.batch(handles))",
                describe(cache),
                "build one with layer.new_cache(batch_size, max_len) or layer.new_paged_cache(num_pages, page_size)",
                kind=TypeError,
            )
        if cache is not None:
            # the projections' dtype: autocast's for float32 and half inputs (it leaves float64 alone)
            autocast = autocast_on(query.device) and query.dtype != torch.float64
            compute_dtype = torch.get_autocast_dtype(query.device.type) if autocast else query.dtype
            b, i = query.shape[:2]
            cache.check_compatible(
                b, self.num_kv_heads, self.head_dim, self.value_head_dim, compute_dtype, query.device
            )
            cache.check_room(i)
        if self.rotary is not None and key is not None:
            raise bad_argument(
                "key",
                "None: rotary positions are defined for self-attention",
                "a key tensor",
                "build the layer without rotary for cross-attention",
            )
        if self.rotary is None and positions is not None:
            raise bad_argument(
                "positions",
                "None (the layer has no rotary embedding)",
                describe(positions),
                "build the layer with rotary=True, or drop positions",
            )
        if self.sequence_split is not None:
            self._check_split_call(key, need_weights, cache, positions)

    def _check_split_call(self, key: object, need_weights: bool, cache: object, positions: object) -> None:
        """What a call of a layer whose sequence is split across ranks cannot have, refused before anything runs:
        cross-attention, the weights, a cache, positions of its own, and hooks on its ``Attend`` (capture and the
        circuits tools read the call's q, k and v, which hold this rank's positions only)."""
        undo = "or set layer.sequence_split = None to run the layer on this rank alone"
        if key is not None:
            raise bad_argument(
                "key",
                "None: a layer whose sequence is split across ranks attends to its own input (self-attention)",
                "a key tensor",
                f"run cross-attention with multihead.attention on one rank, {undo}",
            )
        if need_weights:
            raise bad_argument(
                "need_weights",
                "False: the weights of a sequence split across ranks are never formed on any rank",
                True,
                f"look at the weights of a sequence that fits one rank, {undo}",
            )
        if cache is not None:
            raise bad_argument(
                "cache",
                "None: a split sequence has no KV cache (the split is for training and prefill)",
                describe(cache),
                f"decode with the layer on one rank, {undo}",
            )
        if positions is not None:
            raise bad_argument(
                "positions",
                "None: the positions of a rank's shard are the split's (its layout)",
                describe(positions),
                "shard the input in the split's layout (contiguous or zigzag) and drop positions",
            )
        if self.attend._forward_hooks or self.attend._forward_pre_hooks:
            raise bad_argument(
                "layer.attend",
                "no forward hooks while the sequence is split across ranks",
                "hooks (capture, circuits or your own) that would read this rank's positions only",
                f"remove them (leave the capture block), {undo}",
                kind=RuntimeError,
            )

    def _check_self_attention(self, value: object) -> None:
        if value is not None:
            raise bad_argument(
                "key", "a key tensor when value is given", None, "pass key= too, or neither for self-attention"
            )
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            raise bad_argument(
                "key",
                f"a key tensor (b, j, {self.kdim}) since kdim/vdim differ from embed_dim",
                None,
                "pass key= (and value=) for cross-attention",
            )

    def _check_cross_attention(self, query: torch.Tensor, key: object, value: object) -> None:
        self._check_input("key", key, self.kdim, query)
        assert isinstance(key, torch.Tensor)  # _check_input raised otherwise
        if value is None and self.vdim != self.kdim:
            raise bad_argument(
                "value",
                f"a value tensor (b, j, {self.vdim}): vdim = {self.vdim} differs from "
                f"kdim = {self.kdim}, so the key cannot serve as value",
                None,
                "pass value= explicitly",
            )
        if value is not None:
            self._check_input("value", value, self.vdim, query)
            assert isinstance(value, torch.Tensor)
            if value.shape[1] != key.shape[1]:
                raise bad_argument(
                    "value",
                    f"length j = {key.shape[1]} (from key)",
                    value.shape[1],
                    "give key and value the same length",
                )

    @staticmethod
    def _staged(
        cache: KVCache | PagedBatch | None, k: torch.Tensor, v: torch.Tensor, mask: Mask | torch.Tensor | None
    ) -> tuple[PendingAppend | PagedPending | None, torch.Tensor, torch.Tensor, dict]:
        """The cache's staged append (None without a cache), the keys and values ``Attend`` reads (a paged cache's
        pools), and which of them each query sees: the mask, and a paged cache's table."""
        if cache is None:
            return None, k, v, {"mask": mask}
        if isinstance(cache, PagedBatch):  # written where nothing counts yet; read in place through the table
            paged = cache.stage(k, v)
            return paged, cache.cache.keys, cache.cache.values, {"mask": mask, "pages": paged.pages}
        pending = cache.stage(k, v)  # keys (b, g, L, d), values (b, g, L, e): every key attended
        if cache.window is not None:  # a window cache: each query sees its last `window` keys
            sliding = window(cache.window - 1, 0)
            mask = sliding if mask is None else as_mask(mask) & sliding
        return pending, pending.keys, pending.values, {"mask": mask}

    def _positions(
        self, positions: torch.Tensor | None, b: int, i: int, cache: KVCache | PagedBatch | None
    ) -> int | torch.Tensor:
        if positions is None and isinstance(cache, PagedBatch):
            # sequences at one length share an offset (the contiguous path's rotation, from the tables); else (S, i),
            # each sequence at its own length
            shared = cache.shared_offset()
            return cache.positions(i, self.k_proj.weight.device) if shared is None else shared
        start = 0 if cache is None or isinstance(cache, PagedBatch) else cache.seen
        if positions is None:
            return start
        check_positions(positions, b, i)
        # left where it is: rotate reads a CPU tensor's values (to check them and size its tables) before moving it
        # to the device itself without waiting; a tensor already on the device is never read
        return positions


def _positions_end(where: int | torch.Tensor, i: int) -> tuple[int | None, int | None]:
    """One past the last rotary position of a call's i rows at ``where`` (an offset, or a tensor of positions), for
    the tables to cover once the call has succeeded, and for a tensor how many positions it asked for (the tables
    then grow only where :func:`~multihead.positional.worth_a_table`, as rotate's own growth); (None, None) for
    positions on a device (never read: their angles are computed per call). Without tensor positions growing the
    tables, every decode step of a paged batch computed its angles in float64, for q and for k."""
    if isinstance(where, int):
        return where + i, None
    if not host_readable(where) or where.numel() == 0:
        return None, None
    return int(where.max()) + 1, where.numel()
