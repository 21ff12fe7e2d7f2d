"""Modules loaded when first touched as attributes of their package (``multihead.cost``, ``multihead.lab.inspect``)."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


def submodule_on_first_use(package: str, name: str) -> ModuleType:
    """``package.name`` imported, where ``name`` is a public module of ``package`` (no leading underscore); else
    the AttributeError Python gives for a missing attribute. The one rule by which ``multihead`` and
    ``multihead.lab`` load their modules on first use (only what is touched is imported: the lab, the cost model,
    transformers' integration)."""
    if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
        return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
