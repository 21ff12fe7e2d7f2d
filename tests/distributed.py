"""Run a function on several ranks of a torch.distributed gloo group, for tests: loopback only, a ``file://``
store in a fresh folder (no fixed port), a timeout on the process group, one process per rank (more ranks than
cores is fine).

    results = run_ranks(check_outputs, world_size=4, args=(seed,))   # [rank 0's return, rank 1's, ...]

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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankFailed", "run_ranks"]

GROUP_TIMEOUT_S = 30  # a collective waiting longer than this on a dead peer raises instead of hanging


class RankFailed(RuntimeError):
    """A rank raised: the message holds its rank and traceback."""


def _worker(rank: int, world_size: int, folder: str, fn: Callable[..., Any], args: tuple, timeout_s: float) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)  # ranks share the machine's cores
    outcome: tuple[str, Any]
    try:
        dist.init_process_group(
            "gloo",
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
    fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = GROUP_TIMEOUT_S
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; their return values, by rank.

    ``fn`` must be importable by the spawned processes (a module-level function of a test file).
    """
    with tempfile.TemporaryDirectory(prefix="multihead-dist-") as folder:
        context = mp.start_processes(
            _worker, args=(world_size, folder, fn, args, timeout_s), nprocs=world_size, join=False, start_method="spawn"
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
