"""Paths the user hands us: output folders to write into, text and JSON files to read.

Every way such a path can be wrong (a file where a folder should be, a folder under a file, no
permission, a virtual file system like /proc, bytes that are not UTF-8, text that is not JSON, JSON
of the wrong shape) becomes one :class:`~multihead._errors.InputError` naming the option the path
came from (``--out``, ``--corpus``, ...), in the house form ``"<option>: expected ..., got .... Fix: ..."``.
The command line prints those as one line; anything else that escapes is a bug and keeps its traceback.

    output_folder("--out", args.out, create=False)      # before the work: could it be made and written?
    folder = output_folder("--out", args.out)            # when writing: made, and known to be writable
    text = read_text("--corpus", path, what="a text file, one sentence per line", fix="pass a UTF-8 file")
    data = read_json("--scores", path, what="an importance.json", schema={"scores": Grid(NUMBER_OR_NULL)},
                     fix="run `multihead heads importance` first")
    with from_option("--model"):                         # "config.json: ..." -> "--model config.json: ..."
        model, _ = load_minilm(args.model)

JSON shapes are described with a small schema: a :class:`Rule` (one value), a ``dict`` (an object
with those keys; wrap a value in :class:`OptionalKey` when the key may be absent; other keys are
ignored), :class:`MapOf` (an object with any keys), :class:`ListOf` and :class:`Grid` (a rectangular
list of lists).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multihead._errors import InputError, MissingFileError, bad_argument, describe

__all__ = [
    "MissingFileError",
    "output_folder",
    "output_file",
    "writing",
    "read_text",
    "read_json",
    "check_json",
    "user_path",
    "path_kind",
    "existing_folder",
    "from_option",
    "from_options",
    "cli_spelling",
    "Rule",
    "OptionalKey",
    "ListOf",
    "MapOf",
    "Grid",
    "NUMBER",
    "NUMBER_OR_NULL",
    "POSITIVE_NUMBER",
    "POSITIVE_INT",
    "NON_NEGATIVE_INT",
    "STRING",
    "BOOLEAN",
    "ANY_OBJECT",
    "one_of",
    "nullable",
]


# File systems that are views of the kernel, not storage: reports written there vanish or fail oddly.
VIRTUAL_FILE_SYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "mqueue",
        "hugetlbfs",
        "fusectl",
        "binfmt_misc",
        "autofs",
        "efivarfs",
        "rpc_pipefs",
    }
)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount, longest mount point first; empty off Linux."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as lines:
            entries = [line.split()[1:3] for line in lines if len(line.split()) >= 3]
    except OSError:
        return []
    # /proc/self/mounts escapes spaces in mount points as \040
    mounts = [(point.replace("\\040", " "), kind) for point, kind in entries]
    return sorted(mounts, key=lambda mount: len(mount[0]), reverse=True)


def _virtual_file_system(path: Path) -> tuple[str, str] | None:
    """(file system type, mount point) when ``path`` (absolute) lies on a virtual file system, else None."""
    text = str(path)
    for point, kind in _mounts():
        if text == point or text.startswith(point.rstrip("/") + "/"):
            return (kind, point) if kind in VIRTUAL_FILE_SYSTEMS else None
    return None


def user_path(option: str, value: str | os.PathLike, *, fix: str) -> Path:
    """``value`` as an absolute Path (``~`` expanded), or an error naming ``option`` when it cannot be one."""
    if not isinstance(value, (str, os.PathLike)):
        raise bad_argument(option, "a path (str or Path)", describe(value), fix, kind=TypeError)
    text = os.fspath(value)
    if isinstance(text, bytes) or not text or "\0" in text:
        raise bad_argument(option, "a non-empty path without NUL characters", repr(text), fix)
    try:
        return Path(text).expanduser().absolute()
    except RuntimeError:  # "~someone" for a user this system does not know
        raise bad_argument(option, "a path whose ~ names a known user's home", repr(text), fix) from None


def _stat(path: Path) -> os.stat_result | None:
    """os.stat of ``path`` (following links), or None when nothing is there (or it cannot be looked at)."""
    try:
        return path.stat()
    except (OSError, ValueError):
        return None


def path_kind(path: Path) -> str:
    """What is at ``path``: "file", "folder", "other" (a device, a pipe, a socket) or "missing".

    Unlike Path.is_file, never raises: a name too long, or a folder we may not look into, is "missing".
    """
    status = _stat(path)
    if status is None:
        return "missing"
    return "folder" if stat.S_ISDIR(status.st_mode) else "file" if stat.S_ISREG(status.st_mode) else "other"


def existing_folder(option: str, value: str | os.PathLike, *, what: str, fix: str) -> Path:
    """The existing folder ``value`` (to read from); :class:`MissingFileError` when absent, else an InputError."""
    path = user_path(option, value, fix=fix)
    kind = path_kind(path)
    if kind == "missing":
        raise bad_argument(option, what, f"{str(value)!r}, which does not exist", fix, kind=MissingFileError)
    if kind != "folder":
        raise bad_argument(option, what, f"{str(value)!r}, which is not a folder", fix)
    return path


def _why(error: OSError) -> str:
    """The OS's own words for ``error`` ("Permission denied"), without the path it repeats."""
    return error.strerror or type(error).__name__


