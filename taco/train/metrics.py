"""Rank 0's record of a run: progress lines, `metrics.jsonl`, TensorBoard.

Why this file exists: the trainer's loop produces one record per step; how that record is shown
and stored is kept here, so the loop in `trainer.py` reads as the algorithm it is. (Captured TP
tensors: `taco.train.adaptive.observers.TensorCapture`.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from taco.train.run import AXES


class MetricsLogger:
    """Rank 0's outputs: progress lines on stdout, `metrics.jsonl` and TensorBoard scalars.

    On other ranks (`enabled=False`) every method is a no-op. A run starting (or resuming) at
    `start_step` keeps the records of steps <= start_step already in `metrics.jsonl` and hides
    TensorBoard's later ones (purge_step), so a resumed curve is not drawn twice.
    """

    def __init__(
        self, out_dir: Path, enabled: bool, steps: int, tensorboard: bool = True, start_step: int = 0
    ) -> None:
        self.enabled, self.steps = enabled, steps
        self.jsonl = None
        self.tb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = _open_truncated(out_dir / "metrics.jsonl", start_step)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = start_step + 1 if (out_dir / "tb").is_dir() else None
                self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=purge)
            except Exception as e:  # noqa: BLE001 - TensorBoard is optional
                print(f"[taco] TensorBoard disabled: {e}", flush=True)

    def write(self, rec: dict[str, Any]) -> None:
        """Append one step's record (`step` plus numbers) to metrics.jsonl and TensorBoard."""
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(rec) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, rec["step"])

    def progress(self, rec: dict[str, Any], tokens_per_s: float, eta_s: float, mfu: float = 0.0) -> None:
        """One progress line: bar, loss, validation loss if any, lr, tok/s, MFU (the mean since the
        start, as tok/s), peak memory, wire/raw MiB per axis, eta."""
        if not self.enabled:
            return
        step = rec["step"]
        bar = "#" * int(20 * step / self.steps)
        val = f" val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
        wire = " ".join(
            f"{a} {rec[f'{a}_wire_bytes'] / 2**20:.2f}/{rec[f'{a}_raw_bytes'] / 2**20:.2f}"
            for a in AXES
            if rec[f"{a}_raw_bytes"]
        )
        print(
            f"[{bar:<20}] step {step:>5}/{self.steps} loss {rec['loss']:.4f}{val} lr {rec['lr']:.2e} "
            f"{tokens_per_s:,.0f} tok/s mfu {100 * mfu:.2f}% mem {rec['peak_mem_gib']:.2f} GiB "
            f"wire/raw MiB/step {wire or '-'} eta {eta_s:.0f}s",
            flush=True,
        )

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


def _open_truncated(path: Path, last_step: int):
    """`path` opened for appending, without its records of steps after `last_step` (or unreadable)."""
    if path.is_file():
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= last_step:
                    keep.append(line + "\n")
            except (ValueError, KeyError, TypeError):
                pass
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        tmp.replace(path)
    return open(path, "a")
