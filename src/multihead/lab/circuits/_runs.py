"""What every circuits tool does to a causal language model: check the prompts and answers, run the model to
logits, read the logit difference at the last position, and reach each attention step's activations through
its :class:`~multihead.attend.Attend` hooks.

An activation of a step is one of ``q`` (b, h, i, d), ``k`` (b, g, j, d), ``v`` (b, g, j, e) — the step's inputs,
after projection and rotary —, ``z`` (b, h, i, e), the per-head outputs before the heads are concatenated and
projected by W^O, and ``pattern`` (b, h, i, j), the attention weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from multihead._errors import bad_argument, describe
from multihead.attend import AttentionSite
from multihead.capture import part_sites
from multihead.functional import attention_result

WHATS = ("z", "pattern", "q", "k", "v")  # the activations of a step a tool can read or patch
BYS = ("head", "position")  # what one patch covers: a head at every position, or every head at one position
INPUTS = {"q": 0, "k": 1, "v": 2}  # the step's positional inputs


def checked_ids(name: str, ids: object, fix: str) -> torch.Tensor:
    """Token ids ``ids`` (n,) or (b, n), int64 or int32, as a (b, n) int64 tensor; else a TypeError naming ``name``."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.ndim not in (1, 2):
        raise bad_argument(name, "token ids, an int tensor (n,) or (b, n)", describe(ids), fix, kind=TypeError)
    return ids.long().reshape(-1, ids.shape[-1])


