"""Recording per-head attention moved to the core, :mod:`multihead.capture` (it needs only torch); this path
stays for this release. ``multihead.inspect.capture(model)`` is the same function."""

from multihead.capture import Recorder, attention_layers, attention_sites, capture, part_sites

__all__ = ["capture", "Recorder", "attention_layers", "attention_sites", "part_sites"]
