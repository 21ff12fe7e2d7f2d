"""Run a function on several ranks of a torch.distributed gloo group, for tests: loopback only, a ``file://``
store in a fresh folder (no fixed port), a timeout on the process group, one process per rank (more ranks than
cores is fine).

    results = run_ranks(check_outputs, world_size=4, args=(seed,))   # [rank 0's return, rank 1's, ...]

On ``device=cuda`` (``pytest --device cuda``) the group is NCCL, rank r on cuda:r, and ``rank_device()`` tells a
rank's code where to build its tensors; ``cannot_run(device, world_size)`` says why a world size cannot run there
(no NCCL, fewer GPUs than ranks), for the caller to skip with. NCCL refuses two ranks on one GPU, so with
``MULTIHEAD_RANKS_SHARE_GPU=1`` (scripts/gpu_check.sh's part 4) the ranks share the machine's GPUs instead, rank r on
cuda:(r % count), over a gloo group: any number of ranks on one GPU. gloo takes CUDA tensors in its collectives;
whether its point-to-point sends and all-to-all take them too is what that part finds out (not run without a GPU).

``fn(rank, world_size, *args)`` runs after ``init_process_group`` in each rank and its return value (picklable)
comes back to the caller. A rank that raises makes ``run_ranks`` raise :class:`RankFailed` with the traceback of the
rank that failed first (the cause); the other ranks, stuck in a collective, are stopped by the group's timeout
or terminated, never left hanging.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailed", "cannot_run", "rank_device", "run_ranks", "set_rank_device", "skip_unless_ranks_run"]

GROUP_TIMEOUT_S = 30  # a collective waiting longer than this on a dead peer raises instead of hanging
SHARE_GPU = "MULTIHEAD_RANKS_SHARE_GPU"  # "1": ranks share the GPUs over gloo (NCCL takes one rank per GPU)


class RankFailed(RuntimeError):
    """A rank raised: the message holds its rank and traceback."""


_rank_device = torch.device("cpu")


def rank_device() -> torch.device:
    """The device this rank builds its tensors and modules on: cpu under gloo, cuda:rank under NCCL."""
    return _rank_device


def set_rank_device(device: torch.device) -> None:
    """Where this process's rank computes (run_ranks sets it in each rank; a test's in-process group sets it)."""
    global _rank_device
    _rank_device = torch.device(device)
    if _rank_device.type == "cuda":
        torch.cuda.set_device(_rank_device)


def ranks_share_gpus() -> bool:
    """Whether cuda ranks share the GPUs over gloo (``MULTIHEAD_RANKS_SHARE_GPU=1``) rather than one each on NCCL."""
    return os.environ.get(SHARE_GPU) == "1"


def group_backend(device: torch.device) -> str:
    """The process-group backend for ranks on ``device``'s type: nccl for cuda (gloo when they share the GPUs),
    gloo for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" and not ranks_share_gpus() else "gloo"


def _cuda_device(rank: int) -> torch.device:
    """Rank ``rank``'s GPU: its own, or one shared round-robin when the ranks share the GPUs."""
    return torch.device("cuda", rank % torch.cuda.device_count() if ranks_share_gpus() else rank)


def cannot_run(device: torch.device, world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot run on ``device``'s type here (a skip reason), or None when they can."""
    if torch.device(device).type != "cuda":
        return None
    if ranks_share_gpus():
        return None if torch.cuda.device_count() else f"{SHARE_GPU}=1: this machine has no GPU to share"
    if not dist.is_nccl_available():
        return "--device cuda: this torch has no NCCL for the ranks' process group"
    count = torch.cuda.device_count()
    if count < world_size:
        return f"--device cuda: {world_size} ranks need {world_size} GPUs (one each, NCCL); this machine has {count}"
    return None


def skip_unless_ranks_run(device: torch.device, world_size: int) -> None:
    """Skip the calling test when ``world_size`` ranks cannot run on ``device``'s type here (:func:`cannot_run`)."""
    reason = cannot_run(device, world_size)
    if reason:
        pytest.skip(reason)


def _worker(
    rank: int, world_size: int, folder: str, fn: Callable[..., Any], args: tuple, timeout_s: float, device_type: str
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)  # ranks share the machine's cores
    outcome: tuple[str, Any]
    try:
        device = _cuda_device(rank) if device_type == "cuda" else torch.device("cpu")
        set_rank_device(device)
        dist.init_process_group(
            group_backend(device),
            init_method=f"file://{folder}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            outcome = ("ok", fn(rank, world_size, *args))
        except BaseException:  # timed before the group is torn down, which fails the peers waiting on this rank
            outcome = ("error", (time.time(), traceback.format_exc()))
        dist.destroy_process_group()
    except BaseException:  # init or teardown failed: the caller gets it too
        outcome = ("error", (time.time(), traceback.format_exc()))
    Path(folder, f"rank{rank}.pkl").write_bytes(pickle.dumps(outcome))
    if outcome[0] == "error":
        raise SystemExit(1)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    timeout_s: float = GROUP_TIMEOUT_S,
    device: torch.device | str = "cpu",
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks; their return values, by rank.

    Gloo ranks on the CPU, or NCCL ranks on cuda:0 .. cuda:world_size-1 for a cuda ``device`` (check
    ``cannot_run`` first; gloo ranks sharing the GPUs under ``MULTIHEAD_RANKS_SHARE_GPU=1``). ``fn`` must be
    importable by the spawned processes (a module-level function of a test file) and builds its tensors on
    ``rank_device()``.
    """
    device_type = torch.device(device).type
    with tempfile.TemporaryDirectory(prefix="multihead-dist-") as folder:
        context = mp.start_processes(
            _worker,
            args=(world_size, folder, fn, args, timeout_s, device_type),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            while not context.join(timeout=timeout_s * 3):
                pass
        except mp.ProcessExitedException:
            pass  # a rank exited with an error: its traceback is in its file
        except mp.ProcessRaisedException as error:
            raise RankFailed(str(error)) from None
        outcomes = {}
        for rank in range(world_size):
            path = Path(folder, f"rank{rank}.pkl")
            if path.exists():
                outcomes[rank] = pickle.loads(path.read_bytes())
        failed = {rank: report for rank, (status, report) in outcomes.items() if status == "error"}
        if failed:
            # the first rank to fail is the cause; the others failed waiting for it in a collective
            first = min(failed, key=lambda rank: failed[rank][0])
            others = "".join(
                f"\nrank {rank}: {failed[rank][1].strip().splitlines()[-1]}" for rank in sorted(failed) if rank != first
            )
            raise RankFailed(f"rank {first} of {world_size} failed first:\n{failed[first][1]}{others}")
        missing = [rank for rank in range(world_size) if rank not in outcomes]
        if missing:
            raise RankFailed(f"ranks {missing} of {world_size} exited without a result")
        return [outcomes[rank][1] for rank in range(world_size)]
