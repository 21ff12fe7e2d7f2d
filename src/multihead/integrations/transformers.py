"""Hugging Face transformers models on multihead's kernel: ``attn_implementation="multihead"``.

    import multihead.integrations.transformers           # registers "multihead" with transformers
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="multihead")

Importing this module registers :func:`attention_forward` with transformers' ``AttentionInterface`` and
:func:`multihead.integrations.transformers_masks.typed_mask` with its ``AttentionMaskInterface``, both under
the name "multihead": causal, sliding-window, bidirectional and padding masks reach the kernel as typed masks
(never an i x j tensor), any other pattern as transformers' dense boolean mask (True = may attend, our
polarity). Every attention call of the model then runs through :func:`multihead.attention`. Grouped
key/value heads go in as g heads, never repeated. Logit soft-capping (Gemma 2) becomes the typed mask
``masks.softcap``, T5's relative position bias the typed mask ``masks.bias`` (its gradient reaches the
bias table), learned attention sinks (gpt-oss's ``s_aux``) the kernel's ``sinks``, and a sparse-index
indexer's picks (DeepSeek-V3.2's ``indices``) the typed mask ``masks.selected``. A query row whose every key is
masked (left padding) gets eager's result, uniform weights over the keys and the mean of the values, where the
kernel gives 0 (:mod:`multihead.integrations.transformers_rows`).

Every call runs through an :class:`multihead.attend.Attend` step kept for the module that makes it, and
importing this module registers a site finder (:func:`attention_sites`), so :func:`multihead.lab.inspect.capture`,
head gates and ablations work on these models as on ours: layers numbered by the model's ``layer_idx``,
cross-attention apart in part "cross", an encoder-decoder's stacks in parts "encoder" and "decoder".

transformers is an optional extra (``pip install 'multihead[hf]'``); nothing else in multihead imports it.
The transformers internals the integration relies on are imported by
:mod:`multihead.integrations.transformers_internals` alone: on a transformers that lacks one, importing this
module raises :class:`multihead.integrations.UnsupportedTransformersError`, one line naming the missing name,
the installed version and the tested range.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
from torch import nn
from transformers import PreTrainedModel

from multihead import masks
from multihead._errors import bad_argument
from multihead.attend import Attend, AttentionSite, register_site_finder
from multihead.integrations.transformers_internals import (
    AttentionInterface,
    AttentionMaskInterface,
    attn_implementation,
)
from multihead.integrations.transformers_masks import kernel_mask, typed_mask
from multihead.integrations.transformers_rows import eager_rows

__all__ = [
    "IMPLEMENTATION",
    "KEYWORDS_CARRIED",
    "KEYWORDS_SERVED",
    "attention_forward",
    "attention_sites",
    "calls_attention",
]

IMPLEMENTATION = "multihead"

# What an attention function may be passed past query, key, value, attention_mask, dropout and scaling. SERVED change
# the scores and reach the kernel; CARRIED change nothing eager computes from them (the mask already says what they
# say: the window, packed documents' boundaries, positions; or they are flags for other kernels and outputs). Any
# other tensor is refused, naming it: a keyword we would drop might change the model. A test walks every model class
# of the installed transformers for the keywords its attention is called with and its eager function reads.
KEYWORDS_SERVED = frozenset(
    {"softcap", "position_bias", "s_aux", "sinks", "indices", "block_indices", "output_attentions", "is_causal"}
)
KEYWORDS_CARRIED = frozenset(
    {
        "sliding_window",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "position_ids",
        "cache_position",
        "seq_idx",
        "num_items_in_batch",
        "output_hidden_states",
        "output_router_logits",
        "deterministic",
    }
)


def _check_keywords(module: nn.Module, kwargs: dict) -> None:
    """Refuse a tensor keyword neither served nor carried (see KEYWORDS_SERVED), naming it and the module."""
    for name, value in kwargs.items():
        if name in KEYWORDS_SERVED or name in KEYWORDS_CARRIED or not isinstance(value, torch.Tensor):
            continue
        raise bad_argument(
            f"attn_implementation={IMPLEMENTATION!r}",
            f"keywords multihead's kernel serves ({type(module).__name__} passes {name!r}, which it does not)",
            f"a {name} tensor of shape {tuple(value.shape)}",
            'load this model with attn_implementation="eager" or "sdpa"',
        )


# the names architectures pass learned attention sinks under: gpt-oss and most (h,) parameters as s_aux, Inkling 2
# a (b, h, i, 1) logit per query row as sinks
_SINK_NAMES = ("s_aux", "sinks")


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: masks.Mask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention signature on :func:`multihead.attention`.

    query (b, h, i, d), key (b, g, j, d), value (b, g, j, e); attention_mask None, a typed mask (what
    :func:`~multihead.integrations.transformers_masks.typed_mask` made), or a (b, 1 or h, i, >= j) tensor,
    boolean (True = may attend) or additive float; ``softcap`` (Gemma 2) caps the scores. Returns (output
    (b, i, h, e), weights (b, h, i, j) when ``output_attentions`` was asked, else None). A module whose sequence is
    split across ranks (:func:`multihead.integrations.transformers_parallel.context_parallel`) takes this rank's
    shard, i = j = n/P, and its split serves the call or refuses it.
    """
    split = module.__dict__.get(SPLIT_ATTRIBUTE)
    if split is not None:  # the sequence split across ranks (multihead.integrations.transformers_parallel)
        return split(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    _check_keywords(module, kwargs)
    mask = kernel_mask(attention_mask, key.shape[-2])
    picked = _sparse_indices(module, kwargs)
    if picked is not None:  # DeepSeek-V3.2's DSA, MiniMax-M3: each query sees only the keys its indexer picked
        mask = picked if mask is None else masks.all_of(mask, picked)
    causal = False
    if mask is None:  # transformers leaves the mask out when it is only causal (and the module is a decoder)
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
        causal = causal and query.shape[2] > 1
    keys = mask  # what rules keys out; the terms below change the scores
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:  # T5: a learned (1 or b, h, i, j) bias on the scores, differentiable
        added = masks.bias(position_bias[..., : key.shape[-2]])
        mask = added if mask is None else masks.all_of(added, mask)  # a call, not &: fullgraph compile traces it
    softcap = kwargs.get("softcap")
    if softcap is not None:  # Gemma 2: cap * tanh(s / cap) on the scaled scores, before the mask
        capped = masks.softcap(float(softcap))
        mask = capped if mask is None else masks.all_of(capped, mask)
    sinks = _sinks(kwargs)
    # rows with every key masked: eager's uniform weights over the keys, where the kernel gives 0 (transformers_rows)
    finish = eager_rows(query, key, value, keys=keys, causal=causal, mask=mask, scale=scaling, sinks=sinks)
    result = _seam(module)(
        query,
        key,
        value,
        mask=mask,
        causal=causal,
        scale=scaling,
        dropout=dropout,
        training=module.training,
        return_weights=_weights_asked(module, kwargs),
        sinks=sinks,
        finish=finish,
    )
    return result.output.transpose(1, 2).contiguous(), result.weights


def _sparse_indices(module: nn.Module, kwargs: dict) -> masks.Mask | None:
    """The indexer's picks as a mask term: ``indices`` (b, i, k) key positions (DeepSeek-V3.2, GLM-MoE-DSA,
    AXK2, HY-V4), or ``block_indices`` (b, s, i, k) blocks of ``module.indexer.block_size`` keys, -1 empty
    (MiniMax-M3). A model that passes blocks without saying their size is refused: guessing it would be wrong."""
    if kwargs.get("indices") is not None:
        return masks.selected(kwargs["indices"])
    if kwargs.get("block_indices") is None:
        return None
    block_size = getattr(getattr(module, "indexer", None), "block_size", None)
    if not isinstance(block_size, int):
        raise bad_argument(
            f"attn_implementation={IMPLEMENTATION!r}",
            f"a {type(module).__name__} whose indexer says its key blocks' size (module.indexer.block_size)",
            "block_indices without a block size",
            'load this model with attn_implementation="eager" or "sdpa"',
        )
    return masks.selected(kwargs["block_indices"], block_size=block_size)


def _sinks(kwargs: dict) -> torch.Tensor | None:
    """The call's learned sink logits for the kernel: an (h,) parameter as it is, a (b, h, i, 1) column of one logit
    per query row (the column eager concatenates to the scores) as (b, h, i); the kernel checks the shape."""
    given = [kwargs[name] for name in _SINK_NAMES if kwargs.get(name) is not None]
    if not given:
        return None
    sinks = given[0]
    if isinstance(sinks, torch.Tensor) and sinks.ndim == 4 and sinks.shape[-1] == 1:
        sinks = sinks.squeeze(-1)
    return sinks


def _weights_asked(module: nn.Module, kwargs: dict) -> bool:
    """Whether this call asks for the weights: its own ``output_attentions`` where the model passed one, else its
    config's (a model built with ``output_attentions=True`` asks every call, and eager answers every call)."""
    asked = kwargs.get("output_attentions")
    if asked is None:
        asked = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(asked)


# The attention step of every transformers module that calls attention_forward, kept in the module's own __dict__
# (not as a submodule: the model's modules, state dict and repr stay transformers' own). Looked up there, a compiled
# model's graph guards on that module alone; a module-level dictionary was guarded as a whole, so running or
# freeing any other model recompiled it
SEAM_ATTRIBUTE = "_multihead_attend"


# A module's sequence split across ranks, set by multihead.integrations.transformers_parallel.context_parallel and
# kept beside its seam for the same reason: a callable that takes the call in attention_forward's place
SPLIT_ATTRIBUTE = "_multihead_sequence_split"


def _seam(module: nn.Module) -> Attend:
    seam = module.__dict__.get(SEAM_ATTRIBUTE)
    if seam is None:
        seam = Attend()
        object.__setattr__(module, SEAM_ATTRIBUTE, seam)  # past nn.Module.__setattr__, which would register it
    return seam


# the attribute name, in its parent, of a decoder's attention over the encoder's states
_CROSS_NAMES = ("encoder_attn", "crossattention", "cross_attn", "cross_attention", "EncDecAttention")


def _head_counts(module: nn.Module) -> tuple[int, int] | None:
    """(query heads h, key/value heads g) of a transformers attention module, or None if it names none."""
    config = getattr(module, "config", None)
    candidates = (getattr(module, name, None) for name in ("num_heads", "num_attention_heads"))
    heads = next((n for n in candidates if isinstance(n, int) and n > 0), None)
    if heads is None:
        heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads <= 0:
        return None
    groups = getattr(module, "num_key_value_groups", 1)  # query heads per key/value head (GQA)
    if not isinstance(groups, int) or groups <= 0 or heads % groups:
        return None
    return heads, heads // groups


# a module's forward calls the attention function where its code looks it up in transformers' interface (or calls the
# eager fallback itself); an indexer, a router, a Mamba mixer, a convolution or a linear attention never does
_CALLS_ATTENTION = re.compile(r"ALL_ATTENTION_FUNCTIONS|eager_attention_forward\(|attention_interface\(")


@functools.cache
def _class_calls_attention(cls: type[nn.Module]) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source at hand (a compiled or dynamically built class): not found by it
        return False
    return bool(_CALLS_ATTENTION.search(source))


def calls_attention(module: nn.Module) -> bool:
    """Whether ``module`` runs an attention step through transformers' attention function: it has called
    :func:`attention_forward` already (its step is kept on it), or its class's forward looks the function up."""
    return SEAM_ATTRIBUTE in module.__dict__ or _class_calls_attention(type(module))  # type: ignore[arg-type]


def attention_sites(model: nn.Module) -> list[AttentionSite] | None:
    """The attention modules of a transformers model on "multihead", as sites; None for any other model.

    An attention module is one whose forward calls transformers' attention function (:func:`calls_attention`),
    found by that and never by its name, so a hybrid's Mamba mixers, convolutions, linear attentions, routers and
    indexers are not taken for one; its head counts come from its attributes or config. Parts: "cross" for a
    decoder's attention over the encoder (``is_cross_attention``, or named like ``encoder_attn``),
    "encoder" and "decoder" for the two stacks of an encoder-decoder, "self" otherwise; layers are
    numbered by ``layer_idx``. A transformers model on another implementation is refused: its attention
    never reaches the kernel, so nothing could be recorded. So is one whose attention modules' own configs name
    another (T5's stacks keep copies of the config, which transformers before 5.20's ``set_attn_implementation``
    left as they were).
    """
    if not isinstance(model, PreTrainedModel):
        return None
    running = attn_implementation(model.config)
    if running != IMPLEMENTATION:
        raise bad_argument(
            "model",
            f'a transformers model running attn_implementation="{IMPLEMENTATION}"',
            f"a {type(model).__name__} running {running!r}",
            f'load it with from_pretrained(..., attn_implementation="{IMPLEMENTATION}"), or call '
            f'model.set_attn_implementation("{IMPLEMENTATION}")',
        )
    found = [
        (name, module, counts)
        for name, module in model.named_modules()
        if calls_attention(module) and (counts := _head_counts(module)) is not None
    ]
    for name, module, _ in found:  # a stack with a config of its own may run another implementation
        elsewhere = attn_implementation(getattr(module, "config", None))
        if elsewhere not in (None, IMPLEMENTATION):
            raise bad_argument(
                "model",
                f'a transformers model whose every attention module runs attn_implementation="{IMPLEMENTATION}"',
                f"a {type(model).__name__} whose {name} ({type(module).__name__}) runs {elsewhere!r}",
                f'load it with from_pretrained(..., attn_implementation="{IMPLEMENTATION}"): this transformers\' '
                "set_attn_implementation did not reach every module",
            )
    encoder = model.get_encoder() if getattr(model.config, "is_encoder_decoder", False) else None
    in_encoder = set() if encoder is None else {id(module) for module in encoder.modules()}

    def part_of(name: str, module: nn.Module) -> str:
        if getattr(module, "is_cross_attention", False) or name.rpartition(".")[2] in _CROSS_NAMES:
            return "cross"
        if encoder is None:
            return "self"
        return "encoder" if id(module) in in_encoder else "decoder"

    parts = [part_of(name, module) for name, module, _ in found]
    sites = []
    for part in dict.fromkeys(parts):
        members = [entry for entry, entry_part in zip(found, parts, strict=True) if entry_part == part]
        given = [getattr(module, "layer_idx", None) for _, module, _ in members]
        numbers = list(range(len(members)))  # in order, unless the modules' layer_idx number this part
        layer_indices = [n for n in given if isinstance(n, int)]
        if len(layer_indices) == len(members) and sorted(layer_indices) == numbers:
            numbers = layer_indices
        for (name, module, (heads, kv_heads)), number in zip(members, numbers, strict=True):
            sites.append(AttentionSite(_seam(module), heads, kv_heads, part, number, name))
    if not sites:
        raise bad_argument(
            "model",
            "a transformers model whose attention modules multihead can find (a layer_idx and a head count)",
            f"a {type(model).__name__} with none",
            "record a supported architecture (BERT, GPT-2, Llama, Mistral, BART, ...)",
        )
    return sites


AttentionInterface.register(IMPLEMENTATION, attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, typed_mask)
register_site_finder(attention_sites)
