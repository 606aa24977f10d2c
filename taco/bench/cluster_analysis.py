"""Analysis of `taco bench cluster` measurements (docs/design.md 3): the report rows and the cost model.

Why this file exists: `cluster.py` runs the training jobs and records what they measured
(`cluster_records.py`); this turns those records into the report (per-run means, the
communication share f, the wire ratio r, speedup, ideal speedup 1 / (1 - f + f / r), loss gaps)
and into the inputs and predictions of the cost model (`cost_model.py`). It starts no process and
needs no root, so a saved sweep re-analyses anywhere (`--from-json`). It judges nothing:
docs/cluster.md states one issue's criteria and how the saved sweep fared against them.

    meta, results, rates = load_sweep("docs/cluster_sweep.json")        # cluster_report.py
    report = analyse(results, Sweep.of(cfg, modes=["bf16"], codecs=["taco"], warmup=3), rates)
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any

from . import cluster_overlap as overlap
from . import cost_model as cm
from .cluster_noise import CONTROL, no_effect, noise_floors, ratio_interval, round_means
from .cluster_records import LinkResult, RunRecord, RunSummary, pool_runs

AUTO_CODEC = "taco"
"""the codec of the "auto" run (compression.when = "auto" keeps it only where it pays)"""


def auto_base(label: str) -> str | None:
    """The codec an auto run keeps where it pays: "auto" -> AUTO_CODEC, "auto:int6-hadamard" ->
    "int6-hadamard"; None for a run that is not an auto run."""
    if label == "auto":
        return AUTO_CODEC
    return label.partition(":")[2] or None if label.startswith("auto:") else None

# ----------------------------------------------------------------------------- the cost model's view


@dataclass(frozen=True)
class Sweep:
    """How to read a sweep: its modes and codecs, warm-up steps, the TP message, the tc settings."""

    modes: list[str]
    codecs: list[str]
    warmup: int
    tokens: int
    """tokens per step (batch x sequence length)"""
    hidden: int
    slices: int
    """`compression.slices`: pipelined slices of a compressed all-reduce"""
    burst: str = "32kb"
    delay_ms: float = 0.0
    model_codec: str = "inplace"
    """the model's codec cost: "inplace" (measured inside training) or "microbench" (`codec_rates`)"""
    all_reduce: str = "auto"
    """the compressed all-reduce algorithm the runs used (`compression.tp_all_reduce`; `load_sweep`
    reads sweeps saved before it as the two-shot)"""
    overlap_pieces: int = 2
    """`parallel.tp_overlap_chunks` of the "+overlap" rows (`cluster_overlap.py`)"""
    fused_reduce: bool = True
    """whether the runs timed the all-reduce's re-encode under decode_s (the fused decode-sum-encode,
    issue 12) rather than under encode_s (sweeps saved before it: False)"""
    peers: list[str] = dataclasses.field(default_factory=list)
    """labels of the peer runs (`peers.label`: "peer:megatron", "peer:dtensor"), uncompressed"""

    @classmethod
    def of(cls, cfg: Any, **kw: Any) -> Sweep:
        """The message shape from a training config; the rest as given."""
        return cls(tokens=cfg.train.batch_size * cfg.model.seq_len, hidden=cfg.model.hidden,
                   slices=cfg.compression.slices, all_reduce=cfg.compression.tp_all_reduce,
                   overlap_pieces=cfg.parallel.tp_overlap_chunks, **kw)  # fmt: skip

    @property
    def numel(self) -> int:
        """Elements of one TP message."""
        return self.tokens * self.hidden


@dataclass
class ModelInputs:
    """What the model takes from the uncapped runs of one mode (see `model_inputs`)."""

    compute_s: float
    messages: list[cm.Message]
    world: int
    codecs: dict[str, cm.CodecCost]
    wait_s: dict[str, float]
    """per run ("none" and each codec): fixed seconds per collective that bytes in flight can hide"""

    def to_json(self) -> dict[str, Any]:
        return dict(compute_s=self.compute_s, messages=len(self.messages), world=self.world,
                    codecs={c: vars(k) for c, k in self.codecs.items()}, wait_s=self.wait_s)  # fmt: skip

    def predict(
        self, link: cm.Link, codec: str, costs: Any, slices: int, algo: str = "auto", pieces: int = 1
    ) -> float:
        """Modeled step seconds of run `codec`: the baseline's measured compute + every TP collective
        on `link` with that run's measured `wait`, coding (`costs`) included for a codec; `pieces` > 1:
        batch-split overlap (`cost_model.overlapped_step`)."""
        link = dataclasses.replace(link, wait=self.wait_s.get(codec, self.wait_s["none"]))
        msgs = self.messages
        return cm.step_time_measured_compute(
            self.compute_s, msgs, self.world, link, costs, slices, algo, pieces
        )[0]


