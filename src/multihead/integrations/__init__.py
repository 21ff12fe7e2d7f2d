"""Other libraries' models on multihead's kernel. Each integration imports its library; nothing else here does.

``multihead.integrations.transformers`` (the ``hf`` extra) puts a transformers model's attention on the kernel and
needs nothing of the lab; ``multihead.integrations.transformers_parallel`` splits such a model's sequence across
ranks. :func:`load_text_model` and :func:`load_causal_lm` (in
:mod:`multihead.integrations.folders`) open any ``--model`` folder as the lab's models, so they load the lab when
first touched: ``pip install 'multihead[hf]'`` alone runs the integration without the lab.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from multihead._modules import submodule_on_first_use
from multihead.integrations.transformers_versions import TRANSFORMERS_TESTED, UnsupportedTransformersError

if TYPE_CHECKING:  # what the loaders are, for type checkers; at run time they load on first use (below)
    from multihead.integrations.folders import load_causal_lm, load_text_model

__all__ = ["TRANSFORMERS_TESTED", "UnsupportedTransformersError", "load_text_model", "load_causal_lm"]

# the folder loaders build the lab's models: loaded on first use, so the integration alone needs no lab package
_FOLDER_LOADERS = ("load_text_model", "load_causal_lm")


def __getattr__(name: str):
    if name in _FOLDER_LOADERS:
        return getattr(importlib.import_module("multihead.integrations.folders"), name)
    return submodule_on_first_use(__name__, name)  # multihead.integrations.transformers, ...
