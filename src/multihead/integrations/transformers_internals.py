"""The transformers internals the integration relies on, imported here and nowhere else.

transformers' public API lets a library add an attention implementation (``AttentionInterface``,
``AttentionMaskInterface``), but the mask functions its models hand to the mask interface live in
``transformers.masking_utils``, which has no stable API and changes between releases. To give the kernel typed
masks, :mod:`multihead.integrations.transformers_masks` reads them: it recognises the mask functions below by
identity and the closures their factories build by code object and free variables, and hands the rest to
``sdpa_mask``. Every such name is looked up here when the integration is imported; on a transformers that lacks
one (or whose factories no longer build the closures read), the import raises
:class:`multihead.integrations.UnsupportedTransformersError`, one line naming what is missing, the installed
version, the range the integration is tested on (:data:`multihead.integrations.TRANSFORMERS_TESTED`) and the pip
command that installs a tested version.

Internals relied on (docs/transformers.md lists them with the versions tested):

- ``transformers.AttentionInterface`` and ``transformers.AttentionMaskInterface`` (public; registered with);
- ``transformers.masking_utils``: ``and_masks``, ``causal_mask_function``, ``bidirectional_mask_function``,
  ``sliding_window_overlay``, ``sliding_window_bidirectional_overlay``, ``sdpa_mask``;
- the closures of ``and_masks`` (``and_masks.<locals>.and_mask`` over ``mask_functions``),
  ``sliding_window_overlay`` and ``sliding_window_bidirectional_overlay`` (``<factory>.<locals>.inner_mask``
  over ``sliding_window``);
- the arguments transformers passes to a mask interface function: ``sdpa_mask``'s parameters
  (:data:`SDPA_MASK_PARAMETERS`; before 5.4 it took ``cache_position`` instead of ``q_length`` and ``q_offset``);
- a model config's private ``_attn_implementation`` (:func:`attn_implementation`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import CodeType
from typing import Any, NamedTuple

import torch
import transformers
from transformers import masking_utils

from multihead.integrations.transformers_versions import TRANSFORMERS_TESTED, UnsupportedTransformersError

__all__ = [
    "AND_MASKS",
    "PACKED",
    "SLIDING_WINDOW",
    "SLIDING_WINDOW_BIDIRECTIONAL",
    "AttentionInterface",
    "AttentionMaskInterface",
    "and_masks",
    "attn_implementation",
    "bidirectional_mask_function",
    "causal_mask_function",
    "Closure",
    "check",
    "eager_mask",
    "sdpa_mask",
    "sliding_window_bidirectional_overlay",
    "sliding_window_overlay",
]

# The names of transformers the integration registers with (public, but checked here as well: an older
# transformers without them gets the same one-line error)
TOP_LEVEL_NAMES = ("AttentionInterface", "AttentionMaskInterface")
# The parameters typed_mask takes as sdpa_mask does: the arguments transformers passes a mask interface function
SDPA_MASK_PARAMETERS = (
    "batch_size",
    "q_length",
    "kv_length",
    "q_offset",
    "kv_offset",
    "mask_function",
    "attention_mask",
    "local_size",
    "allow_is_causal_skip",
    "allow_is_bidirectional_skip",
    "use_vmap",
    "device",
)
# The names of transformers.masking_utils the integration imports (below, and only here)
MASKING_NAMES = (
    "and_masks",
    "bidirectional_mask_function",
    "causal_mask_function",
    "eager_mask",
    "sdpa_mask",
    "sliding_window_bidirectional_overlay",
    "sliding_window_overlay",
)


def _unsupported(what: str) -> UnsupportedTransformersError:
    """One line: what is missing, the installed version, the tested range, and the pip command that installs it."""
    oldest, newest = TRANSFORMERS_TESTED
    return UnsupportedTransformersError(
        f"transformers: expected a version multihead's integration is tested on ({oldest} to {newest}), got "
        f"transformers {transformers.__version__}, {what}. Fix: pip install 'transformers>={oldest},<={newest}'"
    )


class Closure(NamedTuple):
    """A closure a masking_utils factory builds, as the integration recognises it: its code object and qualified
    name, and the free variable that holds the factory's argument."""

    code: CodeType
    qualname: str
    variable: str

    def built(self, fn: object) -> bool:
        """Whether ``fn`` is a closure this factory built (same code, same qualified name)."""
        return getattr(fn, "__code__", None) is self.code and getattr(fn, "__qualname__", "") == self.qualname