def wire_dtype_check(rec: RunRecord, numel: int) -> dict[str, float]:
    """Bytes per element of the forward and backward TP sites of a plain run (2: bf16, 4: fp32)."""
    n = rec.world
    out = {}
    for direction in ("fwd", "bwd"):
        sites = [s for name, s in rec.sites.items() if name.endswith("." + direction) and s.calls]
        calls = sum(s.calls for s in sites)
        raw = sum(s.raw_bytes for s in sites)
        out[direction] = raw / (calls * numel * 2 * (n - 1) / n) if calls else float("nan")
    return out


def messages(rec: RunRecord, numel: int) -> list[cm.Message]:
    """The TP all-reduces of one step of a plain run, with their measured bytes per element."""
    n, steps = rec.world, len(rec.steps)
    msgs = []
    for s in rec.sites.values():
        per_call = s.raw_bytes / s.calls
        elem = per_call / (numel * 2 * (n - 1) / n)
        msgs += [cm.Message("all_reduce", numel, round(elem))] * round(s.calls / steps)
    return msgs


def _codec_costs(rates: dict[str, dict[str, float]], codec: str) -> dict[float, cm.CodecCost]:
    """Microbenchmarked coding cost per input dtype (2: bf16, 4: fp32 bytes per element)."""
    out = {}
    for dt_name, elem in (("bf16", 2.0), ("fp32", 4.0)):
        r = rates.get(f"{codec}/{dt_name}")
        if r:
            out[elem] = cm.CodecCost(codec, r["bytes_per_elem"], r["encode"], r["decode"])
    return out


def inplace_codec_cost(
    rec: RunRecord, msgs: list[cm.Message], warmup: int, fused: bool = True
) -> cm.CodecCost:
    """The codec as measured inside an (uncapped) training run: elements coded per second, and
    wire bytes per element, over the step's all-reduces (two-shot counts).

    encode_s times the first encode ((N-1)/N n elements); decode_s the fused decode-sum-encode
    (which also re-encodes n/N elements) and the final decode, (2N-1)/N n decoded in all. The
    re-encode is charged at the measured encode rate, so that the cost model's n encoded and
    (2N-1)/N n decoded elements reproduce encode_s + decode_s exactly."""
    s, n = rec.summarize(warmup, 1), rec.world
    elems = sum(m.numel for m in msgs)
    if not fused:  # the unfused path timed all n encodes under encode_s
        per_encoded, decode_only = max(s.encode_s, 1e-12) / elems, max(s.decode_s, 1e-12)
    else:
        per_encoded = max(s.encode_s, 1e-12) / ((n - 1) / n * elems)
        decode_only = max(s.decode_s - per_encoded * elems / n, 1e-12)
    return cm.CodecCost(
        rec.codec,
        bytes_per_elem=s.wire_bytes / (2 * (n - 1) / n * elems),
        encode_rate=1 / per_encoded,
        decode_rate=(2 * n - 1) / n * elems / decode_only,
    )


def tc_bytes(size: str) -> float:
    """A tc size ("32kb", "1mb", "256kbit", "1500") in bytes (tc: k = 1024)."""
    t = size.strip().lower()
    units = {"kbit": 128, "mbit": 131072, "bit": 0.125, "kb": 1024, "k": 1024, "mb": 1 << 20, "m": 1 << 20,
             "gb": 1 << 30, "g": 1 << 30, "b": 1}  # fmt: skip
    for unit, mult in units.items():
        if t.endswith(unit):
            return float(t[: -len(unit)]) * mult
    return float(t)


def link_of(res: LinkResult, burst: str, delay_ms: float = 0.0) -> cm.Link:
    """The emulated link of one rate as the model sees it: bandwidth = the TCP bulk probe, the tc
    token bucket's burst and the netem delay per hop (none on the uncapped lo); the uncapped lo's
    latency is part of each run's measured `wait`."""
    capped = res.rate_mbit is not None
    return cm.Link("emulated lo" if capped else "lo", res.probe["bytes_per_s"],
                   delay_ms / 1e3 if capped else 0.0, shared=True,
                   burst=tc_bytes(burst) if capped else 0.0)  # fmt: skip


def _wait(rec: RunRecord, msgs: list[cm.Message], link: cm.Link, warmup: int) -> float:
    """Seconds per TP collective of an uncapped run beyond its bytes on the uncapped lo: latency plus
    the ranks waiting for each other (compute skew on a shared CPU)."""
    s, n = rec.summarize(warmup, 1), rec.world
    per_rank = s.wire_bytes / len(msgs)
    return max(0.0, s.comm_s / len(msgs) - link.transfer(per_rank, n, 0))


