"""A transformers model on ``attn_implementation="multihead"`` with its sequence split across ranks: ring or Ulysses
attention on every attention module, each rank holding n/P positions.

    split = context_parallel(model, mesh["cp"], method="ring", layout="zigzag")
    mine = zigzag_shard(input_ids, rank, P, dim=1)              # (b, n/P): this rank's positions of (b, n)
    logits = model(input_ids=mine).logits                       # (b, n/P, vocab): the same positions of the logits
    split.remove()                                              # the model back on one rank (or: with ...: ...)

Every rank holds the whole model (replicated weights, as under data parallelism) and this rank's shard of the
sequence. :func:`context_parallel` sets a :class:`multihead.parallel.SequenceSplit` on every attention module of the
model (``attention_forward`` then runs the call through the module's ``Attend`` with the split as its kernel, so
head gates and ablations act on it) and hooks the model's calls so that nothing reads the shard as if it were the
whole sequence:

- **positions**: the model's base model (``model.base_model``, the module that numbers the tokens and builds the
  masks) is given ``position_ids`` = the shard's global positions on every call, so the model is called whole (or
  its base model: a decoder layer called alone takes its positions from its caller). Left to itself transformers
  would number the shard 0 .. n/P - 1 and rotate q and k at the wrong positions, so position ids given by the caller
  are refused: the only ones served are those the split computes, and a check of given ones would read a device
  tensor on the host (positions that restart, packed documents, are not served either).
- **masks**: the attention gets transformers' mask of the shard; only what says the same on global positions is
  taken from it, the causal band and a sliding window (``masks.causal()`` / ``masks.window(w - 1, 0)`` on global
  positions), with Gemma 2's soft-cap; learned sinks go to the split. The base model is given an all-True
  ``attention_mask`` of the shard: with none, transformers reads a zigzag shard's jump in positions as two packed
  documents.
- **refused, by name**: a caller's ``attention_mask`` (padding), ``position_ids``, a KV cache (``past_key_values``,
  ``cache`` or ``use_cache=True``; ``use_cache`` is set False when not given), ``output_attentions``, ``labels`` (the
  model would shift them by one inside the shard: shift on the whole sequence first, see docs/parallel.md), dense
  mask tensors (or_masks, chunked attention: no global meaning), bidirectional attention, attention dropout in
  training, cross-attention, encoder-decoder models, T5's position bias and sparse-index picks. Rows with every key
  masked do not occur under causal self-attention, so eager's rule for them (transformers_rows) is not needed.

The loss of a causal LM: shift the labels on the whole sequence (``labels[t] = ids[t + 1]``, -100 at the end), shard
them like the ids, sum each rank's token losses and divide by the global token count; the gradients summed over the
ranks (an all-reduce, as data parallelism sums a replicated weight's) are the one-process model's. The recipe is in
docs/parallel.md, "transformers models across ranks".
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedModel

from multihead import masks
from multihead._errors import InputError, bad_argument, describe
from multihead.functional import _refuse_torch_context_parallel
from multihead.integrations import transformers as integration
from multihead.integrations.transformers_masks import TransformersMask
from multihead.parallel.sequence import SequenceSplit

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.hooks import RemovableHandle

__all__ = ["ContextParallelHandle", "context_parallel"]

_NAME = "context_parallel"
# the names a KV cache comes under: transformers 5.24 renames past_key_values to cache inside forward, after the hook
_CACHE_NAMES = ("past_key_values", "cache")
# what the sites refuse outright: keywords that hold (i, j) entries or picks of one rank's shard
_SHARD_KEYWORDS = {
    "position_bias": "T5's relative position bias, whose (i, j) entries are one rank's,",
    "indices": "a sparse-index indexer's picks, key indices of one rank's shard,",
    "block_indices": "a sparse-index indexer's block picks, blocks of one rank's shard,",
}


class ContextParallelHandle:
    """The split :func:`context_parallel` set on a model: ``remove()`` (or leaving its ``with`` block) takes it off
    every attention module and removes its hooks; the model then runs on one rank as before.

    ``split``: the :class:`multihead.parallel.SequenceSplit` every attention module runs; ``sites``: the modules'
    paths in the model; ``positions(length, device)``: the (length,) global positions of this rank's shard of
    ``length`` = n/P positions, the ``position_ids`` the model is given.
    """

    def __init__(self, model: nn.Module, split: SequenceSplit, modules: dict[str, nn.Module]):
        self.model, self.split = model, split
        self.sites = tuple(modules)
        self._modules = modules
        self._hooks: list[RemovableHandle] = []
        self.removed = False

    def positions(self, length: int, device: torch.device | str) -> torch.Tensor:
        return self.split.positions(length, torch.device(device))

    def remove(self) -> None:
        """Take the split off the model (idempotent)."""
        for module in self._modules.values():
            module.__dict__.pop(integration.SPLIT_ATTRIBUTE, None)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.removed = True

    def __enter__(self) -> ContextParallelHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self.sites)} attention modules"
        return f"ContextParallelHandle({self.split.method}, {self.split.layout}; {state})"


def context_parallel(
    model: nn.Module,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    *,
    method: str = "ring",
    layout: str = "zigzag",
) -> ContextParallelHandle:
    """Split the sequence of a transformers model running ``attn_implementation="multihead"`` across the ranks of
    ``group`` (a process group, a one-dimensional ``DeviceMesh`` such as ``mesh["cp"]``, or None for the default
    group), in place, on every rank.

    Every call then takes this rank's shard of the sequence in ``layout``, ``input_ids`` (b, n/P) or
    ``inputs_embeds`` (b, n/P, d) as :func:`multihead.parallel.zigzag_shard` (``layout="zigzag"``, the default: the
    causal work balanced) or ``torch.chunk(x, P, dim=1)[rank]`` (``"contiguous"``) makes it, and returns this rank's
    shard of the outputs (logits (b, n/P, vocab)), equal to those positions of the one-process model's. ``method``:
    "ring" (any head count) or "ulysses" (P must divide the query heads). What is served and refused: the module
    docstring. Returns the handle that undoes it (``remove()``, or use it as a context manager): a split usually lasts
    a whole training run, across steps, optimizer and checkpoints, not one block of code.
    """
    if not isinstance(model, PreTrainedModel):
        raise bad_argument(
            "model",
            'a transformers PreTrainedModel running attn_implementation="multihead"',
            describe(model),
            'load it with from_pretrained(..., attn_implementation="multihead")',
            kind=TypeError,
        )
    split = SequenceSplit(group, method, layout)  # checks the method and the layout
    split.positions(2, torch.device("cpu"))  # resolves the group: a bad one, or none initialised, said now
    if getattr(model.config, "is_encoder_decoder", False):
        raise bad_argument(
            "model",
            "a decoder-only model (causal self-attention) for the sequence split",
            f"the encoder-decoder {type(model).__name__}",
            "run encoder-decoder models on one rank: their cross-attention and the encoder's padding are not split",
        )
    sites = integration.attention_sites(model)  # refuses a model not on "multihead"
    assert sites is not None  # a PreTrainedModel's sites are a list (or a refusal)
    cross = [site.name for site in sites if site.part != "self"]
    if cross:
        raise bad_argument(
            "model",
            "a model whose attention is all self-attention (the sequence split attends the shard to itself)",
            f"{type(model).__name__} with cross-attention at {', '.join(cross[:3])}",
            "run the model on one rank",
        )
    modules = {site.name: model.get_submodule(site.name) for site in sites}
    already = [name for name, module in modules.items() if integration.SPLIT_ATTRIBUTE in module.__dict__]
    if already:
        raise bad_argument(
            "model",
            "a model whose sequence is not split yet",
            f"a model split already (at {already[0]})",
            "call context_parallel once per model, or remove() the split first",
        )
    base = model.base_model
    assert isinstance(base, nn.Module)  # a PreTrainedModel's base model is itself or its stack
    parameters = inspect.signature(base.forward).parameters
    if "position_ids" not in parameters:
        raise bad_argument(
            "model",
            "a model whose base model takes position_ids (the split gives each rank its shard's global positions)",
            f"{type(base).__name__}.forward without position_ids",
            "run the model on one rank",
        )
    handle = ContextParallelHandle(model, split, modules)
    for module in modules.values():
        object.__setattr__(module, integration.SPLIT_ATTRIBUTE, _SiteSplit(split))  # past nn.Module's registration
    handle._hooks.append(base.register_forward_pre_hook(_shard_arguments(handle, base), with_kwargs=True))
    if base is not model:
        handle._hooks.append(model.register_forward_pre_hook(_refuse_labels(model), with_kwargs=True))
    return handle


def _positional_names(module: nn.Module) -> list[str]:
    """The names of the parameters of ``module.forward`` that may come by position, in order."""
    return [
        parameter.name
        for parameter in inspect.signature(module.forward).parameters.values()
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]


def _named(names: list[str], args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by name: the positional ones named by ``names`` (the forward's), then the keywords."""
    if len(args) > len(names):
        raise bad_argument(
            "model(...)",
            f"at most {len(names)} positional arguments ({', '.join(names)}), the others by name",
            f"{len(args)} positional arguments",
            "pass the inputs by name, e.g. model(input_ids=ids)",
            kind=TypeError,
        )
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _refused(name: str, expected: str, got: object, fix: str) -> Exception:
    return bad_argument(name, f"{expected} ({_NAME}: the sequence is split across ranks)", got, fix)


