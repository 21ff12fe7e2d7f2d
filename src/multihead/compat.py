"""A drop-in for ``torch.nn.MultiheadAttention``, and weight converters to and from it.

``multihead.compat.MultiheadAttention`` has torch's constructor, forward signature,
parameter names (so a torch ``state_dict`` loads unchanged) and semantics:
sequence-first by default, boolean masks with True = *masked out*, float masks
added, ``(N * num_heads, L, S)`` 3-D masks, ``add_bias_kv``, ``add_zero_attn``,
weights averaged over heads by default. It computes with multihead's kernels.

This module is the one place torch's mask polarity is converted to ours
(True = may attend); nothing past ``forward`` sees torch's convention.

The one intended difference: a query whose keys are all masked gets output 0
and weights 0, where torch returns NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from multihead._errors import bad_argument, describe
from multihead.functional import attention
from multihead.layer import MultiHeadAttention
from multihead.masks import Mask, as_mask


def _keep_or_bias(mask: torch.Tensor, name: str) -> torch.Tensor:
    """Torch's mask (bool True = masked out, or float added) as ours (bool True = may attend, or float)."""
    if mask.dtype == torch.bool:
        return mask.logical_not()
    if mask.is_floating_point():
        return mask
    raise bad_argument(name, "a bool or floating tensor", describe(mask), "convert with .bool() or .float()",
                       kind=TypeError)