# ------------------------------------------------------------------------------------ writing


def output_folder(option: str, value: str | os.PathLike, *, fix: str | None = None, create: bool = True) -> Path:
    """The folder ``value``, checked writable and (``create``) created; an InputError naming ``option`` if not.

    Refused: a path that is a file (or a device), a folder under a file, a virtual file system
    (/proc, /sys, /dev), and a folder this process cannot create or write into (permissions, a
    read-only disk). Checked by creating and removing a probe file, so the answer is the OS's own.
    With ``create=False`` (a command checking its options before the work) nothing is left behind:
    a missing folder is probed in the nearest folder above it, where it would be created.
    """
    fix = fix or f"pass {option} a folder you can write to, e.g. {option} ./results"
    path = user_path(option, value, fix=fix)

    def refuse(reason: str) -> Exception:
        return bad_argument(
            option, "a folder multihead can create and write files in", f"{str(value)!r}, {reason}", fix
        )

    virtual = _virtual_file_system(path)
    if virtual is not None:
        raise refuse(f"which is on the virtual file system {virtual[0]} mounted at {virtual[1]}")
    status = _stat(path)
    if status is not None and not stat.S_ISDIR(status.st_mode):
        raise refuse("which is a file" if stat.S_ISREG(status.st_mode) else "which exists and is not a folder")
    nearest = path
    if status is None:
        for parent in path.parents:  # the nearest thing that exists above it must be a folder
            parent_status = _stat(parent)
            if parent_status is not None:
                if not stat.S_ISDIR(parent_status.st_mode):
                    raise refuse(f"which is under {str(parent)!r}, a file")
                nearest = parent
                break
    if not create:
        _check_writable(nearest, refuse, "which cannot be created" if nearest != path else None)
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise refuse(f"which cannot be created ({_why(error)})") from None
    _check_writable(path, refuse)
    return path


def _check_writable(folder: Path, refuse: Callable[[str], Exception], reason: str | None = None) -> None:
    """Create and remove a probe file in ``folder``: permission bits, ACLs and read-only mounts all answer.

    ``reason``: what a refusal says (default: that files cannot be created in the folder).
    """
    probe = folder / f".multihead-write-check-{os.getpid()}"
    try:
        descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # left by a killed run of ours: the folder took a file, so it is writable
        return
    except OSError as error:
        raise refuse(f"{reason or 'in which files cannot be created'} ({_why(error)})") from None
    os.close(descriptor)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def output_file(option: str, value: str | os.PathLike, *, suffixes: tuple[str, ...], fix: str) -> Path:
    """A file to write: its suffix one of ``suffixes``, not an existing folder, in a folder that can be written
    (checked, not created: the writer creates it)."""
    path = user_path(option, value, fix=fix)
    if path.suffix.lower() not in suffixes:
        raise bad_argument(option, f"a file name ending in {' or '.join(suffixes)}", repr(str(value)), fix)
    status = _stat(path)
    if status is not None and not stat.S_ISREG(status.st_mode):
        raise bad_argument(option, "a file path", f"{str(value)!r}, which exists and is not a regular file", fix)
    output_folder(option, path.parent, fix=fix, create=False)
    return path


