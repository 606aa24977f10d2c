"""Sharded checkpoints: one file per rank, verified before resuming, resumable to the same losses.

Layout: `{out_dir}/checkpoints/step_{N:07d}/rank{r}.pt` holding the rank's model shard, optimizer
state, step, the mesh it was written with, and its rank and mesh coordinates; `meta.json` records
the step, the mesh and per rank file its rank, coordinates (dp, pp, tp), size and sha256;
`latest` names the newest complete step. Every file is written under a temporary name and renamed:
the rank files first, then meta.json, then `latest`, so a crash while saving leaves `latest` on
the previous complete checkpoint.

`verify_checkpoint` (run by the launcher before any rank starts) raises `CheckpointError` naming
the file for a missing, empty, truncated, corrupt or swapped rank file, a missing meta.json or a
different mesh; `load_checkpoint` (in each rank) also refuses a file holding another rank's shard.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from taco.parallel.dims import ParallelDims
from taco.train.errors import CheckpointError
from taco.train.files import sha256_file, write_atomic

_FIX = "resume from another checkpoint (train.resume = a step directory) or start fresh (train.resume=false)"


def coords_of(mesh: dict[str, int], rank: int) -> dict[str, int]:
    """The (dp, pp, tp) coordinates of `rank` in `mesh` (TP innermost)."""
    c = ParallelDims(dp=mesh["dp"], pp=mesh["pp"], tp=mesh["tp"]).coords(rank)
    return dict(zip(("dp", "pp", "tp"), c))


def save_checkpoint(out_dir: str | Path, step: int, rank: int, state: dict[str, Any]) -> Path:
    """Write this rank's file; rank 0 then writes meta.json (every rank's checksum) and `latest`.

    Collective when torch.distributed is initialised (every rank must call it)."""
    d = Path(out_dir) / "checkpoints" / f"step_{step:07d}"
    d.mkdir(parents=True, exist_ok=True)
    mesh = state.get("mesh", {})
    coords = coords_of(mesh, rank) if mesh else {}
    name = f"rank{rank}.pt"
    tmp = d / (name + ".tmp")
    torch.save({**state, "rank": rank, "coords": coords}, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    entry = {"rank": rank, "coords": coords, "bytes": tmp.stat().st_size, "sha256": sha256_file(tmp)}
    tmp.replace(d / name)
    entries = [entry]
    if dist.is_initialized() and dist.get_world_size() > 1:
        entries = [None] * dist.get_world_size()
        dist.all_gather_object(entries, entry)  # also: every rank file is in place
    if rank == 0:
        meta = {"step": step, "mesh": mesh, "files": {f"rank{e['rank']}.pt": e for e in entries}}
        write_atomic(d / "meta.json", json.dumps(meta, indent=1))
        write_atomic(Path(out_dir) / "checkpoints" / "latest", d.name)
    return d


def check_mesh(step_dir: Path, mesh: dict[str, int]) -> None:
    """Raise CheckpointError (at start-up, before any rank starts) if the checkpoint's mesh differs."""
    meta = step_dir / "meta.json"
    saved = json.loads(meta.read_text()) if meta.is_file() else {"mesh": mesh}
    if saved.get("format") == "dcp":
        return  # reshardable (taco.train.dcp): any mesh
    saved = saved["mesh"]
    if saved != mesh:
        diff = ", ".join(f"{k}={saved.get(k)} (now {v})" for k, v in mesh.items() if saved.get(k) != v)
        raise CheckpointError(
            f"checkpoint {step_dir} was written with a different mesh: {diff}; resume with the same "
            "parallel.dp/pp/tp/sp (with train.checkpoint_format = \"dcp\" its next checkpoint then "
            "resumes at any mesh), or start fresh (train.resume=false)"
        )


def find_checkpoint(resume: bool | str, out_dir: str | Path) -> Path | None:
    """The step directory to resume from: `resume` = True (latest in out_dir) or a path; None if off
    or if `resume` is True and out_dir has no checkpoint yet. A path with no checkpoint is an error."""
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
    if not (p / "meta.json").is_file() and not (p / "rank0.pt").is_file():
        raise FileNotFoundError(
            f"train.resume = {resume!r}: no checkpoint in {p} (expected a step directory holding "
            "meta.json and rank*.pt, or a run directory holding checkpoints/latest)"
        )
    return p


