"""Conditions on sizes that may be symbolic (torch.compile, torch.export trace them): one helper, loaded lazily.

torch's ``statically_known_true`` lives in ``torch.fx.experimental.symbolic_shapes``, whose import pulls sympy
and part of dynamo (about 0.2 s): a plain size needs none of it, and a symbolic one only exists inside a trace,
which has imported it already.
"""

from __future__ import annotations

import torch

__all__ = ["surely"]


def surely(condition: bool | torch.SymBool) -> bool:
    """The condition, for plain sizes; for symbolic sizes True only when it holds for every size, without adding
    a guard that would pin a sequence length."""
    # under dynamo a symbolic bool passes isinstance(..., bool) (its Python type is bool), and using it as a
    # bool would guard on the size: a trace always asks statically_known_true
    if isinstance(condition, bool) and not torch.compiler.is_compiling():
        return condition
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(condition))