@contextlib.contextmanager
def writing(option: str, path: str | os.PathLike, *, fix: str | None = None) -> Iterator[None]:
    """Within the block, an OSError (writing ``path``) becomes an InputError naming ``option``.

    Wrap only the write itself: an OSError there is about the place the user chose (a folder named
    like the file we write, a full disk), while one elsewhere may be our bug.
    """
    try:
        yield
    except OSError as error:
        raise bad_argument(
            option,
            "a folder multihead can write its files in",
            f"{str(path)!r}, which could not be written ({_why(error)})",
            fix or f"pass {option} a folder you can write to (and free some space if it is full)",
        ) from None


@contextlib.contextmanager
def from_option(option: str, *, names: tuple[str, ...] | None = None) -> Iterator[None]:
    """Within the block, an InputError about a value the user gave as ``option`` names the option.

    The library names its own arguments ("model: ...", "config.json: ...", "heads[0]: ..."); on the
    command line the user knows the option, so it comes first: "--model config.json: ...". With
    ``names``, only errors about those arguments are renamed ("relations: ..." -> "--relations: ...");
    others pass through as they are.
    """
    try:
        yield
    except InputError as error:
        argument = error.argument
        if argument is not None and (argument == option or argument.startswith(f"{option} ")):
            raise  # already said in the command line's words
        if names is not None:
            if argument not in names:
                raise
            raise _spelled(error, {argument: option}) from None
        if argument == option.lstrip("-"):
            raise error.about(option) from None
        raise error.about(option if argument is None else f"{option} {argument}") from None


@contextlib.contextmanager
def from_options(options: Mapping[str, str]) -> Iterator[None]:
    """Within the block, an InputError about a library argument in ``options`` ({"embed_dim": "--embed-dim"}) is
    said in the command line's spelling (see :func:`cli_spelling`); others pass through as they are."""
    try:
        yield
    except InputError as error:
        if error.argument not in options:
            raise
        raise _spelled(error, options) from None


# Python's words in a library message, as a command line's user reads them: "a positive int or None" is "a
# positive whole number" there (an option left out is the None), "got int 0" is "got 0", "got str ''" is "got ''"
_PLAIN_EXPECTED = (
    (re.compile(r" or None\b"), ""),
    (re.compile(r"\ban int\b"), "a whole number"),
    (re.compile(r"\bints\b"), "whole numbers"),
    (re.compile(r"\bint\b"), "whole number"),
)
_PLAIN_GOT = re.compile(r"(?:int|float|str|bool) (?P<value>.*)", flags=re.DOTALL)


def in_plain_words(error: InputError) -> InputError:
    """``error`` as the command line says it: its expectation and what came without Python's type names (see
    above); the same error, argument and fix otherwise. An error without fields, or with a message of its own, is
    as it was."""
    fields = (error.argument, error.expected, error.got, error.fix)
    if error.argument is None or str(error) != "{}: expected {}, got {}. Fix: {}".format(*fields):
        return error  # no fields, or words of its own around them (kept as they are)
    expected = error.expected or ""
    for pattern, plain in _PLAIN_EXPECTED:
        expected = pattern.sub(plain, expected)
    got = _PLAIN_GOT.fullmatch(str(error.got or ""))
    return type(error)(
        argument=error.argument,
        expected=expected,
        got=error.got if got is None else got["value"],
        fix=error.fix,
    )


@contextlib.contextmanager
def spelled_as_options(options: Mapping[str, str]) -> Iterator[None]:
    """Within the block, every InputError's expectation and fix say the library arguments ``options`` names
    ({"truncate": "--truncate"}) as the command line's options (:func:`cli_spelling`: 'truncate=True' ->
    '--truncate'), whatever argument it is about."""
    try:
        yield
    except InputError as error:
        if error.argument is None:
            raise
        raise error.about(
            error.argument,
            expected=cli_spelling(error.expected or "", options),
            fix=cli_spelling(error.fix or "", options),
        ) from None


def _spelled(error: InputError, options: Mapping[str, str]) -> InputError:
    """``error`` about the command line's option for its argument, its expectation and fix in the command line's
    spelling (:func:`cli_spelling`)."""
    assert error.argument is not None  # the callers chose it among ``options``
    return error.about(
        options[error.argument],
        expected=cli_spelling(error.expected or "", options),
        fix=cli_spelling(error.fix or "", options),
    )


