"""Start the ranks of a training run and drive the loop: spawn locally or join a torchrun job.

`launch(cfg)` returns rank 0's summary (final validation loss, tokens/s, and per axis tp/pp/dp
the wire and raw bytes per step: what one rank sends, averaged over the ranks of the job).
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from taco.parallel import stage_layers
from taco.parallel.tags import tp_context
from taco.train.checkpoint import check_mesh, find_checkpoint
from taco.train.config import Config, config_to_toml
from taco.train.data import resolve_data_dir


class _Logger:
    """Rank 0's outputs: progress lines on stdout, metrics.jsonl and TensorBoard scalars."""

    def __init__(self, out_dir: Path, enabled: bool, tensorboard: bool = True) -> None:
        self.enabled = enabled
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out_dir / "metrics.jsonl", "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tb"))
            except Exception as e:  # noqa: BLE001 - TensorBoard is optional
                print(f"[taco] TensorBoard disabled: {e}", flush=True)

    def write(self, rec: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(rec) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, rec["step"])

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def _capture_fn(cfg: Config, trainer: Any, rank_in_tp: int):
    """Save sampled TP tensors (activations forward, activation gradients backward) per site."""
    out = Path(cfg.train.capture_dir)
    out.mkdir(parents=True, exist_ok=True)

    def capture(site: str, x: torch.Tensor) -> None:
        step = trainer.step
        if rank_in_tp == 0 and trainer.dims.dp_rank == 0 and step % cfg.train.capture_interval == 0:
            torch.save(x.detach().to("cpu").clone(), out / f"{site}.step{step}.pt")

    return capture


