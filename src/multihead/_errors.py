"""One format for every user-facing error: which argument, what was expected, what came, how to fix."""

from __future__ import annotations


def bad_argument(name: str, expected: str, got: object, fix: str, *, kind: type[Exception] = ValueError) -> Exception:
    """Build (not raise) an exception whose message names the argument, expected vs actual, and the fix."""
    return kind(f"{name}: expected {expected}, got {got}. Fix: {fix}")


def describe(value: object) -> str:
    """Short description of a value for error messages: tensors by shape and dtype, others by type."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"tensor of shape {tuple(shape)} and dtype {dtype}"
    return f"{type(value).__name__} {value!r}"


def positive_int(name: str, value: object) -> int:
    """Validate a size option: TypeError unless an int (not bool), ValueError unless >= 1."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_argument(name, "a positive int", describe(value), f"pass a whole number for {name}",
                           kind=TypeError)
    if value < 1:
        raise bad_argument(name, "a positive int", value, f"pass {name} >= 1")
    return value
