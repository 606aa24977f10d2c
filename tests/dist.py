"""One spawn helper for every multi-rank test: gloo ranks on CPU, a free port, clear failures.

    def body(rank, world, x):          # runs in each rank, process group already initialised
        ...
    results = run_distributed(body, 4, x)   # list of per-rank return values

A rank that raises makes `run_distributed` raise with that rank's traceback; a hang ends with
a TimeoutError after `timeout` seconds (the ranks are killed), never a silent hang.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, outdir: str, timeout: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
        )
        try:
            result = {"ok": fn(rank, world, *args)}
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the traceback
        result = {"error": f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"}
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 120.0, retries: int = 3) -> list:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; return the list of results by rank."""
    for attempt in range(retries):
        with tempfile.TemporaryDirectory() as outdir:
            port = free_port()
            ctx = mp.start_processes(
                _worker,
                args=(world, port, fn, args, outdir, timeout),
                nprocs=world,
                join=False,
                start_method="spawn",
            )
            deadline = timeout + 30
            import time

            t0 = time.monotonic()
            while not ctx.join(timeout=1):
                if time.monotonic() - t0 > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"distributed test did not finish within {deadline:.0f}s")
            results = []
            for r in range(world):
                with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
        errors = [r["error"] for r in results if "error" in r]
        if errors and attempt + 1 < retries and any("address already in use" in e.lower() for e in errors):
            continue
        if errors:
            raise AssertionError("\n".join(errors))
        return [r["ok"] for r in results]
    raise AssertionError("unreachable")
