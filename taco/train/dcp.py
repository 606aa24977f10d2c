"""Reshardable checkpoints in torch.distributed.checkpoint (DCP) format, written atomically.

Why this file exists: a per-rank checkpoint resumes only on the mesh that wrote it. Here every
tensor of a rank (parameters, AdamW moments, fp32 masters; ZeRO-1 and FSDP2 shards included) is
saved as blocks of layout-free logical tensors (`taco.train.reshard`), so a run saved at
(tp=2, pp=2) resumes at (tp=1, dp=2), at tp=4 or under FSDP2: DCP reads the overlapping parts of
the saved blocks into the blocks of the new layout (docs/checkpoints.md).

Layout of ``{out_dir}/checkpoints``: ``step_{N:07d}/`` holds DCP's ``.metadata`` and ``__*_*.distcp``
files and our ``meta.json`` (``"format": "dcp"``, the step, the mesh that wrote it, every file's
size and sha256); ``latest`` names the newest complete step. A save writes into
``step_{N:07d}.partial/``; only when every rank's files are written, checksummed and the
directory renamed does ``latest`` move, so a save killed mid-write leaves the previous checkpoint
as the one that resumes. ``checkpoint_async``: the tensors are copied to host memory on the
step's thread, the files written by ``dcp.async_save``'s thread over a gloo group of its own.

Trainer state besides tensors: the step (the data position and the learning rate follow from it,
and each step reseeds its RNGs from it), the per-site TP codecs (calibration, guard); the RNG
states are saved per rank and restored where the world size is unchanged.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from taco.parallel import fully_sharded
from taco.parallel.torch_private import local_tensor
from taco.train.dcp_blocks import BlockLoadPlanner, BlockSavePlanner, Chunk
from taco.train.errors import CheckpointError
from taco.train.files import sha256_file, write_atomic
from taco.train.reshard import Piece, dp_restrict, fsdp_rows, tp_pieces

FORMAT = "dcp"


# --------------------------------------------------------------------------- the rank's tensors


def _pieces_of(p: torch.Tensor, pieces: list[Piece], dp: int, dp_rank: int) -> list[Piece]:
    """`pieces` (of the TP-local tensor) cut to what this rank holds when FSDP2 shards `p`."""
    if not isinstance(p, DTensor):
        return pieces
    lo, hi = fsdp_rows(p.shape[0], local_tensor(p).shape[0], dp, dp_rank)
    return dp_restrict(pieces, lo, hi)


def _optimizer_entries(opt: Any) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, Any] | None]]:
    """(model parameter, the tensor its optimizer state follows, that state or None where another
    rank holds it (ZeRO)) for every parameter of `opt` (masters: the fp32 master's state)."""
    from taco.parallel.data_parallel import local_optimizer
    from taco.parallel.master_weights import MasterWeightsOptimizer

    if isinstance(opt, MasterWeightsOptimizer):
        pairs, inner = list(zip(opt.params, opt.masters)), local_optimizer(opt.inner)
    else:
        inner = local_optimizer(opt)
        pairs = [(p, p) for g in opt.param_groups for p in g["params"]]
    owned = {id(q) for g in inner.param_groups for q in g["params"]}
    return [(p, q, inner.state.setdefault(q, {}) if id(q) in owned else None) for p, q in pairs]


def _fresh_adam_state(q: torch.Tensor, state: dict[str, Any]) -> None:
    """AdamW's state of `q` as its first step creates it (to be overwritten by the load)."""
    if "exp_avg" not in state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(q, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(q, memory_format=torch.preserve_format)


def rank_tensors(run: Any, for_load: bool = False) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """This rank's DCP state dict (logical key -> `Chunk` view of its live tensors, scalars as
    plain 0-d tensors) and the vocabulary tensors whose padded rows the load must zero.

    `for_load`: first give every parameter this rank's optimizer updates its AdamW state (zeros),
    so that the load fills it."""
    dims, model = run.dims, run.model
    vocab = run.loss_vocab or _vocab_rows(model, dims.tp)
    pieces = tp_pieces(model, dims.tp, dims.tp_rank, vocab)
    params = dict(model.named_parameters(remove_duplicate=False))
    by_id: dict[int, list[Piece]] = {}
    out: dict[str, Any] = {}
    padded: list[torch.Tensor] = []

    replica = f"tp_replica/{_mesh_key(run)}/tp{dims.tp_rank}/"

    def add(prefix: str, suffix: str, t: torch.Tensor, ps: list[Piece]) -> None:
        local = local_tensor(t)
        for pc in ps:
            key = f"{prefix}{pc.key}{suffix}"
            out[key] = Chunk(local[pc.local], pc.offsets, pc.size)
            if dims.tp > 1 and pc.replicated:  # a copy on every TP rank: also saved as its own
                out[replica + key] = out[key]
        if sum(math.prod(pc.shape) for pc in ps) != local.numel():
            padded.append(local)  # holds rows past the real vocabulary

    for name, ps in pieces.items():
        p = params[name]
        mine = _pieces_of(p, ps, dims.dp, dims.dp_rank)
        by_id[id(p)] = mine
        add("model/", "", p, mine)
    step = None
    for p, q, state in _optimizer_entries(run.opt):
        if state is None or id(p) not in by_id:
            continue
        if for_load:
            _fresh_adam_state(q, state)
        if q is not p:
            add("optim/", "/master", q, by_id[id(p)])
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() == 0:
                step = v if step is None else step
            elif isinstance(v, torch.Tensor):
                add("optim/", f"/{k}", v, by_id[id(p)])
    if step is not None:
        out["optim/step"] = step
    return out, padded


def _vocab_rows(model: torch.nn.Module, tp: int) -> int:
    emb = getattr(model, "tok_emb", None) or getattr(model, "lm_head", None)
    return model.config.vocab_size if emb is None else emb.weight.shape[0] * tp


def _mesh_key(run: Any) -> str:
    m = run.dims.mesh()
    return f"dp{m['dp']}-pp{m['pp']}-tp{m['tp']}-sp{m['sp']}"


def _refs_key(run: Any) -> str:
    """FSDP2's weight-difference references: one per (pp, tp) coordinate, equal on its DP ranks,
    meaningful only on the same mesh (their flat buffers follow the parameter groups)."""
    d = run.dims
    return f"fsdp_refs/{_mesh_key(run)}/pp{d.pp_rank}-tp{d.tp_rank}"


def _extra(run: Any) -> dict[str, Any]:
    return {"step": run.iteration, "mesh": run.dims.mesh(), "site_codecs": run.policy.site_codecs()}


def _rng() -> dict[str, Any]:
    import random

    import numpy as np

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


# --------------------------------------------------------------------------- saving


def _host_copy(v: Any) -> Any:
    if isinstance(v, Chunk):
        host = v.tensor.detach().to("cpu", copy=True).contiguous()
        return Chunk(host, tuple(v.offsets), tuple(v.global_size))
    return v.detach().to("cpu", copy=True)


class DCPWriter:
    """Saves a run's checkpoints (collective: every rank calls `save`; `wait` before exit)."""

    def __init__(self, out_dir: Path, async_save: bool) -> None:
        self.root = Path(out_dir) / "checkpoints"
        self.async_save = async_save
        self.group = dist.new_group(backend="gloo")  # the writer thread's collectives, apart from training's
        self.pending: Future | None = None
        self.committing: Future | None = None  # rank 0: checksums, rename and `latest` after the write
        self.pool = ThreadPoolExecutor(1) if dist.get_rank() == 0 else None

    def save(self, run: Any) -> Path:
        """Write step `run.iteration`; returns its directory (in place once `wait` returns)."""
        self.wait()
        rank, step = dist.get_rank(), run.iteration
        final = self.root / f"step_{step:07d}"
        tmp = self.root / f"step_{step:07d}.partial"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a save killed earlier
            tmp.mkdir(parents=True)
        dist.barrier(group=self.group)
        tensors, _ = rank_tensors(run)
        # the snapshot: host copies taken now, so training may change the live tensors meanwhile
        state: dict[str, Any] = {k: _host_copy(v) for k, v in tensors.items()}
        state["train"] = _extra(run)
        if run.sharded:
            refs = fully_sharded.references(run.stage)
            state[_refs_key(run)] = {
                k: None if v is None else v.detach().cpu().clone() for k, v in refs.items()
            }
        state[f"rng/{dist.get_world_size()}/{rank}"] = _rng()
        mesh = dict(run.dims.mesh(), dp_shard=int(run.sharded))
        writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
        planner = BlockSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        kw = dict(storage_writer=writer, planner=planner, process_group=self.group)
        if self.async_save:
            fut = dcp.async_save(state, **kw)
            if self.pool is not None:
                self.committing = self.pool.submit(_commit_after, fut, tmp, final, step, mesh)
            self.pending = fut
        else:
            dcp.save(state, **kw)
            if rank == 0:
                commit(tmp, final, step, mesh)
        return final

    def wait(self) -> None:
        """Until the save in flight is written (and, on rank 0, committed); re-raises its error."""
        if self.pending is None:
            return
        fut, self.pending = self.pending, None
        done, self.committing = self.committing, None
        try:
            fut.result()
            if done is not None:
                done.result()
        except Exception as e:
            raise CheckpointError(f"the checkpoint save failed: {type(e).__name__}: {e}") from e
        finally:
            dist.barrier(group=self.group)  # every rank past the commit of this step


def _commit_after(fut: Future, tmp: Path, final: Path, step: int, mesh: dict[str, int]) -> None:
    fut.result()  # every rank's files written (DCP's coordinator finished the metadata last)
    commit(tmp, final, step, mesh)


def commit(tmp: Path, final: Path, step: int, mesh: dict[str, int]) -> None:
    """Checksum the files of a written `tmp` directory, record them in meta.json, rename it to
    `final` and point `latest` at it: the checkpoint exists only from the rename on."""
    files = {}
    for f in sorted(tmp.iterdir()):
        if f.is_file() and f.name != "meta.json":
            files[f.name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    meta = {"format": FORMAT, "step": step, "mesh": mesh, "files": files}
    write_atomic(tmp / "meta.json", json.dumps(meta, indent=1))
    if final.exists():  # the same step saved again: the older copy goes
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    tmp.rename(final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename is on disk before `latest` names it
    finally:
        os.close(fd)
    write_atomic(final.parent / "latest", final.name)


# --------------------------------------------------------------------------- loading


def is_dcp(step_dir: Path) -> bool:
    meta = step_dir / "meta.json"
    try:
        return meta.is_file() and json.loads(meta.read_text()).get("format") == FORMAT
    except ValueError:
        return False


def verify(step_dir: Path, fix: str) -> dict[str, Any]:
    """meta.json of a DCP checkpoint after checking every file against its size and sha256."""
    meta_f = step_dir / "meta.json"
    meta = json.loads(meta_f.read_text())
    for name, e in meta["files"].items():
        f = step_dir / name
        if not f.is_file():
            raise CheckpointError(f"{f} missing: {step_dir} is not a complete checkpoint; {fix}")
        if f.stat().st_size != e["bytes"]:
            raise CheckpointError(
                f"{f} has {f.stat().st_size} bytes, {e['bytes']} were written (truncated?); {fix}"
            )
        if sha256_file(f) != e["sha256"]:
            raise CheckpointError(f"{f} does not match {meta_f}: its sha256 differs (corrupted); {fix}")
    if ".metadata" not in meta["files"]:
        raise CheckpointError(f"{step_dir} has no DCP .metadata: not a complete checkpoint; {fix}")
    return meta


@torch.no_grad()
def load(run: Any, step_dir: Path, group: Any = None) -> dict[str, Any]:
    """Fill the run's model and optimizer from a DCP checkpoint written at any layout; returns
    the run state (`step`, `site_codecs`, the `mesh` that wrote it). Collective."""
    reader = dcp.FileSystemReader(str(step_dir))
    saved = reader.read_metadata().state_dict_metadata
    tensors, padded = rank_tensors(run, for_load=True)
    for t in padded:
        t.zero_()  # the rows padded for this tp: zeros (never targets, never looked up)
    state: dict[str, Any] = {k: v for k, v in tensors.items() if k != "optim/step" or k in saved}
    # Tensors every TP rank holds a copy of may drift apart in the last bits (reductions that do not
    # give every rank the same bits): on the mesh that wrote them, each rank reads its own copy.
    replica = f"tp_replica/{_mesh_key(run)}/"
    same_mesh = any(k.startswith(replica) for k in saved)
    for k in [k for k in state if k.startswith("tp_replica/")]:
        shared = k.split("/", 3)[3]
        if same_mesh and k in saved:
            del state[shared]
        else:
            del state[k]
    state["train"] = {}
    rng_key = f"rng/{dist.get_world_size()}/{dist.get_rank()}"
    if rng_key in saved:
        state[rng_key] = {}
    refs_key = _refs_key(run)
    if run.sharded and refs_key in saved:  # the same mesh: the references as they were
        state[refs_key] = {}
    missing = sorted(k for k in state if k not in saved and not k.startswith("optim/"))
    if missing:
        raise CheckpointError(
            f"{step_dir} lacks {missing[:3]}: it was written by another model; resume with the "
            "[model] sizes of the run that wrote it (its config.toml)"
        )
    if any(k.startswith("optim/") and k not in saved for k in state):
        raise CheckpointError(
            f"{step_dir} holds no optimizer state for this run's optimizer (another train.mixed_precision?)"
        )
    dcp.load(state, storage_reader=reader, planner=BlockLoadPlanner(step_dir), process_group=group)
    if "optim/step" in tensors:
        for _, _, st in _optimizer_entries(run.opt):
            if st and "step" in st:
                st["step"].copy_(state["optim/step"])
    _masters_to_params(run.opt)
    if run.sharded:  # another mesh: every parameter group starts with an exact gather
        fully_sharded.set_references(run.stage, state.get(refs_key, {}))
    if rng_key in state:
        import random

        import numpy as np

        r = state[rng_key]
        torch.set_rng_state(r["torch"])
        random.setstate(r["python"])
        np.random.set_state(r["numpy"])
    return state["train"]


def _masters_to_params(opt: Any) -> None:
    from taco.parallel.master_weights import MasterWeightsOptimizer

    if isinstance(opt, MasterWeightsOptimizer):
        for p, m in zip(opt.params, opt.masters):
            p.copy_(m)


def saved_vocab(step_dir: Path) -> int:
    """Token rows of the logical embedding in a DCP checkpoint (the real vocabulary)."""
    md = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return int(md["model/tok_emb.weight"].size[0])


@torch.no_grad()
def load_full_model(model: torch.nn.Module, step_dir: Path) -> None:
    """Fill an unsharded model (built with `saved_vocab` rows) from a DCP checkpoint written at any
    layout, in this process alone (no process group): what `taco export` merges."""
    reader = dcp.FileSystemReader(str(step_dir))
    pieces = tp_pieces(model, 1, 0, model.tok_emb.weight.shape[0])
    params = dict(model.named_parameters(remove_duplicate=False))
    state = {
        f"model/{pc.key}": Chunk(params[name].data[pc.local], pc.offsets, pc.size)
        for name, ps in pieces.items()
        for pc in ps
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, planner=BlockLoadPlanner(step_dir), no_dist=True)