def verify_checkpoint(
    step_dir: Path, mesh: dict[str, int], ranks: Iterable[int] | None = None, fix: str = _FIX
) -> None:
    """Check meta.json, the mesh and the files of `ranks` (default: all) against their recorded size
    and sha256; raise CheckpointError naming the first bad file, then `fix` (what to do instead).
    Checkpoints written before checksums were recorded (no "files" in meta.json) are checked for
    missing and empty files only."""
    meta_f = step_dir / "meta.json"
    if not meta_f.is_file():
        raise CheckpointError(f"{meta_f} missing: {step_dir} is not a complete checkpoint; {fix}")
    try:
        meta = json.loads(meta_f.read_text())
    except ValueError as e:
        raise CheckpointError(f"{meta_f} is not valid JSON ({e}); {fix}") from e
    if meta.get("format") == "dcp":
        from taco.train import dcp

        dcp.verify(step_dir, fix)
        return
    check_mesh(step_dir, mesh)
    world = mesh["dp"] * mesh["pp"] * mesh["tp"]
    ranks = list(range(world) if ranks is None else ranks)
    for r in ranks:
        f = step_dir / f"rank{r}.pt"
        if not f.is_file():
            raise CheckpointError(f"{f} missing: the checkpoint has no file for rank {r}; {fix}")
        if f.stat().st_size == 0:
            raise CheckpointError(f"{f} is empty (0 bytes): the checkpoint is damaged; {fix}")
    files = meta.get("files")
    if files is None:
        return
    with ThreadPoolExecutor(min(8, len(ranks) or 1)) as ex:  # hashlib releases the GIL
        digests = list(ex.map(sha256_file, [step_dir / f"rank{r}.pt" for r in ranks]))
    for r, digest in zip(ranks, digests):
        f, e = step_dir / f"rank{r}.pt", files.get(f"rank{r}.pt")
        if e is None or e.get("rank") != r or e.get("coords") != coords_of(mesh, r):
            raise CheckpointError(f"{meta_f} has no entry for rank {r} at {coords_of(mesh, r)}; {fix}")
        if digest == e["sha256"]:
            continue
        other = [n for n, x in files.items() if x.get("sha256") == digest]
        if other:
            why = f"it holds {other[0]}'s content (files swapped or copied?)"
        elif f.stat().st_size != e["bytes"]:
            why = f"it has {f.stat().st_size} bytes, {e['bytes']} were written (truncated or replaced?)"
        else:
            why = "its sha256 differs from the one recorded when it was written (corrupted)"
        raise CheckpointError(f"{f} does not match {meta_f}: {why}; {fix}")


def load_checkpoint(step_dir: Path, rank: int, mesh: dict[str, int]) -> dict[str, Any]:
    """This rank's state; CheckpointError if the file is missing, unreadable or another rank's shard."""
    f = step_dir / f"rank{rank}.pt"
    if not f.is_file():
        raise FileNotFoundError(f"{f} missing: the checkpoint was written by fewer ranks than this run has")
    check_mesh(step_dir, mesh)
    try:
        st = torch.load(f, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(f"{f} cannot be read ({type(e).__name__}: {e}); {_FIX}") from e
    want = coords_of(mesh, rank)
    if "rank" in st and (st["rank"] != rank or st.get("coords") != want):
        raise CheckpointError(
            f"{f} holds rank {st['rank']}'s shard {st.get('coords')}, not rank {rank}'s {want} "
            f"(files swapped or copied?); {_FIX}"
        )
    if st.get("mesh", mesh) != mesh:
        raise CheckpointError(f"{f} was written with mesh {st['mesh']}, not {mesh}; {_FIX}")
    unfused = next((k for k in st.get("model", {}) if _UNFUSED.search(k)), None)
    if unfused is not None:
        raise CheckpointError(
            f"{f} holds {unfused}: it was written when q/k/v (and gate/up) were separate projections; "
            "these models fuse them (attn.qkv, mlp.gate_up): resume it with the release that wrote it, "
            "or export it there to Hugging Face format and fine-tune from that"
        )
    return st


_UNFUSED = re.compile(r"(^|\.)(attn\.[qkv]|mlp\.gate)\.(weight|bias)$")  # separate projections


def check_shapes(f: Path, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raise one CheckpointError naming the first tensor of `current` (a model's state_dict) that
    the checkpoint file `f` holds with another shape (both shapes given) or lacks, or the first one
    it holds that `current` lacks: a model of other sizes than the run that wrote it."""
    same = "resume with the [model] sizes of the run that wrote it (its config.toml), or start fresh"
    for key, t in current.items():
        if key not in saved:
            raise CheckpointError(f"{f} has no {key}: it was written by another model; {same}")
        have, want = tuple(getattr(saved[key], "shape", ())), tuple(getattr(t, "shape", ()))
        if have != want:
            raise CheckpointError(
                f"{f}: {key} has shape {list(have)} in the checkpoint but {list(want)} in this model "
                f"(this rank's shard): the model sizes differ; {same}"
            )
    extra = next((k for k in saved if k not in current), None)
    if extra is not None:
        raise CheckpointError(f"{f} holds {extra}, which this model has not: another model; {same}")
