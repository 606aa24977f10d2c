"""Sharded checkpoints: one file per rank, resumable to exactly the same losses.

Layout: `{out_dir}/checkpoints/step_{N:07d}/rank{r}.pt` holding the rank's model shard, optimizer
state, step and the mesh it was written with; `latest` names the newest complete step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def save_checkpoint(out_dir: str | Path, step: int, rank: int, state: dict[str, Any]) -> Path:
    d = Path(out_dir) / "checkpoints" / f"step_{step:07d}"
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f"rank{rank}.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(d / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        (d / "meta.json").write_text(json.dumps({"step": step, "mesh": state.get("mesh", {})}))
        (Path(out_dir) / "checkpoints" / "latest").write_text(d.name)
    return d


def check_mesh(step_dir: Path, mesh: dict[str, int]) -> None:
    """Raise ValueError (at start-up, before any rank starts) if the checkpoint's mesh differs."""
    meta = step_dir / "meta.json"
    saved = json.loads(meta.read_text())["mesh"] if meta.is_file() else mesh
    if saved != mesh:
        diff = ", ".join(f"{k}={saved.get(k)} (now {v})" for k, v in mesh.items() if saved.get(k) != v)
        raise ValueError(
            f"checkpoint {step_dir} was written with a different mesh: {diff}; resume with the same "
            "parallel.dp/pp/tp/sp, or start fresh (train.resume=false)"
        )


def find_checkpoint(resume: bool | str, out_dir: str | Path) -> Path | None:
    """The step directory to resume from: `resume` = True (latest in out_dir) or a path; None if off."""
    if resume is False or resume == "":
        return None
    if resume is True or resume == "true":
        latest = Path(out_dir) / "checkpoints" / "latest"
        if not latest.is_file():
            return None  # nothing to resume yet: start fresh
        return latest.parent / latest.read_text().strip()
    p = Path(resume)
    if (p / "checkpoints" / "latest").is_file():
        p = p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip()
    if not p.is_dir():
        raise FileNotFoundError(f"train.resume = {resume!r}: no checkpoint directory there")
    return p


def load_checkpoint(step_dir: Path, rank: int, mesh: dict[str, int]) -> dict[str, Any]:
    f = step_dir / f"rank{rank}.pt"
    if not f.is_file():
        raise FileNotFoundError(f"{f} missing: the checkpoint was written by fewer ranks than this run has")
    check_mesh(step_dir, mesh)
    return torch.load(f, map_location="cpu", weights_only=False)
