"""The measured records of `taco bench cluster`, typed, and their JSON form.

Why this file exists: the runs of a sweep happen in worker processes inside a capped namespace
(`cluster.py`) and reach the parent, and later `--from-json`, as JSON; the analysis
(`cluster_analysis.py`) reads them as these dataclasses instead of dictionaries. Each record
converts from and to the JSON the worker writes (`from_json` / `to_json`), so a saved sweep such
as docs/cluster_sweep.json keeps loading. Here are the measurements, a run's own means
(`RunRecord.summarize`) and the pooling of repeated runs (`pool_runs`); whatever
compares runs with each other or with the cost model is `cluster_analysis.py`'s.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

MODES = {
    "bf16": "train.dtype=bf16, parallel.tp_comm_dtype=bf16: every TP collective in bf16 (Megatron)",
    "autocast": "train.dtype=bf16, parallel.tp_comm_dtype=input: as autocast leaves it (fwd bf16, bwd fp32)",
    "fp32": "train.dtype=fp32, fp32 on the wire",
}
"""The communication modes of a sweep (`--comm`), each with its own uncompressed baseline."""
PHASES = ("comm_s", "encode_s", "decode_s")

# ----------------------------------------------------------------------------- measured records


@dataclass
class Step:
    """One training step on rank 0: time, loss, and the TP policy's byte and phase counters."""

    step_s: float
    loss: float
    wire_bytes: float
    raw_bytes: float
    comm_s: float
    encode_s: float
    decode_s: float


@dataclass
class Site:
    """One TP collective site's totals over a run (e.g. `layers.0.attn.out.fwd`)."""

    calls: int
    raw_bytes: float
    wire_bytes: float


@dataclass(frozen=True)
class RunSummary:
    """Means over the timed steps (those after the warm-up) of one run."""

    step_s: float
    wire_bytes: float
    raw_bytes: float
    comm_s: float
    encode_s: float
    decode_s: float
    tokens_per_s: float
    val_loss: float
    train_loss: float
    """mean training loss of the last 5 steps"""
    timed_steps: int
    load: float
    """the highest 1-minute load average seen around the run (nan: not recorded)"""


@dataclass
class RunRecord:
    """What one training run (mode, codec, link rate) measured on rank 0."""

    mode: str
    codec: str
    rate_mbit: float | None
    world: int
    steps: list[Step]
    sites: dict[str, Site]
    val_loss: float
    loadavg: list[float] = field(default_factory=list)
    repeats: int = 1
    """runs pooled into this one (`pool_runs`: `--repeats`, the uncapped sets)"""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunRecord:
        return cls(d["mode"], d["codec"], d["rate_mbit"], d["world"], [Step(**s) for s in d["steps"]],
                   {n: Site(**s) for n, s in d["sites"].items()}, d["val_loss"], list(d.get("loadavg", [])),
                   d.get("repeats", 1))  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        d = dict(steps=[dataclasses.asdict(s) for s in self.steps], val_loss=self.val_loss,
                 sites={n: dataclasses.asdict(s) for n, s in self.sites.items()}, mode=self.mode,
                 codec=self.codec, rate_mbit=self.rate_mbit, world=self.world,
                 loadavg=self.loadavg)  # fmt: skip
        return d if self.repeats == 1 else dict(d, repeats=self.repeats)

    def summarize(self, warmup: int, tokens_per_step: int) -> RunSummary:
        """Means over the steps after `warmup` (all of them if there are no more)."""
        steps = self.steps[warmup:] or self.steps
        keys = ("step_s", "wire_bytes", "raw_bytes", *PHASES)
        mean = {k: statistics.fmean(getattr(s, k) for s in steps) for k in keys}
        losses = [s.loss for s in self.steps]
        return RunSummary(**mean, tokens_per_s=tokens_per_step / mean["step_s"], val_loss=self.val_loss,
                          train_loss=statistics.fmean(losses[-5:]), timed_steps=len(steps),
                          load=max(self.loadavg or [float("nan")]))  # fmt: skip


@dataclass
class LinkResult:
    """Everything measured at one link rate (None: the host's uncapped lo)."""

    rate_mbit: float | None
    probe: dict[str, float]
    """`cluster.probe_link`: bytes_per_s of a bulk TCP stream, rtt_s, probe_bytes"""
    calib: dict[str, float]
    """`cluster.calibrate_link`: small_s / small_bytes, big_s / big_bytes, alpha_s"""
    runs: list[RunRecord]
    qdisc: str | None = None
    """tc's statistics of the capped lo after the runs"""

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LinkResult:
        runs = [RunRecord.from_json(r) for r in d["runs"]]
        return cls(d["rate_mbit"], dict(d["probe"]), dict(d["calib"]), runs, d.get("qdisc"))

    def to_json(self) -> dict[str, Any]:
        d = dict(rate_mbit=self.rate_mbit, probe=self.probe, calib=self.calib,
                 runs=[r.to_json() for r in self.runs])  # fmt: skip
        return d if self.qdisc is None else dict(d, qdisc=self.qdisc)

    def run(self, mode: str, codec: str) -> RunRecord | None:
        return {(r.mode, r.codec): r for r in self.runs}.get((mode, codec))


def _pool(runs: list[RunRecord], warmup: int) -> list[RunRecord]:
    """Runs of the same (mode, codec) as one record, in first-seen order: the first run's steps, then
    the timed steps of each later one (its own warm-up dropped), site totals summed."""
    pooled = []
    for key in dict.fromkeys((r.mode, r.codec) for r in runs):
        same = [r for r in runs if (r.mode, r.codec) == key]
        first = same[0]
        if len(same) == 1:
            pooled.append(first)
            continue
        steps = first.steps + [st for r in same[1:] for st in r.steps[warmup:]]
        keys = [f.name for f in dataclasses.fields(Site)]
        sites = {n: Site(**{k: sum(getattr(r.sites[n], k) for r in same) for k in keys}) for n in first.sites}
        loads = [x for r in same for x in r.loadavg]
        repeats = sum(r.repeats for r in same)
        pooled.append(dataclasses.replace(first, steps=steps, sites=sites, loadavg=loads, repeats=repeats))
    return pooled


def pool_runs(results: list[LinkResult], warmup: int) -> list[LinkResult]:
    """Repeated runs pooled (`--repeats`, and the uncapped sets before and after a sweep): one uncapped
    entry first, then one record per (mode, codec) at each capped link, timed steps concatenated."""
    sets = [r for r in results if r.rate_mbit is None]
    rest = [dataclasses.replace(r, runs=_pool(r.runs, warmup)) for r in results if r.rate_mbit is not None]
    if not sets:
        return rest
    runs = _pool([r for s in sets for r in s.runs], warmup)
    if len(sets) == 1:
        return [dataclasses.replace(sets[0], runs=runs), *rest]

    def mean(key: str) -> dict[str, float]:
        return {k: statistics.fmean(getattr(s, key)[k] for s in sets) for k in getattr(sets[0], key)}

    return [LinkResult(None, mean("probe"), mean("calib"), runs), *rest]
