"""The run folder (`train.out_dir`) before a run starts: refuse to mix two runs in it.

Why this file exists: rank 0 appends to `metrics.jsonl` and TensorBoard, and saves checkpoints over
the ones there; a second run in the same folder would mix its curve (and its `latest`) with the
first one's. So a folder holding a previous run is refused unless the run resumes it (then the
records after the resumed step are dropped by `MetricsLogger`) or `train.overwrite` is set (then
the previous run's outputs are deleted here, before any rank starts).
"""

from __future__ import annotations

import shutil
from pathlib import Path

# what a previous run leaves behind (a folder holding only config.toml or error logs is reusable)
MARKERS = ("metrics.jsonl", "tb", "checkpoints")
OUTPUTS = (*MARKERS, "summary.json", "comm_stats.txt", "calibration.json")


def previous_run(out_dir: Path) -> list[str]:
    """The names of a previous run's outputs in `out_dir` (non-empty files or folders)."""
    found = []
    for name in MARKERS:
        p = out_dir / name
        if (p.is_file() and p.stat().st_size > 0) or (p.is_dir() and any(p.iterdir())):
            found.append(name)
    return found


def check_run_dir(out_dir: str | Path, resuming: bool, overwrite: bool) -> None:
    """ValueError if `out_dir` holds a previous run and this run neither resumes nor overwrites it."""
    out = Path(out_dir)
    found = previous_run(out)
    if found and not resuming and not overwrite:
        raise ValueError(
            f"train.out_dir = {out} already holds a run ({', '.join(found)}): pass "
            "--train.overwrite=true to delete it and start fresh, --train.resume=true to continue it, "
            "or choose another train.out_dir"
        )


def prepare_run_dir(out_dir: str | Path, overwrite: bool) -> None:
    """Delete the error logs of an earlier attempt and, with `overwrite`, a previous run's outputs.

    Call once per run (the launcher, or rank 0 under torchrun), after `check_run_dir`."""
    out = Path(out_dir)
    for log in out.glob("error_rank*.log"):
        log.unlink()
    if not overwrite:
        return
    for name in OUTPUTS:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
