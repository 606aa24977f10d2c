"""Local gloo ranks for the benchmarks: spawn them, set each one up on `lo`, collect rank 0's result.

Why this file exists: `comm.py` and `cluster.py` both run short jobs on N spawned processes
(inside a capped namespace or not) whose rank 0 reports JSON; this is that plumbing, written once.

    def body(rank, world, port, threads):          # a top-level function (spawn pickles it)
        with gloo_rank(rank, world, port, threads):
            return {"sum": ...}                    # rank 0's return value reaches the parent
    result = spawn_ranks(body, 2, 1)
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from taco.train.procs import free_port, run_ranks


def comma_list(cast: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse `type` for "a,b,c": each non-empty item through `cast`."""
    return lambda s: [cast(v) for v in s.split(",") if v.strip()]


def pin_cores(rank: int, world: int) -> set[int]:
    """Bind this process (and the threads it starts later: gloo's, the intra-op pool) to its own
    share of the cores it may use, rank r to the r-th share: ranks then no longer migrate between
    cores or preempt each other's threads, one source of step-time noise. Returns the share (all
    the cores, unchanged, when there are fewer than `world`)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world:
        return set(cores)
    per = len(cores) // world
    mine = set(cores[rank * per : (rank + 1) * per])
    os.sched_setaffinity(0, mine)
    return mine


@contextlib.contextmanager
def gloo_rank(
    rank: int, world: int, port: int, threads: int, timeout_s: float = 1200, pin: bool = False
) -> Iterator[None]:
    """This process as `rank` of a gloo group over `lo` (`threads` compute threads, on its own cores
    with `pin`: `pin_cores`); destroyed on exit."""
    import torch.distributed as dist

    if pin:
        pin_cores(rank, world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out: str, args: tuple) -> None:
    result = fn(rank, world, port, *args)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any) -> Any:
    """Run `fn(rank, world, port, *args)` in `world` spawned processes; rank 0's (JSON) return value.

    The trainer's launcher (`taco.train.procs.run_ranks`) runs them: a failing rank stops the
    others and raises `RankError` naming the root cause (tracebacks in $TMPDIR/taco-bench/)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        logs = Path(tempfile.gettempdir()) / "taco-bench"
        run_ranks(_entry, (fn, world, free_port(), out, args), world, logs)
        return json.loads(Path(out).read_text())
