"""The local rank processes of `taco train`: start, watch, stop, and report the error that matters.
The one home of the process helpers that the launcher, the benchmarks and the tests share
(`free_port`, `run_ranks`, `pick_error`).

Why this file exists: `torch.multiprocessing.spawn` reports a failing rank as a 40-line
ProcessRaisedException (often the *other* rank's "Connection closed by peer"), leaves the ranks
running when the launcher gets SIGTERM, and prints a traceback per process on Ctrl-C. Here:

- each rank runs `fn(rank, *args)` inside `_child`, which writes the traceback of any exception to
  `{log_dir}/error_rank{R}.log` and a one-line record for the launcher, then exits 1; ranks ignore
  SIGINT (Ctrl-C reaches the launcher, which tells them), are named `taco-rank{R}` (ps, top) and, on
  Linux, die with the launcher even if it is SIGKILLed;
- `run_ranks` waits for all of them. On the first failure it gives the others a moment to report,
  stops them (SIGTERM, then SIGKILL) and raises `RankError` for the root cause (`pick_error`);
- the first SIGTERM or SIGINT to the launcher is forwarded to the ranks as a stop request
  (`taco.train.stopping`): they finish the step, write a checkpoint and exit, and `run_ranks`
  returns the signal; a second one stops the ranks at once (SIGTERM, then SIGKILL) and raises
  `RunInterrupted`. Stopping a rank mid-checkpoint is safe: files are renamed into place when complete.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from taco.train import stopping
from taco.train.errors import RankError, RunInterrupted

REPORT_GRACE_S = 3.0  # after a rank fails: how long the others get to report their own error
STOP_GRACE_S = 3.0  # after SIGTERM: how long a rank gets to exit before SIGKILL

_COMM_HINTS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "nccl")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (MASTER_PORT of locally spawned ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_comm_error(e: BaseException) -> bool:
    """A failure of communication (usually a peer that died or hangs), not the cause itself."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(h in str(e).lower() for h in _COMM_HINTS)


def _prctl(option: int, arg: int | bytes) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: best effort
        pass


def _child(rank: int, fn: Callable, args: tuple, report_dir: str, log_dir: str, parent: int) -> None:
    _prctl(15, f"taco-rank{rank}".encode())  # PR_SET_NAME
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the launcher
    if os.getppid() != parent:  # the launcher died before the line above
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the launcher stops the ranks
    stopping.install([stopping.REQUEST_SIGNAL])  # the launcher's request: checkpoint, then stop
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [stopping.REQUEST_SIGNAL])  # blocked since the spawn
    try:
        fn(rank, *args)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Done, process group destroyed: skip interpreter teardown, where torch's gloo threads can
        # still hold work objects and abort a finished rank (pytorch/pytorch#179291).
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 - reported to the launcher in one line
        text, log = traceback.format_exc(), Path(log_dir) / f"error_rank{rank}.log"
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(text)
        except OSError:  # no run folder to write to: the traceback goes to stderr instead
            sys.stderr.write(text)
            log = None
        rec = {
            "rank": rank,
            "type": type(e).__name__,
            "message": " ".join(str(e).split()),
            "time": time.time(),
            "comm": _is_comm_error(e),
            "log": str(log) if log else "",
        }
        path = Path(report_dir) / f"rank{rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(rec))
        path.with_suffix(".tmp").replace(path)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no atexit or process-group teardown that could wait for a dead peer


def pick_error(records: list[dict[str, Any]], died: dict[int, int]) -> RankError:
    """The root cause: a rank's own error, else a rank that died without one (`died`: rank -> exit
    code, negative = signal), else a communication error; the earliest of the first kind found."""
    own = sorted((r for r in records if not r["comm"]), key=lambda r: r["time"])
    if own:
        r = own[0]
        return RankError(r["rank"], r["type"], r["message"], r["log"])
    if died:
        rank, code = min(died.items())
        how = f"exit code {code}"
        if code < 0:
            how = f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else how
        return RankError(rank, "", f"the rank process died ({how}) without reporting an error")
    r = min(records, key=lambda r: r["time"])
    hint = " [a communication error: another rank may have died, hung or been stopped first]"
    return RankError(r["rank"], r["type"], r["message"] + hint, r["log"])


def _stop(procs: list[Any]) -> int:
    """SIGTERM every live rank, SIGKILL those still there after STOP_GRACE_S; returns how many."""
    live = [p for p in procs if p.exitcode is None]
    for p in live:
        p.terminate()
    deadline = time.time() + STOP_GRACE_S
    for p in live:
        p.join(max(0.0, deadline - time.time()))
    for p in live:
        if p.exitcode is None:
            p.kill()
            p.join()
    return len(live)


def run_ranks(fn: Callable[..., Any], args: tuple, world: int, log_dir: str | Path) -> int:
    """Run `fn(rank, *args)` in `world` spawned processes; return when all succeeded: 0, or the
    signal (SIGTERM/SIGINT) after which they stopped early, at a step boundary (module docstring).

    Raises RankError (a rank failed: the others are stopped) or RunInterrupted (a second signal)."""
    main = threading.current_thread() is threading.main_thread()
    signals = (signal.SIGTERM, signal.SIGINT)
    got: list[int] = []
    old: dict[int, Any] = {}
    procs: list[Any] = []
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="taco-ranks-") as reports:
        try:
            if main:  # ranks start with SIGINT ignored: no KeyboardInterrupt while Python starts up
                old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in signals}
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            # a stop request sent while a rank is still starting waits (blocked, inherited through the
            # spawn) until `_child` has its handler, instead of killing the rank (SIGUSR1's default)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, [stopping.REQUEST_SIGNAL])
            try:
                for r in range(world):
                    p = ctx.Process(target=_child, args=(r, fn, args, reports, str(log_dir), os.getpid()))
                    p.start()
                    procs.append(p)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if main:
                signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
            failed_at, asked = None, 0
            while len(got) < 2:
                if got and not asked:  # the first signal: ask every rank to save and stop
                    asked = got[0]
                    _request_stop(procs, asked)
                live = [p for p in procs if p.exitcode is None]
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if not live:
                    break
                if failed:
                    failed_at = failed_at or time.time()
                    recs = _records(reports)
                    if any(not r["comm"] for r in recs) or time.time() - failed_at > REPORT_GRACE_S:
                        break
                wait([p.sentinel for p in live], timeout=0.2)
            died = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            stopped = _stop(procs)
            if len(got) > 1:
                raise RunInterrupted(got[0], stopped)
            recs = _records(reports)
            if died or recs:
                raise pick_error(recs, {r: c for r, c in died.items() if r not in {x["rank"] for x in recs}})
            return asked
        finally:
            _stop(procs)
            for s, h in old.items():
                signal.signal(s, h)


def _request_stop(procs: list[Any], signum: int) -> None:
    """Forward a stop request to every live rank, and say so (a second signal stops at once)."""
    for p in procs:
        if p.exitcode is None and p.pid is not None:
            try:
                os.kill(p.pid, stopping.REQUEST_SIGNAL)
            except ProcessLookupError:
                pass
    name = signal.Signals(signum).name
    print(
        f"[taco] {name}: finishing the step and writing a checkpoint (send it again to stop at once)",
        file=sys.stderr,
        flush=True,
    )


def _records(report_dir: str) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted(Path(report_dir).glob("rank*.json"))]
