"""One format for every user-facing error: which argument, what was expected, what came, how to fix.

Errors about the caller's input derive from :class:`InputError` as well as from the usual
ValueError / TypeError, so code can catch them the plain way (``except ValueError``) while the
command line tells a user's mistake (one line, no traceback) from a bug in multihead (a traceback).
"""

from __future__ import annotations


class InputError(Exception):
    """Marks an error as the caller's mistake (a bad argument, an unreadable file), not multihead's bug."""


class ArgumentValueError(InputError, ValueError):
    """A ValueError about an argument the caller passed."""


class ArgumentTypeError(InputError, TypeError):
    """A TypeError about an argument the caller passed."""


_INPUT_KINDS: dict[type[Exception], type[Exception]] = {ValueError: ArgumentValueError, TypeError: ArgumentTypeError}


def bad_argument(name: str, expected: str, got: object, fix: str, *, kind: type[Exception] = ValueError) -> Exception:
    """Build (not raise) an exception whose message names the argument, expected vs actual, and the fix.

    ``kind`` ValueError or TypeError gives the :class:`InputError` subclass of it; any other class
    (one that derives from :class:`InputError`, such as compat's torch-style errors) is used as given.
    """
    return _INPUT_KINDS.get(kind, kind)(f"{name}: expected {expected}, got {got}. Fix: {fix}")


def describe(value: object) -> str:
    """Short description of a value for error messages: tensors by shape and dtype, others by type."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"tensor of shape {tuple(shape)} and dtype {dtype}"
    text = repr(value)
    if len(text) > 80:  # a huge list or string would drown the message
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def positive_int(name: str, value: object) -> int:
    """Validate a size option: TypeError unless an int (not bool), ValueError unless >= 1."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_argument(name, "a positive int", describe(value), f"pass a whole number for {name}",
                           kind=TypeError)
    if value < 1:
        raise bad_argument(name, "a positive int", value, f"pass {name} >= 1")
    return value