def _refuse_labels(model: nn.Module):
    names = _positional_names(model)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        labels = _named(names, args, kwargs).get("labels")
        if labels is not None:
            raise _labels_refused(labels)

    return hook


def _labels_refused(labels: object) -> Exception:
    return _refused(
        "labels",
        "None: the model would shift them by one inside this rank's shard, where position t + 1 of the sequence "
        "is often on another rank",
        describe(labels),
        "shift the labels on the whole sequence (labels[t] = ids[t + 1], -100 at the end), shard them like the "
        "ids and compute the loss from the logits: the recipe in docs/parallel.md",
    )


def _shard_arguments(handle: ContextParallelHandle, base: nn.Module):
    takes_mask = "attention_mask" in inspect.signature(base.forward).parameters
    names = _positional_names(base)

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        named = _named(names, args, kwargs)
        if named.get("attention_mask") is not None:
            raise _refused(
                "attention_mask",
                "None: sequences without padding (padding is not served)",
                describe(named["attention_mask"]),
                "leave attention_mask out and shard unpadded sequences of the same length n (a multiple of P, of 2P "
                "for the zigzag layout)",
            )
        if named.get("position_ids") is not None:
            raise _refused(
                "position_ids",
                "None: the split gives each rank its shard's global positions (packed documents are not served)",
                describe(named["position_ids"]),
                "leave position_ids out",
            )
        for name in _CACHE_NAMES:  # one name in the message, whichever the model's forward renamed it to
            if named.get(name) is not None:
                got = f"a {type(named[name]).__name__} (as {name})"
                raise _refused("past_key_values", "None: no KV cache", got, "leave past_key_values out")
        if named.get("use_cache"):
            raise _refused("use_cache", "False: no KV cache", True, "pass use_cache=False, or leave it out")
        if named.get("output_attentions") or getattr(module.config, "output_attentions", False):
            raise _refused(
                "output_attentions",
                "False: no rank forms the attention weights of a split sequence",
                True,
                "pass output_attentions=False (and set config.output_attentions = False); look at the weights of a "
                "sequence that fits one rank",
            )
        tokens = named.get("input_ids")
        if tokens is None:
            tokens = named.get("inputs_embeds")
        if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
            raise _refused(
                "input_ids",
                "this rank's shard of the tokens, input_ids (b, n/P) or inputs_embeds (b, n/P, d)",
                describe(tokens),
                "pass input_ids=zigzag_shard(ids, rank, P, dim=1) (or the contiguous chunk, as the layout says)",
            )
        batch, length = tokens.shape[0], tokens.shape[1]
        named["position_ids"] = handle.positions(length, tokens.device)[None, :]  # (1, n/P), as transformers' own
        if takes_mask:  # all True: with None, transformers reads a zigzag shard's jump as two packed documents
            named["attention_mask"] = torch.ones((batch, length), dtype=torch.bool, device=tokens.device)
        named["use_cache"] = False
        return (), named

    return hook