def checked_prompts(clean: object, corrupt: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``clean`` and ``corrupt`` token ids as (b, n) int64 tensors of one shape (a 1-D (n,) is one prompt)."""
    checked = []
    for name, ids in (("clean_ids", clean), ("corrupt_ids", corrupt)):
        ids = checked_ids(name, ids, "tokenise the prompt, e.g. tokenizer(text, return_tensors='pt').input_ids")
        if ids.numel() == 0:
            raise bad_argument(name, "at least one token", f"shape {tuple(ids.shape)}", "pass a non-empty prompt")
        checked.append(ids)
    clean_ids, corrupt_ids = checked
    if clean_ids.shape != corrupt_ids.shape:
        raise bad_argument(
            "corrupt_ids",
            f"the shape of clean_ids {tuple(clean_ids.shape)}: patching swaps activations position by position",
            f"shape {tuple(corrupt_ids.shape)}",
            "write the corrupted prompt with as many tokens as the clean one",
        )
    if clean_ids.device != corrupt_ids.device:
        raise bad_argument(
            "corrupt_ids",
            f"a tensor on {clean_ids.device} (the device of clean_ids)",
            f"one on {corrupt_ids.device}",
            "move both to the model's device",
        )
    return clean_ids, corrupt_ids


def checked_tokens(name: str, token: object, batch: int, vocab: int, device: torch.device) -> torch.Tensor:
    """``token`` (an int, or a (b,) int tensor with one per prompt) as a (b,) int64 tensor on ``device``."""
    if isinstance(token, int) and not isinstance(token, bool):
        token = torch.full((batch,), token, dtype=torch.long)
    if not isinstance(token, torch.Tensor) or token.dtype not in (torch.int64, torch.int32) or token.ndim != 1:
        raise bad_argument(
            name,
            "a token id (int) or a (b,) int tensor of one per prompt",
            describe(token),
            "pass e.g. 42",
            kind=TypeError,
        )
    if token.shape[0] != batch:
        raise bad_argument(name, f"one token per prompt ({batch},)", tuple(token.shape), f"pass {batch} ids")
    if bool(((token < 0) | (token >= vocab)).any()):
        raise bad_argument(name, f"token ids in [0, {vocab}) (the model's vocabulary)", token.tolist(), "check it")
    return token.long().to(device)


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``model(ids)``'s next-token logits, (b, n, vocab): our decoders return them, a transformers causal LM
    returns them as ``.logits``."""
    out = model(ids)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or logits.shape[:2] != ids.shape:
        raise bad_argument(
            "model",
            "a causal language model whose forward(ids) gives logits (b, n, vocab), or an output with .logits",
            f"a {type(model).__name__} returning {describe(out)}",
            "pass a multihead.lab.models.Decoder, or a transformers *ForCausalLM loaded with "
            'attn_implementation="multihead"',
            kind=TypeError,
        )
    return logits


def logit_difference(logits: torch.Tensor, answer: torch.Tensor, wrong: torch.Tensor) -> torch.Tensor:
    """logit(answer) - logit(wrong) at the last position of each row: (rows,), in float32 or the logits' wider
    dtype. ``logits`` (rows, n, vocab) holds copies of b prompts one after another (rows a multiple of b); answer
    and wrong are (b,)."""
    last = logits[:, -1].to(torch.promote_types(logits.dtype, torch.float32))  # (rows, vocab)
    copies = last.shape[0] // answer.shape[0]
    rows = torch.arange(last.shape[0], device=last.device)
    return last[rows, answer.repeat(copies)] - last[rows, wrong.repeat(copies)]


def record(
    model: nn.Module, sites: Sequence[AttentionSite], ids: torch.Tensor, what: str
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Run ``model`` on ``ids`` recording ``what`` at every step; returns (logits, {layer: that step's ``what``,
    (b, heads or positions ...)})."""
    values: dict[int, torch.Tensor] = {}
    handles = []
    for layer, site in enumerate(sites):
        handles.append(site.attend.register_forward_hook(_recorder(what, layer, values), with_kwargs=True))
    try:
        logits = logits_of(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    return logits, values


def step_weights(module, args: tuple, kwargs: dict) -> torch.Tensor:
    """The attention weights (b, h, i, j) of one step's call, from its own inputs and mask: one more kernel call,
    made only where a pattern is read."""
    q, k, v = args[:3]
    weights = attention_result(
        q,
        k,
        v,
        mask=kwargs.get("mask"),
        causal=kwargs.get("causal", False),
        scale=kwargs.get("scale"),
        backend=module.backend,
        return_weights=True,
    ).weights
    assert weights is not None  # asked for
    return weights


def _recorder(what: str, layer: int, values: dict[int, torch.Tensor]):
    def hook(module, args, kwargs, result):
        if what in INPUTS:
            value = args[INPUTS[what]]
        elif what == "z":
            value = result.output
        else:
            value = step_weights(module, args, kwargs)
        values[layer] = value.detach().clone()

    return hook


def checked_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise bad_argument(name, f"one of {list(choices)}", repr(value), f'pass e.g. {name}="{choices[0]}"')
    return str(value)


def checked_batch_size(batch_size: object) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise bad_argument("batch_size", "a positive int", describe(batch_size), "pass e.g. batch_size=16")


@dataclass
class Prepared:
    part: str
    sites: list[AttentionSite]
    clean_ids: torch.Tensor
    corrupt_ids: torch.Tensor
    answer: torch.Tensor
    wrong: torch.Tensor
    clean: dict[int, torch.Tensor]  # {layer: the clean run's activation}
    clean_difference: float
    corrupt_difference: float


def prepare(model, clean_ids, corrupt_ids, answer, wrong, what, by, part) -> Prepared:
    """Every argument checked, then the clean run recorded and both runs' logit differences measured."""
    what = checked_choice("what", what, WHATS)
    checked_choice("by", by, BYS)
    clean_ids, corrupt_ids = checked_prompts(clean_ids, corrupt_ids)
    part, sites = part_sites(model, part)
    clean_logits, clean = record(model, sites, clean_ids, what)
    vocab, batch, device = clean_logits.shape[-1], clean_ids.shape[0], clean_logits.device
    answer = checked_tokens("answer", answer, batch, vocab, device)
    wrong = checked_tokens("wrong", wrong, batch, vocab, device)
    if bool((answer == wrong).any()):
        raise bad_argument("wrong", "a token other than the answer", wrong.tolist(), "pass the competing token")
    clean_difference = float(logit_difference(clean_logits, answer, wrong).mean())
    corrupt_difference = float(logit_difference(logits_of(model, corrupt_ids), answer, wrong).mean())
    if not abs(clean_difference - corrupt_difference) > 1e-6 * max(1.0, abs(clean_difference)):
        raise bad_argument(
            "corrupt_ids",
            "a prompt whose logit difference differs from the clean one's (the scores divide by clean - corrupt)",
            f"both {clean_difference:.6g}",
            "corrupt the part of the prompt the answer depends on",
        )
    return Prepared(
        part, list(sites), clean_ids, corrupt_ids, answer, wrong, clean, clean_difference, corrupt_difference
    )