# name="encoder", name='float32', name=[0, 1], name=3: a library argument's value as Python spells it; name=True
# is a flag, given on the command line by the option alone; name=('bank', 2), a word and its occurrence, is
# the command line's bank:2
_PYTHON_VALUE = (
    r"""=(?:"(?P<double>[^"]*)"|'(?P<single>[^']*)'|\[(?P<items>[0-9,\s]*)\]|(?P<number>-?[0-9.]+)|(?P<flag>True)"""
    r"""|\('(?P<word>[^']*)', (?P<nth>[0-9]+)\))"""
)


def cli_spelling(message: str, options: Mapping[str, str]) -> str:
    """``message`` (an expectation or a fix, about library arguments) with the arguments spelled as the command
    line's options: {"part": "--part"} turns 'pass e.g. part="encoder"' into 'pass e.g. --part encoder' (and
    heads=[0, 1] into --heads 0,1, seq >= 1 into --seq >= 1). A name with an underscore (embed_dim) cannot be a
    plain word, so it is respelled wherever it stands; a plain word (part, heads) only where it is clearly the
    argument: name=value and a comparison. The error's own argument is a field of it, renamed by
    :meth:`~multihead._errors.InputError.about`."""
    for name, option in options.items():

        def value(match: re.Match[str], option: str = option) -> str:
            if match["flag"] is not None:
                return option
            if match["word"] is not None:
                return f"{option} {match['word']}:{match['nth']}"
            items = match["items"]
            given = ",".join(items.replace(" ", "").split(",")) if items is not None else None
            spelled = (match["double"], match["single"], given, match["number"])
            return f"{option} {next(v for v in spelled if v is not None)}"

        word = rf"(?<![\w.\-]){re.escape(name)}"
        message = re.sub(word + _PYTHON_VALUE, value, message)
        message = re.sub(word + (r"(?![\w=(])" if "_" in name else r"(?= ?[<>]=? )"), option, message)
    return message


# ------------------------------------------------------------------------------------ reading


def read_text(option: str, value: str | os.PathLike, *, what: str, fix: str) -> str:
    """The UTF-8 text of the regular file ``value``; an InputError naming ``option`` for anything else.

    ``what`` describes the file wanted ("a text file with one sentence per line"). A missing file
    raises :class:`MissingFileError` (also a FileNotFoundError).
    """
    path = user_path(option, value, fix=fix)
    status = _stat(path)
    if status is None:
        raise bad_argument(option, what, f"{str(value)!r}, which does not exist", fix, kind=MissingFileError)
    if stat.S_ISDIR(status.st_mode):
        raise bad_argument(option, what, f"{str(value)!r}, which is a folder, not a file", fix)
    if not stat.S_ISREG(status.st_mode):  # a device, a pipe: reading could block or never end
        raise bad_argument(option, what, f"{str(value)!r}, which is not a regular file", fix)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise bad_argument(option, what, f"{str(value)!r}, which cannot be read ({_why(error)})", fix) from None
    try:
        return data.decode("utf-8-sig")  # a byte-order mark from some editors is harmless
    except UnicodeDecodeError as error:
        raise bad_argument(
            option,
            f"{what} in UTF-8",
            f"{str(value)!r}, whose byte {error.start} ({data[error.start : error.start + 1]!r}) is not UTF-8",
            fix,
        ) from None


def read_json(option: str, value: str | os.PathLike, *, what: str, schema: Any, fix: str) -> Any:
    """The JSON in file ``value``, checked against ``schema`` (see the module docstring).

    Not UTF-8, not JSON (or nested absurdly deep), or not of the schema's shape: an InputError
    naming ``option``, the file, and the first place where the data differs from what is expected.
    """
    text = read_text(option, value, what=what, fix=fix)
    try:
        data = json.loads(text)
    except RecursionError:
        raise bad_argument(option, what, f"{str(value)!r}, whose JSON is nested too deeply to read", fix) from None
    except ValueError as error:  # JSONDecodeError, or an integer too long to convert
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise bad_argument(option, what, f"{str(value)!r}, which is not valid JSON ({reason})", fix) from None
    check_json(option, data, schema, what=what, source=str(value), fix=fix)
    return data


def check_json(option: str, data: Any, schema: Any, *, what: str, source: str, fix: str) -> None:
    """Raise an InputError naming ``option`` and ``source`` at the first place ``data`` differs from ``schema``."""
    mismatch = _mismatch(schema, data, "")
    if mismatch is not None:
        where, expected, got = mismatch
        wanted = f"{what} whose {where} is {expected}" if where else f"{what}: {expected}"
        raise bad_argument(option, wanted, f"{got} in {source!r}", fix)


