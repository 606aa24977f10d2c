"""A trainer run as a child process, its process tree and its end, for the reliability tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.runs import tiny_args

ROOT = Path(__file__).resolve().parents[2]


def child_pids(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = set(), [pid]
    while todo:
        q = todo.pop()
        kids = [c for c, pp in parents.items() if pp == q]
        out.update(kids)
        todo.extend(kids)
    return out


def proc_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def start_long_run(corpus, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    argv = [*tiny_args(corpus, out), "--parallel.tp=2", "--train.steps=100000", "--train.log_interval=1"]
    argv += ["--train.eval_interval=0", *extra]
    return subprocess.Popen(
        [sys.executable, "-m", "taco.cli", "train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a job in a terminal
    )


def finish_run(proc: subprocess.Popen, kids: set[int], timeout: float) -> tuple[int, list[str], float]:
    """Wait for the launcher and its ranks; (exit code, stderr lines, seconds); kills leftovers."""
    t0 = time.time()
    try:
        _, err = proc.communicate(timeout=timeout)  # EOF only once every rank closed the pipes too
        gone = time.time() + 5
        while any(_alive(k) for k in kids) and time.time() < gone:
            time.sleep(0.1)
        left = [k for k in kids if _alive(k)]
        assert not left, f"ranks still running after the launcher exited: {left}"
        return proc.returncode, [x for x in err.splitlines() if x.strip()], time.time() - t0
    finally:
        for k in [proc.pid, *kids]:
            if _alive(k):
                os.kill(k, signal.SIGKILL)
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
