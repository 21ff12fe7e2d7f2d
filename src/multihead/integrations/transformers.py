"""Hugging Face transformers models on multihead's kernel: ``attn_implementation="multihead"``.

    import multihead.integrations.transformers           # registers "multihead" with transformers
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="multihead")

Importing this module registers :func:`attention_forward` with transformers' ``AttentionInterface`` and
transformers' boolean mask builder (``sdpa_mask``: True = may attend, our polarity; None when the mask is
only causal) with its ``AttentionMaskInterface``, both under the name "multihead". Every attention call of
the model then runs through :func:`multihead.attention`. Grouped key/value heads go in as g heads, never
repeated. What the kernel cannot honour yet (logit soft-capping, attention sinks, a position bias such as
T5's) is refused with an error naming the option and the model's class: never dropped silently.

transformers is an optional extra (``pip install 'multihead[hf]'``); nothing else in multihead imports it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from multihead._errors import bad_argument
from multihead.functional import AttentionResult, attention

__all__ = ["IMPLEMENTATION", "attention_forward"]

IMPLEMENTATION = "multihead"

# keyword arguments an architecture may pass that change the scores: the kernel has no equivalent yet
_NOT_YET = {
    "softcap": "logit soft-capping (tanh(s / c) * c)",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an added position bias (T5-style)",
}


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention signature on :func:`multihead.attention`.

    query (b, h, i, d), key (b, g, j, d), value (b, g, j, e); attention_mask None, or (b, 1 or h, i, >= j)
    boolean (True = may attend) or additive float. Returns (output (b, i, h, e), weights (b, h, i, j) when
    ``output_attentions`` was asked, else None).
    """
    for name, what in _NOT_YET.items():
        if kwargs.get(name) is not None:
            raise bad_argument(
                f"attn_implementation={IMPLEMENTATION!r}",
                f"attention multihead's kernel can serve ({type(module).__name__} asks for {what})",
                f"{name}={kwargs[name]!r}" if not isinstance(kwargs[name], torch.Tensor) else f"a {name} tensor",
                'load this model with attn_implementation="eager" or "sdpa"',
            )
    mask = None if attention_mask is None else attention_mask[..., : key.shape[-2]]
    causal = False
    if mask is None:  # transformers leaves the mask out when it is only causal (and the module is a decoder)
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
        causal = causal and query.shape[2] > 1
    result = attention(
        query,
        key,
        value,
        mask=mask,
        causal=causal,
        scale=scaling,
        dropout=dropout,
        training=module.training,
        return_weights=bool(kwargs.get("output_attentions", False)),  # the weights of this very call
    )
    output, weights = (result.output, result.weights) if isinstance(result, AttentionResult) else (result, None)
    return output.transpose(1, 2).contiguous(), weights


AttentionInterface.register(IMPLEMENTATION, attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
