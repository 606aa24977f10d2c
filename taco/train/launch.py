"""Start the ranks of a training run: spawn them locally or join a torchrun job; the loop is
`Trainer.fit()`.

Each rank chooses its device once (`train.device`; auto = cuda:LOCAL_RANK when CUDA is there),
makes it current and joins a process group bound to it (NCCL for CUDA, gloo for CPU).
`launch(cfg)` returns rank 0's summary (final validation loss, tokens/s, and per axis tp/pp/dp
the wire and raw bytes per step: what one rank sends, averaged over the ranks of the job).

Before any rank starts, the launcher checks the run folder (`taco.train.rundir`: a previous run's
folder is refused unless resumed or overwritten) and the checkpoint to resume (sizes and sha256 of
the rank files, `taco.train.checkpoint.verify_checkpoint`; under torchrun each rank checks its own
file before joining). Locally spawned ranks are run by `taco.train.procs`: an error inside a rank
is raised as one `RankError` (traceback in `{out_dir}/error_rank{R}.log`); SIGTERM/SIGINT make every
rank write a checkpoint of the step in progress and stop (`taco.train.stopping`; a second signal stops
them at once), and `launch` raises `RunInterrupted` naming that checkpoint. Collectives time out after
`parallel.timeout_s`.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from taco.train import stopping
from taco.train.adaptive.calibration import check_calibration
from taco.train.checkpoint import check_mesh, find_checkpoint, verify_checkpoint
from taco.train.config import Config
from taco.train.data import resolve_data_dir
from taco.train.errors import RunInterrupted
from taco.train.procs import free_port, run_ranks
from taco.train.rundir import check_run_dir, prepare_run_dir


def resolve_device(cfg: Config, local_rank: int) -> torch.device:
    """The one device of this rank (`train.device`): auto = cuda:LOCAL_RANK when CUDA is there."""
    want = cfg.train.device.value
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError('train.device = "cuda" but torch sees no CUDA device: use "auto" or "cpu"')
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"local rank {local_rank} has no GPU (this node has {torch.cuda.device_count()}): start at "
            "most one rank per GPU on each node, or use train.device = \"cpu\""
        )
    return torch.device("cuda", local_rank)


def _backend(cfg: Config, device: torch.device) -> str:
    """`parallel.backend`, auto = NCCL for CUDA tensors, gloo for CPU tensors."""
    b = cfg.parallel.backend.value
    if b == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return b


def init_rank(cfg: Config, local_rank: int, **init: Any) -> torch.device:
    """Choose this rank's device, make it current, join the process group bound to it."""
    device = resolve_device(cfg, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        init["device_id"] = device  # NCCL communicators bound to this GPU, created eagerly
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    dist.init_process_group(_backend(cfg, device), timeout=timeout, **init)
    return device


def run_rank(
    cfg: Config, data_dir: Path, device: torch.device, observers: Sequence[Any] = ()
) -> dict[str, Any]:
    """The whole run on this rank (process group already initialised): build the mesh, fit.
    `observers` join the run's (e.g. `taco.train.adaptive.grad_fidelity.GradFidelity`)."""
    from taco.train.trainer import Trainer

    dims = cfg.parallel.dims().build(timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s))
    trainer = Trainer(cfg, dims, data_dir, log=dist.get_rank() == 0, device=device, observers=observers)
    try:
        return trainer.fit()
    finally:
        trainer.close()  # the DP hook's worker, before the groups go