def model_inputs(unc: LinkResult, mode: str, sweep: Sweep) -> ModelInputs:
    """What the model takes from the uncapped runs of one mode: compute seconds (baseline step minus
    its TP communication), the step's TP messages, each codec's in-place cost, and per run (baseline
    and codecs) the per-collective `wait` that bytes in flight can hide on a slower link."""
    base = unc.run(mode, "none")
    if base is None:
        raise ValueError(f"no uncapped baseline run of mode {mode!r}")
    s = base.summarize(sweep.warmup, 1)
    msgs = messages(base, sweep.numel)
    link = link_of(unc, sweep.burst)
    runs = {c: r for c in dict.fromkeys(["none", *sweep.codecs]) if (r := unc.run(mode, c)) is not None}
    fused = sweep.fused_reduce
    codecs = {c: inplace_codec_cost(r, msgs, sweep.warmup, fused) for c, r in runs.items() if c != "none"}
    waits = {c: _wait(r, msgs, link, sweep.warmup) for c, r in runs.items()}
    return ModelInputs(s.step_s - s.comm_s, msgs, base.world, codecs, waits)


def _model_codec(inp: ModelInputs, rates: dict, codec: str, source: str) -> Any:
    if codec == "none":
        return None
    return inp.codecs.get(codec) if source == "inplace" else _codec_costs(rates, codec)


def model_step(inp: ModelInputs, rates: dict, codec: str, sweep: Sweep, link: cm.Link) -> float:
    """Modeled step seconds of run `codec` on `link`. An auto run ("auto", "auto:CODEC") decides per
    site between plain and its codec (`auto_base`) on the same trade-off, so its model is the faster
    of the two (every TP message of these runs has one size): the codec's costs from its own run when
    the sweep has one, else the
    auto run's (its uncapped run may have chosen plain: then they are plain's)."""
    name, ov = overlap.split_label(codec)
    if ov:  # "CODEC+overlap" / "+chunked": CODEC's costs (its own run's where measured), pieces
        costs = None
        if name != "none":
            costs = _model_codec(inp, rates, codec, sweep.model_codec) or _model_codec(
                inp, rates, name, sweep.model_codec
            )
        k = overlap.pieces(codec, sweep.overlap_pieces, inp.world)
        return inp.predict(link, codec, costs, sweep.slices, sweep.all_reduce, k)
    base = auto_base(codec)
    if base is None:
        costs = _model_codec(inp, rates, codec, sweep.model_codec)
        return inp.predict(link, codec, costs, sweep.slices, sweep.all_reduce)
    times = [inp.predict(link, "none", None, sweep.slices, sweep.all_reduce)]
    for c in (base, codec):
        if costs := _model_codec(inp, rates, c, sweep.model_codec):
            times.append(inp.predict(link, c, costs, sweep.slices, sweep.all_reduce))
    return min(times)


# ----------------------------------------------------------------------------- the report