class MultiheadAttention(nn.Module):
    """torch.nn.MultiheadAttention's interface on multihead's kernels (see the module docstring).

    Shapes (torch's): query (L, N, E), key (S, N, kdim), value (S, N, vdim), or (N, L, E) ... with
    ``batch_first=True``, or unbatched (L, E) ...; key_padding_mask (N, S); attn_mask (L, S) or
    (N * num_heads, L, S). Returns (attn_output, attn_weights): (L, N, E) and (N, L, S), or
    (N, num_heads, L, S) with ``average_attn_weights=False``, or None with ``need_weights=False``.

    Example:
        >>> import multihead.compat as compat
        >>> mha = compat.MultiheadAttention(16, 4)
        >>> mha.load_state_dict(torch.nn.MultiheadAttention(16, 4).state_dict())
        <All keys matched successfully>
        >>> out, weights = mha(torch.randn(5, 2, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16))
        >>> out.shape, weights.shape
        (torch.Size([5, 2, 16]), torch.Size([2, 5, 7]))
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
                 vdim: int | None = None, batch_first: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad_argument(name, "a positive int", describe(value), "pass a positive whole number")
        if embed_dim % num_heads != 0:
            raise bad_argument("num_heads", f"a divisor of embed_dim = {embed_dim}", num_heads,
                               "pick num_heads that divides embed_dim")
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0.0 <= dropout < 1.0:
            raise bad_argument("dropout", "a probability in [0, 1)", describe(dropout), "pass e.g. dropout=0.1")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform in-projection(s), zero biases, normal bias_k/bias_v."""
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for weight in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def projection_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """W^Q (E, E), W^K (E, kdim), W^V (E, vdim), whichever layout stores them."""
        if self._qkv_same_embed_dim:
            return self.in_proj_weight.chunk(3)
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def projection_biases(self) -> tuple[torch.Tensor | None, ...]:
        """b^Q, b^K, b^V (E,) each, or Nones."""
        return (None, None, None) if self.in_proj_bias is None else self.in_proj_bias.chunk(3)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """torch.nn.MultiheadAttention.forward, same arguments and results (see the class docstring)."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise bad_argument(name, "a torch.Tensor", describe(t), "pass a tensor", kind=TypeError)
        if is_causal and attn_mask is None:
            # torch treats is_causal as a hint about attn_mask and refuses it alone
            raise bad_argument("attn_mask", "a causal attn_mask when is_causal=True (torch's rule)", None,
                               "pass attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(L)")
        unbatched = query.dim() == 2
        if unbatched:  # (L, E) -> (L, 1, E), torch's unbatched convention
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif query.dim() != 3:
            raise bad_argument("query", "shape (L, N, E), (N, L, E) with batch_first, or unbatched (L, E)",
                               f"shape {tuple(query.shape)}", "pass a 2-D or 3-D tensor")
        if self.batch_first and not unbatched:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # (N, L, E) -> (L, N, E)
        target_len, batch, _ = query.shape
        for name, t, features in (("query", query, self.embed_dim), ("key", key, self.kdim),
                                  ("value", value, self.vdim)):
            if t.dim() != 3 or t.shape[1] != batch or t.shape[2] != features:
                raise bad_argument(name, f"(seq, N = {batch}, {features}) in torch's layout",
                                   f"shape {tuple(t.shape)}", "check batch_first and the feature sizes")
        if key.shape[0] != value.shape[0]:
            raise bad_argument("value", f"length S = {key.shape[0]} (from key)", value.shape[0],
                               "give key and value the same length")

        w_q, w_k, w_v = self.projection_weights()
        b_q, b_k, b_v = self.projection_biases()
        q = F.linear(query, w_q, b_q)  # (L, N, E)
        k = F.linear(key, w_k, b_k)  # (S, N, E)
        v = F.linear(value, w_v, b_v)  # (S, N, E)
        masks = self._our_masks(attn_mask, key_padding_mask, batch, target_len, key.shape[0])
        if self.bias_k is not None:  # one learned key/value appended to every sequence
            k = torch.cat([k, self.bias_k.expand(1, batch, -1)])
            v = torch.cat([v, self.bias_v.expand(1, batch, -1)])
            masks = [F.pad(m, (0, 1), value=True if m.dtype == torch.bool else 0.0) for m in masks]
        h, d = self.num_heads, self.head_dim
        q = q.view(target_len, batch, h, d).permute(1, 2, 0, 3)  # (N, h, L, d)
        k = k.view(-1, batch, h, d).permute(1, 2, 0, 3)  # (N, h, S', d)
        v = v.view(-1, batch, h, d).permute(1, 2, 0, 3)  # (N, h, S', d)
        if self.add_zero_attn:  # one all-zero key/value appended per head
            k = torch.cat([k, k.new_zeros(batch, h, 1, d)], dim=2)
            v = torch.cat([v, v.new_zeros(batch, h, 1, d)], dim=2)
            masks = [F.pad(m, (0, 1), value=True if m.dtype == torch.bool else 0.0) for m in masks]
        result = attention(q, k, v, mask=_combine(masks), dropout=self.dropout, training=self.training,
                           return_weights=need_weights)
        out, weights = (result.output, result.weights) if need_weights else (result, None)
        out = out.permute(2, 0, 1, 3).reshape(target_len, batch, self.embed_dim)  # (L, N, E)
        out = self.out_proj(out)
        if self.batch_first and not unbatched:
            out = out.transpose(0, 1)  # (N, L, E)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (N, L, S)
        if unbatched:
            out = out.squeeze(1)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _our_masks(self, attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, batch: int,
                   target_len: int, source_len: int) -> list[torch.Tensor]:
        """Torch's masks as ours, each broadcastable to (N, h, L, S)."""
        masks = []
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor):
                raise bad_argument("attn_mask", "a tensor (L, S) or (N * num_heads, L, S)", describe(attn_mask),
                                   "pass a tensor", kind=TypeError)
            ours = _keep_or_bias(attn_mask, "attn_mask")
            if ours.dim() == 2 and tuple(ours.shape) == (target_len, source_len):
                masks.append(ours)
            elif ours.dim() == 3 and tuple(ours.shape) == (batch * self.num_heads, target_len, source_len):
                masks.append(ours.view(batch, self.num_heads, target_len, source_len))  # torch's (N*h) order
            else:
                raise bad_argument("attn_mask", f"shape (L, S) = ({target_len}, {source_len}) or (N * num_heads, "
                                   f"L, S) = ({batch * self.num_heads}, {target_len}, {source_len})",
                                   f"shape {tuple(attn_mask.shape)}", "build the mask for these lengths")
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, torch.Tensor):
                raise bad_argument("key_padding_mask", "a tensor (N, S)", describe(key_padding_mask),
                                   "pass a tensor", kind=TypeError)
            if tuple(key_padding_mask.shape) != (batch, source_len):
                raise bad_argument("key_padding_mask", f"shape (N, S) = ({batch}, {source_len})",
                                   f"shape {tuple(key_padding_mask.shape)}", "one row per batch element")
            masks.append(_keep_or_bias(key_padding_mask, "key_padding_mask")[:, None, None, :])
        return masks