def _spawned(
    rank: int, world: int, port: int, cfg: Config, data_dir: Path, out: str, observers: Sequence[Any]
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = init_rank(cfg, rank, rank=rank, world_size=world)
    res = run_rank(cfg, data_dir, device, observers)  # an error: reported by taco.train.procs, which exits
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump(res, f)
    dist.destroy_process_group()


def check_codec_settings(cfg: Config) -> None:
    """Build every codec of `[compression]` with its options once, so that a bad option (e.g.
    `tp_codec_options.group_size = 100`, or an option the codec does not take) is one ValueError
    naming the field before any rank starts, not an error inside every rank."""
    from taco.codec import build_codec
    from taco.train.build import build_policy

    c = cfg.compression
    checks = {
        "compression.tp_codec / tp_codec_options": lambda: build_policy(cfg),
        "compression.pp_codec / pp_codec_options": lambda: build_policy(cfg, "pp"),
        "compression.dp_codec / dp_codec_options": lambda: build_policy(cfg, "dp"),
        "compression.guard_fallback": lambda: build_codec(c.guard_fallback),
    }
    for name in ("dp_weight_codec", "dp_grad_codec", "dp_grad_intra_codec"):
        checks[f"compression.{name}"] = lambda name=name: build_codec(getattr(c, name) or None)
    for where, build in checks.items():
        try:
            build()
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None


def check_start_up(cfg: Config) -> None:
    """What the config alone cannot see, raised before any rank starts (ValueError): every codec
    with its options, a device for every local rank, and the calibration's candidates or file. (A
    checkpoint's depth is in `cfg` already, checked against parallel.pp.)"""
    check_codec_settings(cfg)
    check_calibration(cfg)
    if "LOCAL_RANK" not in os.environ:  # spawned here: ranks 0..world-1 each need their device
        resolve_device(cfg, cfg.parallel.world_size - 1)


def _check_resume(cfg: Config, rank: int | None) -> Path | None:
    """The checkpoint to resume, verified (all rank files, or only `rank`'s under torchrun); says
    so when `train.resume = true` finds none. CheckpointError/FileNotFoundError name the problem."""
    p, t = cfg.parallel, cfg.train
    resume_dir = find_checkpoint(t.resume, t.out_dir)
    if resume_dir is None:
        if t.resume is not False and rank in (None, 0):
            print(
                f"[taco] train.resume: no checkpoint in {Path(t.out_dir) / 'checkpoints'}; starting from "
                "step 0",
                file=sys.stderr,
                flush=True,
            )
        return None
    mesh = p.dims().mesh()
    check_mesh(resume_dir, mesh)
    verify_checkpoint(resume_dir, mesh, None if rank is None else [rank])
    return resume_dir


def _check_stopped(summary: dict[str, Any], signum: int) -> dict[str, Any]:
    """`summary`, unless the run stopped early on a signal: then RunInterrupted saying which step's
    checkpoint was written and how to continue."""
    if "stopped_at" not in summary:
        return summary
    saved = (
        f"checkpoint of step {summary['stopped_at']} written to {summary['checkpoint']}; continue "
        "with --train.resume=true"
    )
    raise RunInterrupted(signum or signal.SIGTERM, saved=saved)


def launch(cfg: Config, observers: Sequence[Any] = ()) -> dict[str, Any]:
    """Run `cfg` on its dp*pp*tp ranks: spawned locally, or as this torchrun rank. `observers`:
    extra observers of every rank's run (picklable: they travel to the spawned ranks)."""
    from taco.train.finetune import resolve_init_from

    for note in resolve_init_from(cfg):  # a checkpoint decides the sizes and the tokenizer
        if os.environ.get("RANK", "0") == "0":
            print(f"[taco] {note}", file=sys.stderr, flush=True)
    if not cfg.train.out_dir:
        cfg.train.out_dir = str(Path("runs") / (cfg.train.name or "run"))
    world = cfg.parallel.world_size
    p = cfg.parallel
    check_start_up(cfg)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun:
        started = int(os.environ["WORLD_SIZE"])
        if started != world:  # before joining: a wrong mesh must not hang in init_process_group
            raise ValueError(
                f"parallel.dp*pp*tp = {p.dp}*{p.pp}*{p.tp} = {world} but torchrun started {started} "
                "ranks: change parallel.dp/pp/tp or torchrun's --nproc-per-node/--nnodes"
            )
    resume_dir = _check_resume(cfg, int(os.environ["RANK"]) if torchrun else None)
    t = cfg.train
    check_run_dir(t.out_dir, resuming=t.resume is not False, overwrite=t.overwrite)
    out = Path(t.out_dir).resolve()
    clear = t.overwrite and (resume_dir is None or out not in resume_dir.resolve().parents)
    if not torchrun or os.environ["RANK"] == "0":  # the other ranks wait for it in the rendezvous
        prepare_run_dir(out, overwrite=clear)
    if torchrun:
        old = stopping.install([signal.SIGINT, signal.SIGTERM])  # this rank's own: checkpoint, stop
        try:
            device = init_rank(cfg, int(os.environ.get("LOCAL_RANK", "0")))
            if dist.get_rank() == 0:
                resolve_data_dir(cfg.data, prepare=True)
            dist.barrier()
            try:
                res = run_rank(cfg, resolve_data_dir(cfg.data), device, observers)
                return _check_stopped(res, stopping.requested())
            finally:
                dist.destroy_process_group()
        finally:
            stopping.restore(old)
    data_dir = resolve_data_dir(cfg.data, prepare=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.pkl")
        t0 = time.time()
        args = (world, free_port(), cfg, data_dir, result, tuple(observers))
        signum = run_ranks(_spawned, args, world, t.out_dir)
        with open(result, "rb") as f:
            res = _check_stopped(pickle.load(f), signum)
    res["wall_s"] = time.time() - t0
    print(
        f"[taco] done in {res['wall_s']:.0f}s: final val loss {res['final_val_loss']:.4f}, "
        f"{res['tokens_per_s']:,.0f} tok/s",
        file=sys.stderr,
        flush=True,
    )
    return res