def _closure(factory: str, built: Callable, inner: str, variable: str) -> Closure:
    """The :class:`Closure` ``built`` (made by ``factory``) is, or the error when it is no longer that closure."""
    qualname, code = f"{factory}.<locals>.{inner}", getattr(built, "__code__", None)
    if (
        not isinstance(code, CodeType)
        or getattr(built, "__qualname__", "") != qualname
        or variable not in code.co_freevars
    ):
        raise _unsupported(f"whose transformers.masking_utils.{factory} no longer builds {qualname} over {variable!r}")
    return Closure(code, qualname, variable)


def check() -> tuple[Closure, Closure, Closure]:
    """Raise :class:`~multihead.integrations.UnsupportedTransformersError` unless transformers and its masking_utils
    have every name the integration imports; returns the closures of ``and_masks``, ``sliding_window_overlay`` and
    ``sliding_window_bidirectional_overlay`` the integration reads."""
    module: Any = masking_utils  # read by name: a missing one is our error, not an AttributeError
    for name in TOP_LEVEL_NAMES:
        if getattr(transformers, name, None) is None:
            raise _unsupported(f"which has no transformers.{name}")
    for name in MASKING_NAMES:
        if not callable(getattr(module, name, None)):
            raise _unsupported(f"whose transformers.masking_utils has no {name}")
    parameters = inspect.signature(module.sdpa_mask).parameters
    for name in SDPA_MASK_PARAMETERS:
        if name not in parameters:
            raise _unsupported(
                f"whose transformers.masking_utils.sdpa_mask (the mask interface's call) takes no {name}"
            )
    return (
        _closure("and_masks", module.and_masks(module.causal_mask_function), "and_mask", "mask_functions"),
        _closure("sliding_window_overlay", module.sliding_window_overlay(1), "inner_mask", "sliding_window"),
        _closure(
            "sliding_window_bidirectional_overlay",
            module.sliding_window_bidirectional_overlay(1),
            "inner_mask",
            "sliding_window",
        ),
    )


# the closures transformers_masks reads, checked with everything else the integration imports
AND_MASKS, SLIDING_WINDOW, SLIDING_WINDOW_BIDIRECTIONAL = check()


def _packed_closures() -> tuple[Closure, Closure] | None:
    """The closures transformers builds for packed sequences (position ids that restart, no attention mask):
    ``packed_sequence_mask_function(ids)`` (same document) and ``remap_positions_for_packed_sequence(fn,
    position_ids)`` (a mask function read at each token's position in its document). Optional: a transformers
    without them, or with them built otherwise, gives None, and packed sequences go to ``sdpa_mask``'s tensor."""
    module: Any = masking_utils
    same, remap = (
        getattr(module, name, None) for name in ("packed_sequence_mask_function", "remap_positions_for_packed_sequence")
    )
    if not (callable(same) and callable(remap)):
        return None
    ids = torch.zeros(1, 1, dtype=torch.long)
    try:
        return (
            _closure("packed_sequence_mask_function", same(ids), "inner_mask", "packed_sequence_mask"),
            _closure(
                "remap_positions_for_packed_sequence",
                remap(module.causal_mask_function, ids),
                "inner_mask",
                "position_ids",
            ),
        )
    except UnsupportedTransformersError:
        return None


PACKED = _packed_closures()  # (same document, remapped positions), or None

from transformers import AttentionInterface, AttentionMaskInterface  # noqa: E402 - once check() found them
from transformers.masking_utils import (  # noqa: E402 - only once check() has said every name is there
    and_masks,
    bidirectional_mask_function,
    causal_mask_function,
    eager_mask,
    sdpa_mask,
    sliding_window_bidirectional_overlay,
    sliding_window_overlay,
)


def attn_implementation(config: object) -> object:
    """The attention implementation a transformers config says its model runs (its ``_attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)
