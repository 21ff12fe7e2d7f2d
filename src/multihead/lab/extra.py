"""The lab's dependencies: what ``multihead[lab]`` installs on top of the core, and the one check that says so.

``pip install multihead`` installs the core, which needs torch and numpy alone: attention, masks, backends, the layer,
positions, the cache, compat, capture and head surgery, parallel, and the cost model. The lab (inspect's
statistics, roles and reports, the models and their tokenizers, train, syntax) needs the packages below; each of
its packages calls :func:`require_lab` first, so a missing one is one line naming the extra, not an ImportError
from deep inside.
"""

from __future__ import annotations

import importlib.util

from multihead._figures import MissingExtraError

__all__ = ["LAB_EXTRA", "LAB_MODULES", "require_lab", "missing_lab_modules", "lab_missing_error", "lab_module_of"]

LAB_EXTRA = "lab"
# import names of the lab extra's packages (pyproject.toml's optional-dependencies "lab")
LAB_MODULES = ("jinja2", "rich", "safetensors", "tokenizers", "conllu", "wordfreq")


def missing_lab_modules() -> list[str]:
    """The lab packages this environment lacks (none when ``multihead[lab]`` is installed)."""
    return [name for name in LAB_MODULES if importlib.util.find_spec(name) is None]


def lab_missing_error(what: str, missing: list[str]) -> MissingExtraError:
    """The error that says ``what`` needs the lab extra, naming the ``missing`` packages and the install."""
    return MissingExtraError(
        f"{what} needs multihead's lab extra, which is not installed (missing: {', '.join(missing)}). "
        f"Fix: pip install 'multihead[{LAB_EXTRA}]'"
    )


def lab_module_of(error: ModuleNotFoundError) -> str | None:
    """The lab package whose absence raised ``error`` (None when it is another module)."""
    top = (error.name or "").split(".")[0]
    return top if top in LAB_MODULES else None


def require_lab(what: str) -> None:
    """Raise :class:`~multihead._figures.MissingExtraError` naming ``what`` and the extra when a lab package is
    missing."""
    missing = missing_lab_modules()
    if missing:
        raise lab_missing_error(what, missing)