def run_rank(cfg: Config, data_dir: Path) -> dict[str, Any]:
    """The whole run on this rank (process group already initialised)."""
    from taco.train.trainer import AXES, Trainer

    rank, world = dist.get_rank(), dist.get_world_size()
    p = cfg.parallel
    dims = cfg.parallel.dims().build()
    log = rank == 0
    # ZeRO-1 (sharded AdamW state over DP): parallel.zero.
    trainer = Trainer(cfg, dims, data_dir, log, zero=p.zero)
    trainer.maybe_resume()
    if cfg.train.capture_dir:
        tp_context(trainer.model).capture = _capture_fn(cfg, trainer, dims.tp_rank)
    out_dir = Path(cfg.train.out_dir)
    logger = _Logger(out_dir, log)
    c = cfg.compression
    if log:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.toml").write_text(config_to_toml(cfg))
        n = sum(q.numel() for q in trainer.model.parameters())
        print(
            f"[taco] {cfg.model.kind} {dims} world={world} params/rank={n / 1e6:.2f}M "
            f"microbatches={p.microbatches} schedule={p.pp_schedule} codecs: tp={c.tp_codec} "
            f"pp={c.pp_codec} dp={c.dp_codec} out={out_dir}",
            flush=True,
        )
    t = cfg.train
    tokens_per_step = t.batch_size * cfg.model.seq_len
    t_train = 0.0
    wire_sum = dict.fromkeys(AXES, 0.0)
    raw_sum = dict.fromkeys(AXES, 0.0)
    steps_done = 0
    val = float("nan")
    start_step = trainer.step
    while trainer.step < t.steps:
        st = trainer.train_step()
        step = trainer.step
        t_train += st.seconds
        for a in AXES:
            wire_sum[a] += st.wire_bytes[a]
            raw_sum[a] += st.raw_bytes[a]
        steps_done += 1
        rec: dict[str, Any] = {
            "step": step,
            "loss": st.loss,
            "lr": trainer.opt.param_groups[0]["lr"],
            "grad_norm": st.grad_norm,
            "step_s": st.seconds,
        }
        for a in AXES:
            rec[f"{a}_wire_bytes"] = st.wire_bytes[a]
            rec[f"{a}_raw_bytes"] = st.raw_bytes[a]
        if step % t.eval_interval == 0 or step == t.steps:
            val = trainer.evaluate()
            rec["val_loss"] = val
        if t.checkpoint_interval and (step % t.checkpoint_interval == 0 or step == t.steps):
            trainer.save()
        logger.write(rec)
        if log and (step % t.log_interval == 0 or step == t.steps or "val_loss" in rec):
            tps = tokens_per_step * steps_done / max(t_train, 1e-9)
            eta = (t.steps - step) * t_train / steps_done
            bar = "#" * int(20 * step / t.steps)
            extra = f" val {val:.4f}" if "val_loss" in rec else ""
            wire = " ".join(
                f"{a} {st.wire_bytes[a] / 2**20:.2f}/{st.raw_bytes[a] / 2**20:.2f}"
                for a in AXES
                if st.raw_bytes[a]
            )
            print(
                f"[{bar:<20}] step {step:>5}/{t.steps} loss {st.loss:.4f}{extra} lr {rec['lr']:.2e} "
                f"{tps:,.0f} tok/s wire/raw MiB/step {wire or '-'} eta {eta:.0f}s",
                flush=True,
            )
    logger.close()
    n = max(steps_done, 1)
    summary = {
        "final_val_loss": val,
        "steps": trainer.step,
        "resumed_from": start_step,
        "tokens_per_s": tokens_per_step * steps_done / max(t_train, 1e-9),
        **{f"{a}_wire_bytes_per_step": wire_sum[a] / n for a in AXES},
        **{f"{a}_raw_bytes_per_step": raw_sum[a] / n for a in AXES},
        "mesh": str(dims),
        "microbatches": p.microbatches,
        "pp_schedule": str(p.pp_schedule),
        "tp_codec": c.tp_codec,
        "pp_codec": c.pp_codec,
        "dp_codec": c.dp_codec,
    }
    if log:
        stats = "\n\n".join(f"[{a}]\n{trainer.policies[a].stats.summary()}" for a in AXES)
        (out_dir / "comm_stats.txt").write_text(stats + "\n")
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (MASTER_PORT of locally spawned ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(cfg: Config) -> str:
    b = cfg.parallel.backend.value
    if b == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return b


def _spawned(rank: int, world: int, port: int, cfg: Config, data_dir: Path, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        _backend(cfg), rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        res = run_rank(cfg, data_dir)
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(res, f)
    finally:
        dist.destroy_process_group()


def check_start_up(cfg: Config) -> None:
    """Mesh problems the config alone cannot see, raised before any rank starts (ValueError)."""
    p, m = cfg.parallel, cfg.model
    n_layer = m.n_layer
    hf = Path(m.init_from) / "config.json" if m.init_from else None
    if hf is not None and hf.is_file():  # an HF checkpoint decides the depth
        meta = json.loads(hf.read_text())
        n_layer = int(meta.get("n_layer", meta.get("num_hidden_layers", n_layer)))
    stage_layers(n_layer, p.pp, 0)  # ValueError naming the fix when pp > layers


def launch(cfg: Config) -> dict[str, Any]:
    """Run `cfg` on its dp*pp*tp ranks: spawned locally, or as this torchrun rank."""
    if not cfg.train.out_dir:
        cfg.train.out_dir = str(Path("runs") / (cfg.train.name or "run"))
    world = cfg.parallel.world_size
    p = cfg.parallel
    check_start_up(cfg)
    resume_dir = find_checkpoint(cfg.train.resume, cfg.train.out_dir)
    if resume_dir is not None:
        check_mesh(resume_dir, {"dp": p.dp, "pp": p.pp, "tp": p.tp, "sp": int(p.sp and p.tp > 1)})
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        started = int(os.environ["WORLD_SIZE"])
        if started != world:  # before joining: a wrong mesh must not hang in init_process_group
            raise ValueError(
                f"parallel.dp*pp*tp = {p.dp}*{p.pp}*{p.tp} = {world} but torchrun started {started} "
                "ranks: change parallel.dp/pp/tp or torchrun's --nproc-per-node/--nnodes"
            )
        dist.init_process_group(_backend(cfg), timeout=datetime.timedelta(seconds=300))
        if dist.get_rank() == 0:
            resolve_data_dir(cfg.data, prepare=True)
        dist.barrier()
        try:
            return run_rank(cfg, resolve_data_dir(cfg.data))
        finally:
            dist.destroy_process_group()
    data_dir = resolve_data_dir(cfg.data, prepare=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pkl")
        t0 = time.time()
        mp.start_processes(
            _spawned,
            args=(world, free_port(), cfg, data_dir, out),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        with open(out, "rb") as f:
            res = pickle.load(f)
    res["wall_s"] = time.time() - t0
    print(
        f"[taco] done in {res['wall_s']:.0f}s: final val loss {res['final_val_loss']:.4f}, "
        f"{res['tokens_per_s']:,.0f} tok/s",
        file=sys.stderr,
        flush=True,
    )
    return res