class _SiteSplit:
    """One attention module's sequence split: called by ``attention_forward`` in place of its own path, with its
    arguments; the mask read for what it says on global positions, everything else refused by name."""

    def __init__(self, split: SequenceSplit):
        self.split = split

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: masks.Mask | torch.Tensor | None,
        dropout: float,
        scaling: float | None,
        is_causal: bool | None,
        kwargs: dict,
    ) -> tuple[torch.Tensor, None]:
        """query (b, h, n/P, d), key (b, g, n/P, d), value (b, g, n/P, e): this rank's shard -> (output
        (b, n/P, h, e), None)."""
        try:  # before any collective, so that every rank refuses at the same point
            _refuse_torch_context_parallel()
        except InputError as error:  # the fix for a model split already: leave torch's context
            raise error.about(
                "attention",
                fix="call the model outside torch's context_parallel (accelerate's maybe_context_parallel): "
                "multihead's context_parallel(model, ...) splits the sequence itself, given each rank's shard",
            ) from None
        integration._check_keywords(module, kwargs)
        site = type(module).__name__
        for name, what in _SHARD_KEYWORDS.items():
            if kwargs.get(name) is not None:
                raise _refused(
                    name, f"None: {what} cannot be split", f"{site} passes {name}", "run the model on one rank"
                )
        if integration._weights_asked(module, kwargs):
            raise _refused(
                "output_attentions",
                "False: no rank forms the attention weights of a split sequence",
                f"{site} asks for them",
                "pass output_attentions=False (and set config.output_attentions = False)",
            )
        if query.shape[-2] != key.shape[-2]:
            raise _refused(
                "key",
                f"self-attention of this rank's shard, as many keys as queries ({query.shape[-2]})",
                f"{key.shape[-2]} keys from {site} (a KV cache or cross-attention)",
                "run the model without a cache (use_cache=False) and on self-attention only",
            )
        if module.training and dropout > 0:
            raise _refused(
                "dropout",
                "0 in training (attention dropout is not implemented across ranks)",
                f"{site}'s attention_dropout = {dropout}",
                "load the model with attention_dropout=0.0 (from_pretrained(..., attention_dropout=0.0)), or call "
                "model.eval()",
            )
        mask = _global_mask(module, attention_mask, is_causal)
        softcap = kwargs.get("softcap")
        if softcap is not None:  # Gemma 2: cap * tanh(s / cap) on the scaled scores, the same on every rank
            mask = masks.all_of(masks.softcap(float(softcap)), mask)
        result = integration._seam(module)(
            query,
            key,
            value,
            mask=mask,
            scale=scaling,
            dropout=dropout,
            training=module.training,
            sinks=integration._sinks(kwargs),
            kernel=self.split,
        )
        return result.output.transpose(1, 2).contiguous(), None