# ------------------------------------------------------------------------------------ JSON schema


@dataclass(frozen=True)
class Rule:
    """One JSON value is acceptable when ``test(value)``; ``expected`` says what that is, for the message."""

    expected: str
    test: Callable[[Any], bool]


@dataclass(frozen=True)
class OptionalKey:
    """In an object schema: the key may be absent; when present its value matches ``schema``."""

    schema: Any


@dataclass(frozen=True)
class ListOf:
    """A JSON list of at least ``min_length`` items, each matching ``item``."""

    item: Any
    min_length: int = 0


@dataclass(frozen=True)
class MapOf:
    """A JSON object of at least ``min_length`` keys (any names), each value matching ``value``."""

    value: Any
    min_length: int = 0


@dataclass(frozen=True)
class Grid:
    """A rectangular list of at least one non-empty row, each cell matching ``cell`` (e.g. layers x heads)."""

    cell: Any


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


NUMBER = Rule("a finite number", _is_number)
NUMBER_OR_NULL = Rule("a finite number or null", lambda value: value is None or _is_number(value))
POSITIVE_NUMBER = Rule("a positive finite number", lambda value: _is_number(value) and value > 0)
POSITIVE_INT = Rule("a positive integer", lambda value: _is_int(value) and value >= 1)
NON_NEGATIVE_INT = Rule("an integer >= 0", lambda value: _is_int(value) and value >= 0)
STRING = Rule("a string", lambda value: isinstance(value, str))
BOOLEAN = Rule("true or false", lambda value: isinstance(value, bool))
ANY_OBJECT = Rule("an object", lambda value: isinstance(value, dict))


def one_of(*choices: Any) -> Rule:
    """Exactly one of ``choices`` (strings, numbers)."""
    return Rule(
        "one of " + ", ".join(json.dumps(choice) for choice in choices),
        lambda value: any(type(value) is type(choice) and value == choice for choice in choices),
    )


def nullable(rule: Rule) -> Rule:
    """``rule``, or null."""
    return Rule(f"{rule.expected} or null", lambda value: value is None or rule.test(value))


def _json_kind(value: Any) -> str:
    """How a parsed JSON value reads in a message: 'a list', 'the string "x"', 'the number 3'."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"the {'string' if isinstance(value, str) else 'number'} {text}"


def _mismatch(schema: Any, value: Any, where: str) -> tuple[str, str, str] | None:
    """(where, expected, got) at the first place ``value`` breaks ``schema``, or None when it matches."""
    if isinstance(schema, Rule):
        return None if schema.test(value) else (where, schema.expected, _json_kind(value))
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return where, "an object", _json_kind(value)
        for key, entry in schema.items():
            optional = isinstance(entry, OptionalKey)
            if key not in value:
                if optional:
                    continue
                return where, f"an object with the key {json.dumps(key)}", "an object without it"
            found = _mismatch(entry.schema if optional else entry, value[key], f"{where}[{json.dumps(key)}]")
            if found is not None:
                return found
        return None
    if isinstance(schema, ListOf):
        if not isinstance(value, list):
            return where, "a list", _json_kind(value)
        if len(value) < schema.min_length:
            return where, f"a list of at least {schema.min_length} items", f"{len(value)}"
        for index, item in enumerate(value):
            found = _mismatch(schema.item, item, f"{where}[{index}]")
            if found is not None:
                return found
        return None
    if isinstance(schema, MapOf):
        if not isinstance(value, dict):
            return where, "an object", _json_kind(value)
        if len(value) < schema.min_length:
            return where, f"an object with at least {schema.min_length} keys", f"{len(value)}"
        for key, item in value.items():
            found = _mismatch(schema.value, item, f"{where}[{json.dumps(key)}]")
            if found is not None:
                return found
        return None
    if isinstance(schema, Grid):
        found = _mismatch(ListOf(ListOf(schema.cell, 1), 1), value, where)
        if found is not None:
            return found
        widths = sorted({len(row) for row in value})
        if len(widths) > 1:
            return where, "a rectangular table (rows of equal length)", f"rows of lengths {widths}"
        return None
    raise TypeError(f"unknown schema entry {schema!r}")  # our bug, not the user's
