"""One format for every user-facing error: which argument, what was expected, what came, how to fix.

Errors about the caller's input derive from :class:`InputError` as well as from the usual
ValueError / TypeError, so code can catch them the plain way (``except ValueError``) while the
command line tells a user's mistake (one line, no traceback) from a bug in multihead (a traceback).
"""

from __future__ import annotations

import contextlib
import numbers
import re
from collections.abc import Callable, Iterator
from typing import Literal, overload

import torch


class InputError(Exception):
    """Marks an error as the caller's mistake (a bad argument, an unreadable file), not multihead's bug.

    Built by :func:`bad_argument`, it keeps its parts as fields: ``argument`` (what the caller passed), ``expected``,
    ``got`` and ``fix``; its message is "<argument>: expected <expected>, got <got>. Fix: <fix>". An error made
    from a message alone (another library's words) has no fields (all None). Code that says the error in other
    words (the command line names its options) builds a new one from the fields (:meth:`about`), never by taking
    the message apart.
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        argument: str | None = None,
        expected: str | None = None,
        got: str | None = None,
        fix: str | None = None,
    ):
        if message is None:
            message = f"{argument}: expected {expected}, got {got}. Fix: {fix}"
        super().__init__(message)
        self.argument, self.expected, self.got, self.fix = argument, expected, got, fix

    def __reduce__(self):  # the fields travel too (an error raised in another process, a pickled result)
        fields = {"argument": self.argument, "expected": self.expected, "got": self.got, "fix": self.fix}
        return _rebuilt, (type(self), str(self), fields)

    def about(self, argument: str, *, expected: str | None = None, fix: str | None = None) -> InputError:
        """The same error, of the same kind, about ``argument`` (``expected`` and ``fix`` replaced when given): the
        command line's option for the library's argument. An error without fields gets ``argument`` in front of
        its message."""
        if self.argument is None:
            return type(self)(f"{argument} {self}")
        return type(self)(
            argument=argument,
            expected=self.expected if expected is None else expected,
            got=self.got,
            fix=self.fix if fix is None else fix,
        )


def _rebuilt(kind: type[InputError], message: str, fields: dict) -> InputError:
    return kind(message, **fields)


@contextlib.contextmanager
def items_renamed(inner: str, label: Callable[[int], str], *, single: str | None = None) -> Iterator[None]:
    """Within the block, an InputError about item i of a list the block handed on (argument ``inner``[i], or
    ``single`` where the callee names a list of one item so) is about ``label(i)``: the caller's own name and
    numbering of that item (``texts[5]`` of a batch -> the caller's ``texts[21]``; ``corpus[3]`` -> ``--corpus
    line 7``). Other errors pass through as they are."""
    try:
        yield
    except InputError as error:
        found = re.fullmatch(rf"{re.escape(inner)}\[(\d+)\]", error.argument or "")
        if found is not None:
            raise error.about(label(int(found.group(1)))) from None
        if single is not None and error.argument == single:
            raise error.about(label(0)) from None
        raise


class ArgumentValueError(InputError, ValueError):
    """A ValueError about an argument the caller passed."""


class ArgumentTypeError(InputError, TypeError):
    """A TypeError about an argument the caller passed."""


class MissingFileError(InputError, FileNotFoundError):
    """A path the caller gave does not exist (catchable as FileNotFoundError, marked as the caller's mistake)."""


_INPUT_KINDS: dict[type[Exception], type[Exception]] = {
    ValueError: ArgumentValueError,
    TypeError: ArgumentTypeError,
    FileNotFoundError: MissingFileError,
}


def bad_argument(name: str, expected: str, got: object, fix: str, *, kind: type[Exception] = ValueError) -> Exception:
    """Build (not raise) an exception whose message names the argument, expected vs actual, and the fix.

    ``kind`` ValueError, TypeError or FileNotFoundError gives the :class:`InputError` subclass of it; any other class
    (one that derives from :class:`InputError`, such as compat's torch-style errors) is used as given.
    """
    made = _INPUT_KINDS.get(kind, kind)
    if not issubclass(made, InputError):
        return made(f"{name}: expected {expected}, got {got}. Fix: {fix}")
    return made(argument=name, expected=expected, got=str(got), fix=fix)


def whole_sentences(text: str, limit: int = 240) -> str:
    """Another library's message for one line of ours: its white space folded, and as many whole sentences as fit
    in ``limit`` characters (a first sentence longer than that is cut at a word, with "..."): never mid-sentence."""
    folded = " ".join(text.split())
    kept = ""
    for sentence in re.split(r"(?<=[.!?])\s+", folded):
        candidate = f"{kept} {sentence}".strip()
        if len(candidate) > limit:
            break
        kept = candidate
    if kept:
        return kept
    return folded[:limit].rsplit(" ", 1)[0] + " ..." if len(folded) > limit else folded


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


def checked_flag(name: str, value: object) -> bool:
    """Validate a switch: TypeError unless True or False (1, "yes" and None are refused, not read as truth)."""
    if not isinstance(value, bool):
        raise bad_argument(name, "True or False", describe(value), f"pass {name}=True or {name}=False", kind=TypeError)
    return value


def checked_probability(name: str, value: object) -> float:
    """Validate a dropout-like probability: TypeError unless a real number (not bool), ValueError outside [0, 1)
    (NaN included). The one check of ``attention``, the layer and compat."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise bad_argument(name, "a probability in [0, 1)", describe(value), f"pass e.g. {name}=0.1", kind=TypeError)
    if value < 0.0 or not value < 1.0:  # NaN fails the second test: rejected too
        raise bad_argument(name, "a probability in [0, 1)", value, f"pass e.g. {name}=0.1, or 0.0 for none")
    return float(value)


def positive_int(name: str, value: object) -> int:
    """Validate a size option: TypeError unless an int (not bool), ValueError unless >= 1."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_argument(name, "a positive int", describe(value), f"pass a whole number for {name}", kind=TypeError)
    if value < 1:
        raise bad_argument(name, "a positive int", value, f"pass {name} >= 1")
    return value


FLOATING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@overload
def floating_dtype(name: str, value: object, *, allow_none: Literal[False]) -> torch.dtype: ...
@overload
def floating_dtype(name: str, value: object, *, allow_none: bool = True) -> torch.dtype | None: ...
def floating_dtype(name: str, value: object, *, allow_none: bool = True) -> torch.dtype | None:
    """A real floating torch.dtype (float16, bfloat16, float32, float64), or None when allowed."""
    if value is None and allow_none:
        return None
    if not isinstance(value, torch.dtype):
        raise bad_argument(
            name,
            "a torch.dtype such as torch.float32",
            describe(value),
            f"pass {name}=torch.float32 (a torch.dtype, not a string)",
            kind=TypeError,
        )
    if value not in FLOATING_DTYPES:
        raise bad_argument(
            name, "a real floating dtype (float16, bfloat16, float32 or float64)", value, f"pass {name}=torch.float32"
        )
    return value


@overload
def usable_device(name: str, value: object, *, allow_none: Literal[False]) -> torch.device: ...
@overload
def usable_device(name: str, value: object, *, allow_none: bool = True) -> torch.device | None: ...
def usable_device(name: str, value: object, *, allow_none: bool = True) -> torch.device | None:
    """A torch.device (or a string naming one) that this build of torch can allocate on, or None when allowed."""
    if value is None and allow_none:
        return None
    if not isinstance(value, (str, torch.device, int)) or isinstance(value, bool):
        raise bad_argument(
            name,
            "a torch.device, a device string such as 'cpu', or a device index",
            describe(value),
            f"pass {name}='cpu'",
            kind=TypeError,
        )
    try:
        device = torch.device(value)
        torch.empty(0, device=device)  # an unknown or absent device (no CUDA here, a bad index) fails now
    except (RuntimeError, AssertionError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise bad_argument(
            name,
            "a device this torch can use (e.g. 'cpu')",
            f"{value!r} ({reason})",
            f"pass {name}='cpu', or a device listed by torch",
        ) from None
    return device