def _combine(masks: list[torch.Tensor]) -> Mask | None:
    """Several keep/bias tensors as one mask (multihead.masks combines bool and float terms with &)."""
    combined = None
    for m in masks:
        combined = as_mask(m) if combined is None else combined & m
    return combined


# --------------------------------------------------------------------------- converters


def from_torch(module: nn.MultiheadAttention) -> MultiHeadAttention:
    """A :class:`multihead.MultiHeadAttention` (batch first) with the weights of a torch module."""
    if not isinstance(module, (nn.MultiheadAttention, MultiheadAttention)):
        raise bad_argument("module", "a torch.nn.MultiheadAttention", describe(module),
                           "pass the torch module to convert", kind=TypeError)
    if module.bias_k is not None or module.add_zero_attn:
        raise bad_argument("module", "a module without add_bias_kv or add_zero_attn",
                           "add_bias_kv" if module.bias_k is not None else "add_zero_attn",
                           "use multihead.compat.MultiheadAttention, which supports them")
    weight = module.out_proj.weight
    layer = MultiHeadAttention(module.embed_dim, module.num_heads, kdim=module.kdim, vdim=module.vdim,
                               bias=module.in_proj_bias is not None, dropout=module.dropout,
                               device=weight.device, dtype=weight.dtype)
    if module._qkv_same_embed_dim:
        w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
    biases = (None, None, None) if module.in_proj_bias is None else module.in_proj_bias.chunk(3)
    with torch.no_grad():
        for proj, w, b in zip((layer.q_proj, layer.k_proj, layer.v_proj), (w_q, w_k, w_v), biases):
            proj.weight.copy_(w)
            if b is not None:
                proj.bias.copy_(b)
        layer.out_proj.load_state_dict(module.out_proj.state_dict())
    return layer


def to_torch(layer: MultiHeadAttention) -> nn.MultiheadAttention:
    """A ``torch.nn.MultiheadAttention(batch_first=True)`` with a layer's weights, where torch can express it."""
    unsupported = []
    if layer.num_kv_heads != layer.num_heads:
        unsupported.append(f"num_kv_heads = {layer.num_kv_heads} != num_heads")
    if layer.head_dim * layer.num_heads != layer.embed_dim or layer.value_head_dim != layer.head_dim:
        unsupported.append("head sizes other than embed_dim / num_heads")
    if layer.out_dim != layer.embed_dim:
        unsupported.append(f"out_dim = {layer.out_dim} != embed_dim")
    if layer.rotary is not None:
        unsupported.append("rotary embedding")
    if unsupported:
        raise bad_argument("layer", "a configuration torch.nn.MultiheadAttention can express",
                           ", ".join(unsupported), "keep the layer in multihead, or build it with the classic "
                           "options")
    weight = layer.out_proj.weight
    module = nn.MultiheadAttention(layer.embed_dim, layer.num_heads, dropout=layer.dropout,
                                   bias=layer.q_proj.bias is not None, kdim=layer.kdim, vdim=layer.vdim,
                                   batch_first=True, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        weights = (layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight)
        if module._qkv_same_embed_dim:
            module.in_proj_weight.copy_(torch.cat(weights))
        else:
            for target, w in zip((module.q_proj_weight, module.k_proj_weight, module.v_proj_weight), weights):
                target.copy_(w)
        if module.in_proj_bias is not None:
            module.in_proj_bias.copy_(torch.cat([layer.q_proj.bias, layer.k_proj.bias, layer.v_proj.bias]))
        module.out_proj.load_state_dict(layer.out_proj.state_dict())
    return module
