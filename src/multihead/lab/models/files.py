"""The files of a model folder, as every loader reads them: one error for a folder that is not there, one for a file
that cannot be read.

:func:`model_folder` is the ``--model`` folder (a Hugging Face Hub id given instead of a folder is told that
multihead never downloads, and how to fetch it). :func:`reading` wraps the reading of a weights, config or
tokenizer file — by safetensors, tokenizers, torch or transformers — so that a damaged or unreadable file is one
:class:`~multihead._errors.InputError` naming the file and the fix, whichever loader read it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from multihead._errors import InputError, bad_argument
from multihead._userfiles import MissingFileError, existing_folder, path_kind

__all__ = ["FIX_MODEL_FOLDER", "damaged_file", "looks_like_hub_id", "model_folder", "reading"]

# The fix for every damaged file of a model folder (every loader's errors alike).
FIX_MODEL_FOLDER = "point --model at an intact checkpoint folder (download or save it again)"

# owner/name or a bare name, as the Hub spells repository ids
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def looks_like_hub_id(value: object) -> bool:
    """``value`` is not an existing path but reads as a Hub id: ``bert-base-uncased`` or ``owner/name`` (whose
    ``owner`` is not a local folder, which would make it a path)."""
    if not isinstance(value, str) or not _HUB_ID.fullmatch(value) or value.endswith((".", "-")):
        return False
    if path_kind(Path(value)) != "missing":
        return False
    owner = value.partition("/")[0]
    return "/" not in value or path_kind(Path(owner)) == "missing"


def model_folder(option: str, value: str | os.PathLike, *, what: str, fix: str) -> Path:
    """The existing folder ``value``; a Hub id (see :func:`looks_like_hub_id`) raises :class:`MissingFileError`
    saying that multihead never downloads and the command that fetches it; other paths as
    :func:`~multihead._userfiles.existing_folder`."""
    if looks_like_hub_id(value):
        assert isinstance(value, str)
        local = value.rpartition("/")[2]
        raise bad_argument(
            option,
            what,
            f"{value!r}, which is no folder here (a Hugging Face Hub id?)",
            f"multihead never downloads: fetch it first (`hf download {value} --local-dir {local}`), "
            f"then pass the folder ({local})",
            kind=MissingFileError,
        )
    return existing_folder(option, value, what=what, fix=fix)


def damaged_file(name: str, path: Path, error: BaseException, *, what: str, fix: str = FIX_MODEL_FOLDER) -> Exception:
    """The one error for a model file ``name`` (at ``path``) that its reader refused with ``error``."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if len(reason) > 200:  # torch's unpickling errors run to paragraphs
        reason = reason[:197] + "..."
    return bad_argument(name, what, f"{str(path)!r}, which cannot be read ({reason})", fix)


def _readable(path: Path) -> bool:
    """Whether ``path`` passes a cheap check of its format (asked only after a reader failed, to name the file)."""
    try:
        if path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        elif path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as weights:
                weights.keys()
        elif path.suffix == ".txt":
            path.read_text(encoding="utf-8")
        else:
            path.read_bytes()
    except Exception:  # any failure to read is the answer asked for
        return False
    return True


def _unreadable(error: BaseException) -> bool:
    """An error a file reader raises for a damaged or unreadable file (not one of ours, not a bug's)."""
    if isinstance(error, InputError):
        return False
    from safetensors import SafetensorError

    # tokenizers reports a bad file as a plain Exception; torch.load as UnpicklingError, EOFError or RuntimeError
    kinds = (SafetensorError, OSError, ValueError, EOFError, RuntimeError, pickle.UnpicklingError)
    return type(error) is Exception or isinstance(error, kinds)


@contextlib.contextmanager
def reading(folder: Path, names: Sequence[str], *, what: str, fix: str = FIX_MODEL_FOLDER) -> Iterator[None]:
    """Within the block, files ``names`` of ``folder`` are read: a reader's error for a damaged or unreadable file
    becomes :func:`damaged_file`, naming the first of ``names`` present that fails a check of its format (else the
    first present). ``what`` is what the files should hold ("a safetensors file of the weights")."""
    try:
        yield
    except Exception as error:
        if not _unreadable(error):
            raise
        present = [name for name in names if path_kind(folder / name) != "missing"] or list(names[:1])
        name = next((name for name in present if not _readable(folder / name)), present[0])
        raise damaged_file(name, folder / name, error, what=what, fix=fix) from None
