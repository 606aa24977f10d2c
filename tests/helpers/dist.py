"""One spawn helper for every multi-rank test: gloo ranks on CPU, a free port, clear failures.

    def body(rank, world, x):          # runs in each rank, process group already initialised
        assert_equal(tc.all_reduce(x, codec=None), ref, "all_reduce none")
        assert err < tol, f"all_reduce taco: error {err:.3g} >= {tol}"
    results = run_distributed(body, 4, x)   # list of per-rank return values

Rank bodies assert where the values are, with the values in the message: pytest rewrites asserts
only in the parent, so a bare `assert a == b` in a rank says nothing. A rank that raises makes
`run_distributed` raise AssertionError whose first line names the rank and its message
(`rank 1: AssertionError: all_reduce none: Tensor-likes are not equal!`), one such line per
failed rank, then each failed rank's traceback. A hang ends with a TimeoutError after `timeout`
seconds (the ranks are killed), never a silent hang.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from taco.train.procs import free_port


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, outdir: str, timeout: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    faulthandler.enable(all_threads=True)  # a rank killed by a signal prints its Python stacks
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
        result = {"error": (type(e).__name__, str(e), traceback.format_exc())}
    path = os.path.join(outdir, f"{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)  # the parent never sees half a file
    # The result is on disk: skip interpreter teardown, where torch's gloo threads can still hold
    # work objects and abort the process ("terminate called without an active exception",
    # pytorch/pytorch#179291) after everything the test checks has passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def format_failures(errors: dict[int, tuple[str, str, str]], world: int) -> str:
    """The report of failed ranks: `rank R: Type: message` per rank (later lines of the message
    indented under it), assertion failures first (a rank whose peer died usually fails second, with
    a gloo error), then each rank's traceback."""
    order = sorted(errors, key=lambda r: (errors[r][0] != "AssertionError", r))
    lines = []
    for r in order:
        kind, msg, _ = errors[r]
        first, *rest = [line for line in msg.strip().splitlines() if line.strip()] or ["(no message)"]
        lines += [f"rank {r}: {kind}: {first}", *(f"    {line}" for line in rest)]
    if len(errors) > 1:
        lines.append(f"({len(errors)} of {world} ranks failed: {', '.join(map(str, sorted(errors)))})")
    for r in order:
        lines += ["", f"---- rank {r}: {errors[r][0]} ----", errors[r][2].rstrip()]
    return "\n".join(lines)


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 120.0, retries: int = 3) -> list:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; return the list of results by rank."""
    __tracebackhide__ = True  # pytest: a failure shows the test's line, then the ranks' report
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
        errors = {r: res["error"] for r, res in enumerate(results) if "error" in res}
        in_use = any("address already in use" in (msg + tb).lower() for _, msg, tb in errors.values())
        if errors and attempt + 1 < retries and in_use:
            continue
        if errors:
            raise AssertionError(format_failures(errors, world))
        return [r["ok"] for r in results]
    raise AssertionError("unreachable")


def assert_close(actual: Any, expected: Any, what: str, **tolerances: Any) -> None:
    """`torch.testing.assert_close` for rank bodies: a failure starts with `what`, then torch's
    report (how many elements differ, the largest difference and where), which a plain string
    `msg=` would replace."""
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tolerances)


def assert_equal(actual: Any, expected: Any, what: str) -> None:
    """Bit-for-bit equality (values, shape, dtype), reported as `assert_close` does."""
    assert_close(actual, expected, what, rtol=0, atol=0)
