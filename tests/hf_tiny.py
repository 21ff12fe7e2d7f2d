"""Tiny random models of any architecture the installed transformers has, built from its own config defaults shrunk
to a few dozen features (nothing downloaded): for the tests that hold an architecture's eager attention against
ours. Sizes a config derives from others keep the relation its defaults have, so MLA's rotary part, a head of
nope + rope and one key/value head per query head survive the shrinking."""

from __future__ import annotations

import torch
import transformers

VOCAB = 97

# a config field -> its tiny size, where the config has the field
SMALL = {
    "hidden_size": 32,
    "intermediate_size": 40,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "sliding_window": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "qk_head_dim": 8,
    "index_topk": 4,
    "index_n_heads": 2,
    "index_head_dim": 8,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "swa_head_dim": 8,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "sliding_window_size": 4,
}

# (derived, source): set derived to source's tiny size where the defaults have them equal
_KEPT_EQUAL = (
    ("head_dim", "qk_rope_head_dim"),
    ("v_head_dim", "qk_head_dim"),
    ("num_key_value_heads", "num_attention_heads"),
)


def _get(config: object, key: str) -> object:
    """``config.key``, or None where the config has no such field (some configs raise other errors than
    AttributeError for a field that varies per layer)."""
    try:
        return getattr(config, key, None)
    except Exception:
        return None


def _has(config: object, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:
        return False


def tiny_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    """``model_type``'s config (its text config where it has one shrunk) at the sizes of :data:`SMALL`, with
    ``overrides`` set last."""
    config = transformers.AutoConfig.for_model(model_type)
    text = _get(config, "text_config") or config
    default = {key: _get(text, key) for key in SMALL}
    for key, value in {**SMALL, **overrides}.items():
        if _has(text, key) or key in overrides:
            setattr(text, key, value)
    parts = (default.get("qk_head_dim"), default.get("qk_nope_head_dim"), default.get("qk_rope_head_dim"))
    if None not in parts and parts[0] == parts[1] + parts[2]:
        text.qk_head_dim = text.qk_nope_head_dim + text.qk_rope_head_dim
    for derived, source in _KEPT_EQUAL:
        if derived not in overrides and default.get(derived) is not None and default[derived] == default.get(source):
            setattr(text, derived, _get(text, source))
    for key, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if _get(text, key) is not None:
            setattr(text, key, value)
    layer_types = _get(text, "layer_types")
    if layer_types is not None and "layer_types" not in overrides:
        # each kind of layer the defaults have, in the order they first come (a hybrid's attention layer may come
        # only fourth), as many as the tiny model has layers, the pattern repeated to fill them
        distinct = list(dict.fromkeys(layer_types))
        kinds = (distinct * text.num_hidden_layers)[: text.num_hidden_layers]
        try:
            text.layer_types = kinds
        except AttributeError:  # derived from other fields, with no setter (Falcon-H1's layers_block_type)
            pass
    return config


def tiny_model(model_type: str, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random model of ``model_type`` in eval mode: its causal LM where it has one, else its base model."""
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError:  # no causal LM head for this config (an encoder, a multimodal base)
        model = transformers.AutoModel.from_config(config)
    return model.eval()


def first_output(model: torch.nn.Module, **batch) -> torch.Tensor:
    out = model(**batch)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def assert_outputs_and_gradients_equal(theirs: torch.nn.Module, ours: torch.nn.Module, tolerance: float, **batch):
    """``ours`` gives ``theirs``' logits (or last hidden states) on ``batch``, and every parameter's gradient of one
    random projection of them, within ``tolerance``."""
    expected, got = first_output(theirs, **batch), first_output(ours, **batch)
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2)).to(expected.device)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    named = dict(ours.named_parameters())
    for name, parameter in theirs.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(named[name].grad, parameter.grad, atol=tolerance, rtol=tolerance, msg=name)
