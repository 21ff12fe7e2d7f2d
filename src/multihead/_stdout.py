"""Standard output whose reader has gone: the one place that silences it (shared by the CLI and the lab's consoles)."""

from __future__ import annotations

import os
import sys

__all__ = ["discard_stdout"]


def discard_stdout() -> None:
    """Send the rest of stdout to the null device: its reader has gone (``multihead inspect | head``, ``less``
    quit), so what is still to print, and what is buffered, goes nowhere instead of failing (EPIPE) again, at
    the next print or at exit."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor: nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, descriptor)
    finally:
        os.close(devnull)