@dataclass
class ReportRow:
    """One run against its mode's uncompressed baseline at the same link."""

    mode: str
    rate_mbit: float | None
    codec: str
    run: RunSummary
    f: float
    """the baseline step's share spent inside TP collectives, at this link"""
    f_cap: float
    """1 - (uncapped compute / baseline step): f as the uncapped reference sees it (nan without one)"""
    r: float
    """wire ratio: the baseline's wire bytes / this run's"""
    speedup: float
    ideal: float
    """1 / (1 - f + f / r); for a "+overlap" row 1 / max(1 - f, f / r) (`cluster_overlap.py`)"""
    val_gap_pct: float
    train_gap_pct: float
    curve_gap_pct: float
    """mean per-step training-loss difference to the baseline (same batches), %"""
    curve_max_pct: float
    model_step_s: float | None = None
    """the cost model's step time (None without uncapped reference runs)"""
    speedup_ci95: tuple[float, float] | None = None
    """95% interval of the speedup from the paired rounds of `--repeats` (`cluster_noise.py`)"""
    noise_floor: float | None = None
    """this link's A/A half-width (`cluster_noise.py`), None without a control"""
    best_peer: str | None = None
    """the fastest peer run at this mode and link (lowest pooled step time), None without peers"""
    peer_speedup: float | None = None
    """the best peer's step time / this run's"""
    peer_ci95: tuple[float, float] | None = None
    """95% interval of `peer_speedup` from the paired rounds (None for the best peer itself)"""
    over_codec: float | None = None
    """an overlap row: its codec's row without the overlap (same link), step time / this row's"""
    over_codec_ci95: tuple[float, float] | None = None
    """95% interval of `over_codec` from the paired rounds"""

    @property
    def no_effect(self) -> bool:
        """The interval contains 1.0: no effect measured."""
        return no_effect(self.speedup_ci95)

    @property
    def of_ideal(self) -> float:
        return self.speedup / self.ideal

    @property
    def model_err_pct(self) -> float | None:
        if self.model_step_s is None:
            return None
        return 100 * (self.model_step_s - self.run.step_s) / self.run.step_s

    def to_json(self) -> dict[str, Any]:
        d = dict(mode=self.mode, rate_mbit=self.rate_mbit, codec=self.codec, **dataclasses.asdict(self.run),
                 f=self.f, f_cap=self.f_cap, r=self.r, speedup=self.speedup, ideal=self.ideal,
                 val_gap_pct=self.val_gap_pct, train_gap_pct=self.train_gap_pct,
                 curve_gap_pct=self.curve_gap_pct, curve_max_pct=self.curve_max_pct,
                 of_ideal=self.of_ideal, speedup_ci95=self.speedup_ci95, noise_floor=self.noise_floor,
                 no_effect=self.no_effect, best_peer=self.best_peer, peer_speedup=self.peer_speedup,
                 peer_ci95=self.peer_ci95, peer_no_effect=no_effect(self.peer_ci95),
                 over_codec=self.over_codec, over_codec_ci95=self.over_codec_ci95)  # fmt: skip
        if self.model_step_s is not None:
            d.update(model_step_s=self.model_step_s, model_err_pct=self.model_err_pct)
        return d


@dataclass
class ClusterReport:
    """Everything the analysis of a sweep derives: rows, dtype checks, model inputs, links."""

    rows: list[ReportRow]
    wire_dtype: dict[str, dict[str, float]]
    """per mode: bytes per element on the wire of the forward and backward TP sites"""
    model_inputs: dict[str, ModelInputs]
    links: dict[float | None, dict[str, float]]
    """per rate: the calibration plus the probe's bandwidth and round trip"""
    codec_rates: dict[str, dict[str, float]]
    noise_floor: float | None = None
    """the largest A/A 95% half-width over the sweep's links (None without a control)"""

    def to_json(self) -> dict[str, Any]:
        return dict(rows=[r.to_json() for r in self.rows], wire_dtype=self.wire_dtype,
                    model_inputs={m: v.to_json() for m, v in self.model_inputs.items()}, links=self.links,
                    codec_rates=self.codec_rates, noise_floor=self.noise_floor)  # fmt: skip


def _gap(s: RunSummary, base: RunSummary, key: str) -> float:
    return 100 * (getattr(s, key) - getattr(base, key)) / getattr(base, key)


def curve_gap(rec: RunRecord, base: RunRecord) -> tuple[float, float]:
    """Per-step relative training-loss difference to the baseline (same batches): mean and max |.|, %."""
    d = [100 * (a.loss - b.loss) / b.loss for a, b in zip(rec.steps, base.steps)]
    return statistics.fmean(d), max(abs(x) for x in d)


