"""The process group a parallel call runs over: a ``torch.distributed`` ProcessGroup, None (the default group) or a
one-dimensional ``DeviceMesh`` (its group)."""

from __future__ import annotations

import torch.distributed as dist

from multihead._errors import bad_argument, describe

__all__ = ["resolve_group"]


def resolve_group(group: object, function: str) -> dist.ProcessGroup | None:
    """``group`` as a ProcessGroup (None stays None: the default group); a 1-D DeviceMesh gives its group.

    Raises a RuntimeError-kind input error when torch.distributed is not initialised, a ValueError for a mesh of
    more than one dimension and a TypeError for anything else, each naming ``function``'s ``group`` argument.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise bad_argument(
            "group",
            f"an initialised torch.distributed process group for {function}",
            "none (torch.distributed.is_initialized() is False)",
            "call torch.distributed.init_process_group(...) on every rank first",
            kind=RuntimeError,
        )
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    # imported here: torch.distributed.tensor costs every process seconds, and most callers pass a group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise bad_argument(
                "group",
                f"a one-dimensional DeviceMesh for {function}",
                f"a mesh of shape {tuple(group.shape)} with dimensions {group.mesh_dim_names}",
                'pass the dimension to split over, e.g. mesh["tp"]',
            )
        return group.get_group()
    raise bad_argument(
        "group",
        "a torch.distributed ProcessGroup, a 1-D DeviceMesh or None (the default group)",
        describe(group),
        "pass dist.new_group(ranks) or init_device_mesh(...)",
        kind=TypeError,
    )
