"""Per-step bookkeeping kept off the collective path: byte counters and peak memory per window,
and the step records that wait for them.

Why this file exists: a step's statistics (bytes per axis, peak memory) are per rank, and the log
wants them averaged (bytes) or maximised (memory) over the job. Reducing them every step costs a
collective per step, which a slow link pays in latency. So each rank appends its own numbers to a
window, and the window is reduced with ONE all-gather when the trainer writes its records (log
steps, evaluations, the last step, a stop): the records (`StepRecords`) come out exact, per step,
a little later. The stop request rides on the step's gradient-norm reduction instead
(`taco.train.grads.MeshGrads.clip`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from taco.comm.compressed import all_gather_into


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    wire_bytes: dict[str, float]
    """per axis: bytes THIS rank put on the wire this step (`StatsWindow.reduce` averages them over ranks)"""
    raw_bytes: dict[str, float]
    """per axis: the same traffic uncompressed (the input dtype)"""
    seconds: float
    peak_mem: float = 0.0
    """bytes: this rank's peak memory so far (`taco.train.perf.peak_memory_bytes`)"""
    stop: bool = False
    """a rank was asked to stop (SIGINT/SIGTERM, `taco.train.stopping`): every rank stops here"""


@dataclass
class StatsWindow:
    """The per-step numbers of one rank since the last `reduce`, one row per step."""

    axes: tuple[str, ...]
    device: torch.device
    rows: list[list[float]] = field(default_factory=list)

    def add(self, st: StepStats) -> None:
        row = [v for a in self.axes for v in (st.wire_bytes[a], st.raw_bytes[a])]
        self.rows.append([*row, st.peak_mem])

    def reduce(self) -> list[tuple[dict[str, float], dict[str, float], float]]:
        """Per step of the window: (wire, raw) bytes per axis averaged over every rank of the job,
        and the largest peak memory of any rank. Collective over the job (one all-gather, one host
        read); every rank must call it after the same steps. Empties the window."""
        if not self.rows:
            return []
        mine = torch.tensor(self.rows, dtype=torch.float64, device=self.device)  # [k, 2A + 1]
        self.rows = []
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            every = mine.new_empty(world * mine.numel())
            all_gather_into(every, mine.view(-1))
            every = every.view(world, *mine.shape)
            mine = torch.cat([every[..., :-1].mean(0), every[..., -1:].amax(0)], dim=-1)
        out = []
        for row in mine.tolist():
            n = len(self.axes)
            wire = {a: row[2 * i] for i, a in enumerate(self.axes)}
            raw = {a: row[2 * i + 1] for i, a in enumerate(self.axes)}
            out.append((wire, raw, row[2 * n]))
        return out


class StepRecords:
    """The metrics records of the steps since the last `flush`, each written (`write`) once its
    window is reduced, with its bytes per axis and peak memory; the run's byte sums per axis."""

    def __init__(
        self, axes: tuple[str, ...], keys: tuple[str, ...], device: torch.device,
        write: Callable[[dict[str, Any]], None], recompute: bool,
    ) -> None:  # fmt: skip
        """`axes`: the axes of the records; `keys`: the window's (the axes, then "tp_recompute");
        `recompute`: activation recompute is on (its re-sent TP bytes get fields of their own)."""
        self.axes, self.write, self.recompute = axes, write, recompute
        self.window = StatsWindow(keys, device)
        self.pending: list[dict[str, Any]] = []
        self.wire_sum, self.raw_sum = dict.fromkeys(axes, 0.0), dict.fromkeys(axes, 0.0)

    def add(self, st: StepStats, rec: dict[str, Any]) -> None:
        self.window.add(st)
        self.pending.append(rec)

    def flush(self) -> None:
        """Reduce the window (collective over the job: every rank after the same steps) and write
        its records."""
        for r, (wire, raw, mem) in zip(self.pending, self.window.reduce()):
            r["peak_mem_gib"] = mem / 2**30
            for a in self.axes:
                self.wire_sum[a] += wire[a]
                self.raw_sum[a] += raw[a]
                r[f"{a}_wire_bytes"], r[f"{a}_raw_bytes"] = wire[a], raw[a]
            if self.recompute:  # recomputed TP traffic, not in tp_*
                r["tp_recompute_wire_bytes"] = wire["tp_recompute"]
                r["tp_recompute_raw_bytes"] = raw["tp_recompute"]
            self.write(r)
        self.pending = []
