"""The transformers versions the integration is tested on, and the error for one it cannot run on.

Kept apart from :mod:`multihead.integrations.transformers_internals` (whose import is what fails on such a
version) and free of transformers, so the error can be caught by name and the range read without it.
"""

from __future__ import annotations

from multihead._errors import InputError

__all__ = ["TRANSFORMERS_TESTED", "UnsupportedTransformersError"]

# The oldest and the newest transformers the integration's tests have passed on (docs/transformers.md): the range
# UnsupportedTransformersError names, and the floor of the hf extra in pyproject.toml
TRANSFORMERS_TESTED = ("5.20.0", "5.24.0")


class UnsupportedTransformersError(InputError, ImportError):
    """The installed transformers lacks an internal the transformers integration relies on (the user's
    environment, not multihead's bug): raised by importing :mod:`multihead.integrations.transformers`, one line
    naming what is missing, the installed version, :data:`TRANSFORMERS_TESTED` and the pip command.
    """