def _global_mask(module: nn.Module, attention_mask: object, is_causal: bool | None) -> masks.Mask:
    """The mask of a call on this rank's shard as a typed mask on global positions: the causal band, narrowed by a
    sliding window. transformers built ``attention_mask`` for the shard's (n/P, n/P) entries; only its band (which
    pairs of relative positions it keeps) means the same on the whole sequence, so any other term is refused."""
    site = type(module).__name__
    if attention_mask is None:  # transformers leaves a causal mask out; a bidirectional one too
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        if not causal:
            raise _refused(
                "attention_mask",
                "a causal self-attention (a decoder's)",
                f"{site} attending both ways (no mask, not causal)",
                "run the model on one rank",
            )
        return masks.causal()
    if not isinstance(attention_mask, masks.Mask):
        raise _refused(
            "attention_mask",
            "transformers' causal or sliding-window mask as a typed mask (a tensor's (i, j) entries are one rank's)",
            f"{describe(attention_mask)} from {site} (or_masks, chunked or blockwise attention, a prepared 4-D mask)",
            "run the model on one rank",
        )
    left: int | None = None
    right: int | None = None
    for term in attention_mask.terms():
        band = term.key_band()
        if band is None:
            what = {"padding": "padding", "documents": "packed documents"}.get(term.kind, f"the term {term!r}")
            raise _refused(
                "attention_mask",
                "only the causal band and a sliding window: a mask of the shard says nothing else of the sequence",
                f"{what} from {site}",
                "leave attention_mask and position_ids out, and shard unpadded sequences",
            )
        left, right = masks.band_intersection((left, right), band)
    if right != 0:
        raise _refused(
            "attention_mask",
            "a causal band (no key after the query)",
            f"{attention_mask!r} from {site}" if isinstance(attention_mask, TransformersMask) else repr(attention_mask),
            "run the model on one rank",
        )
    return masks.causal() if left is None else masks.window(left, 0)
