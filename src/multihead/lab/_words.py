"""Counts in words, said the same way in every report, repr and message: "1 layer", "6 layers"."""

from __future__ import annotations

__all__ = ["counted"]


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, the noun plural unless the count is one: counted(1, "layer") -> "1 layer",
    counted(12, "head") -> "12 heads" (``plural`` for a noun that does not take an s)."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"