def analyse(results: list[LinkResult], sweep: Sweep, rates: dict) -> ClusterReport:
    """Rows of the report (one per mode x link x codec, the A/A control's too), dtype checks and model
    inputs per mode; with repeated rounds each row's speedup interval and its link's noise floor."""
    rounds = round_means(results, sweep.warmup)  # per run, before the rounds are pooled
    floors = noise_floors(rounds)
    results = pool_runs(results, sweep.warmup)
    runs = {(r.mode, r.rate_mbit, r.codec): r for res in results for r in res.runs}
    rows, checks, inputs = [], {}, {}
    for mode in sweep.modes:
        unc = next((r for r in results if r.rate_mbit is None), None)
        if unc is not None and (mode, None, "none") in runs:
            checks[mode] = wire_dtype_check(runs[(mode, None, "none")], sweep.numel)
            inputs[mode] = model_inputs(unc, mode, sweep)
        for res in results:
            rate = res.rate_mbit
            base_rec = runs.get((mode, rate, "none"))
            if base_rec is None:
                continue
            base = base_rec.summarize(sweep.warmup, sweep.tokens)
            f = base.comm_s / base.step_s
            f_cap = 1 - inputs[mode].compute_s / base.step_s if mode in inputs else float("nan")
            for codec in ["none", CONTROL, *sweep.codecs, *sweep.peers]:
                rec = runs.get((mode, rate, codec))
                if rec is None or (codec == "none" and codec in sweep.codecs):
                    continue
                s = rec.summarize(sweep.warmup, sweep.tokens)
                r = base.wire_bytes / s.wire_bytes if s.wire_bytes else 1.0
                curve_mean, curve_max = curve_gap(rec, base_rec)
                row = ReportRow(mode, rate, codec, s, f=f, f_cap=f_cap, r=r, speedup=base.step_s / s.step_s,
                                ideal=overlap.ideal(codec, f, r), val_gap_pct=_gap(s, base, "val_loss"),
                                train_gap_pct=_gap(s, base, "train_loss"), curve_gap_pct=curve_mean,
                                curve_max_pct=curve_max)  # fmt: skip
                if codec != "none":  # paired rounds: this run against the baseline of the same round
                    pair = rounds[(mode, rate, "none")], rounds[(mode, rate, codec)]
                    row.speedup_ci95 = ratio_interval(*pair)
                row.noise_floor = floors.get((mode, rate))
                if mode in inputs and codec != CONTROL and codec not in sweep.peers:
                    link = link_of(res, sweep.burst, sweep.delay_ms)
                    row.model_step_s = model_step(inputs[mode], rates, codec, sweep, link)
                rows.append(row)
    over_best_peer(rows, rounds, sweep.peers)
    over_codec_alone(rows, rounds)
    links = {
        res.rate_mbit: dict(res.calib, probe_bytes_per_s=res.probe["bytes_per_s"], rtt_s=res.probe["rtt_s"])
        for res in results
    }
    return ClusterReport(rows, checks, inputs, links, rates, max(floors.values(), default=None))


def over_codec_alone(rows: list[ReportRow], rounds: dict[tuple, list[float]]) -> None:
    """Each overlap row ("CODEC+overlap", "+overlap-auto", "+chunked") against CODEC's row of the
    same mode and link, without the overlap: the speedup the overlap adds, with the 95% interval of
    the paired rounds, set on the rows in place (no such row: left None)."""
    for r in rows:
        name, ov = overlap.split_label(r.codec)
        if not ov:
            continue
        alone = next((a for a in rows if (a.mode, a.rate_mbit, a.codec) == (r.mode, r.rate_mbit, name)), None)
        if alone is None:
            continue
        r.over_codec = alone.run.step_s / r.run.step_s
        key = (r.mode, r.rate_mbit)
        r.over_codec_ci95 = ratio_interval(rounds[(*key, name)], rounds[(*key, r.codec)])


def over_best_peer(rows: list[ReportRow], rounds: dict[tuple, list[float]], peers: list[str]) -> None:
    """Per (mode, link): the fastest peer run, and every row's speedup over it with the 95% interval
    of its paired rounds (`cluster_noise.ratio_interval`), set on the rows in place."""
    for mode, rate in dict.fromkeys((r.mode, r.rate_mbit) for r in rows):
        here = [r for r in rows if (r.mode, r.rate_mbit) == (mode, rate)]
        runs = [r for r in here if r.codec in peers]
        if not runs:
            continue
        best = min(runs, key=lambda r: r.run.step_s)
        for r in here:
            r.best_peer, r.peer_speedup = best.codec, best.run.step_s / r.run.step_s
            if r is not best:
                r.peer_ci95 = ratio_interval(rounds[(mode, rate, best.codec)], rounds[(mode, rate, r.codec)])


def model_curves(report: ClusterReport, sweep: Sweep) -> dict[str, list[tuple[float, float]]]:
    """Modeled speedup per "mode/codec" on a dense grid of link rates: bandwidth = rate x the probed
    efficiency, averaged over the capped links."""
    links = [(r, c) for r, c in report.links.items() if r]
    if not links or not report.model_inputs:
        return {}
    eff = statistics.fmean(c["probe_bytes_per_s"] * 8 / 1e6 / r for r, c in links)
    lo, hi = min(r for r, _ in links), max(r for r, _ in links)
    grid = [lo * (hi / lo) ** (i / 40) for i in range(41)] if hi > lo else [lo]
    delay_s, burst = sweep.delay_ms / 1e3, tc_bytes(sweep.burst)
    curves: dict[str, list[tuple[float, float]]] = {}
    for mode, inp in report.model_inputs.items():
        for codec in sweep.codecs:
            pts = []
            for rate in grid:
                bw = rate * 1e6 / 8 * eff
                link = cm.Link("emulated lo", bw, delay_s, shared=True, burst=burst)
                base = inp.predict(link, "none", None, sweep.slices, sweep.all_reduce)
                pts.append((rate, base / model_step(inp, report.codec_rates, codec, sweep, link)))
            curves[f"{mode}/{codec}"] = pts
    return curves
