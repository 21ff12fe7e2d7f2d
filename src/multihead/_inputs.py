"""The checks every entry point makes of its input tensors, said once: ``attention``'s q, k and v, the layer's query,
key and value, the torch drop-in's, the cache's new keys and values, and the sequence-parallel shards. Each names
the argument, what it had to match (whose dtype, whose device) and the fix, in the same words everywhere."""

from __future__ import annotations

import torch

from multihead._errors import bad_argument, describe


def tensor_argument(name: str, value: object, *, fix: str = "pass a tensor") -> torch.Tensor:
    """``value`` itself when it is a tensor; else a TypeError naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise bad_argument(name, "a torch.Tensor", describe(value), fix, kind=TypeError)
    return value


def floating_argument(name: str, tensor: torch.Tensor, *, kind: type[Exception] = TypeError) -> None:
    """``tensor`` has a real floating dtype, the dtypes attention computes in."""
    if not tensor.is_floating_point():
        raise bad_argument(
            name,
            "a floating dtype (float16, bfloat16, float32 or float64)",
            tensor.dtype,
            f"convert with {name}.float()",
            kind=kind,
        )


def matching(
    name: str,
    tensor: torch.Tensor,
    like: torch.Tensor,
    whose: str,
    *,
    fix: str,
    dtype_kind: type[Exception] = TypeError,
    check_dtype: bool = True,
) -> None:
    """``tensor`` has the dtype (unless ``check_dtype`` is False: autocast casts it) and the device of ``like``,
    which is ``whose`` (e.g. "q", "the query", "the cache", "the layer's parameters"); ``fix`` says how to make
    them match."""
    if check_dtype and tensor.dtype != like.dtype:
        raise bad_argument(name, f"dtype {like.dtype} (the dtype of {whose})", tensor.dtype, fix, kind=dtype_kind)
    if tensor.device != like.device:
        raise bad_argument(name, f"a tensor on {like.device} (the device of {whose})", f"one on {tensor.device}", fix)


def like_parameters(
    name: str,
    tensor: torch.Tensor,
    weight: torch.Tensor,
    whose: str,
    *,
    autocast: bool,
    dtype_kind: type[Exception] = TypeError,
) -> None:
    """A module's input against its parameters (``weight`` one of them): a floating tensor, of the parameters'
    dtype unless ``autocast`` is on for its device (autocast casts it), on their device."""
    floating_argument(name, tensor, kind=dtype_kind)
    fix = f"convert the input with {name}.to({weight.dtype}) on {weight.device}, or the module with .to(...)"
    matching(name, tensor, weight, whose, fix=fix, dtype_kind=dtype_kind, check_dtype=not autocast)
