"""The outputs of `taco bench cluster`: terminal table, markdown table, the `--json` file, figures.

Why this file exists: one analysed sweep (`cluster_analysis.ClusterReport`) is shown several ways
(the terminal table of every run, the markdown table of the capped runs that docs/results.md and
docs/cluster.md quote, the speedup and model-validation PNGs of `plots.py`) and saved as one JSON
document that `--from-json` reads back (`write_json` / `load_sweep`); that formatting and file
layout is kept apart from the orchestration (`cluster.py`) and from the arithmetic of the analysis.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .cluster_analysis import ClusterReport, ReportRow
from .cluster_noise import CONTROL, no_effect
from .cluster_overlap import split_label
from .cluster_records import MODES, LinkResult
from .peers import is_peer

NO_EFFECT = "no effect measured"


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and v != v) else format(v, spec)


def interval_text(ci: tuple[float, float] | None) -> str:
    """A 95% interval as "lo-hi" ("-" without repeated rounds)."""
    return "-" if ci is None else f"{ci[0]:.3f}-{ci[1]:.3f}"


def ci_text(r: ReportRow, peer: bool = False) -> str:
    """A row's 95% speedup interval over the baseline (over the best peer with `peer`)."""
    return interval_text(r.peer_ci95 if peer else r.speedup_ci95)


def link_text(r: ReportRow) -> str:
    """The row's link in a quotable line: "200 Mbit/s" or "uncapped"."""
    return f"{r.rate_mbit:g} Mbit/s" if r.rate_mbit else "uncapped"


def peer_text(r: ReportRow) -> str:
    """A row's speedup over the best peer ("-" without peers)."""
    return "-" if r.peer_speedup is None else f"{r.peer_speedup:.2f}"


def headline(report: ClusterReport) -> list[str]:
    """One quotable line per compressed or baseline row at each link: its speedup over the project's
    uncompressed baseline and over the best peer, each with its 95% interval."""
    lines = []
    for r in report.rows:
        if r.codec == CONTROL or r.best_peer is None or is_peer(r.codec):
            continue
        base = f"{r.speedup:.2f}x over the uncompressed baseline (95% CI {ci_text(r)}), "
        base = "" if r.codec == "none" else base
        peer = f"{r.peer_speedup:.2f}x over the best peer, {r.best_peer} (95% CI {ci_text(r, True)})"
        lines.append(f"{r.codec} ({r.mode}, {link_text(r)}): {base}{peer}")
    return lines


def format_report(report: ClusterReport) -> str:
    """Every row of every mode, one block per mode headed by its wire-dtype check; rows whose 95%
    interval contains 1.0 end in "no effect measured"; the noise floor of each link last."""
    head = (f"{'link':>10} {'codec':<14} {'step ms':>9} {'tok/s':>7} {'f':>5} {'f_cap':>5} {'r':>5} "
            f"{'speedup':>7} {'95% CI':>11} {'ideal':>6} {'of ideal':>8} {'model ms':>9} {'err %':>6} "
            f"{'val loss':>8} {'gap %':>6} {'train gap %':>11} {'curve %':>7} {'load':>5} {'MB/step':>7} "
            f"{'vs peer':>7} {'95% CI':>11}")  # fmt: skip
    lines = []
    for mode in dict.fromkeys(r.mode for r in report.rows):
        chk = report.wire_dtype.get(mode)
        dt = f"; TP bytes/elem on the wire: fwd {chk['fwd']:.2f}, bwd {chk['bwd']:.2f}" if chk else ""
        lines += ["", f"comm {mode}: {MODES[mode]}{dt}", head]
        for r in (r for r in report.rows if r.mode == mode):
            link = f"{r.rate_mbit:g} Mb/s" if r.rate_mbit else "uncapped"
            base = r.codec == "none"
            no_ideal = base or r.codec == CONTROL or is_peer(r.codec)
            s = r.run
            model_ms = float("nan") if r.model_step_s is None else r.model_step_s * 1e3
            lines.append(
                f"{link:>10} {r.codec:<14} {s.step_s * 1e3:>9.1f} {s.tokens_per_s:>7.0f} "
                f"{r.f:>5.2f} {_fmt(r.f_cap, '>5.2f')} {r.r:>5.2f} {r.speedup:>7.2f} {ci_text(r):>11} "
                f"{r.ideal:>6.2f} {'-' if no_ideal else format(r.of_ideal, '>7.1%'):>8} "
                f"{_fmt(model_ms, '>9.1f')} "
                f"{_fmt(r.model_err_pct, '>+6.1f')} {s.val_loss:>8.4f} "
                f"{'-' if base else format(r.val_gap_pct, '>+6.3f'):>6} "
                f"{'-' if base else format(r.train_gap_pct, '>+11.3f'):>11} "
                f"{'-' if base else format(r.curve_gap_pct, '>+7.3f'):>7} {_fmt(s.load, '>5.1f')} "
                f"{s.wire_bytes / 1e6:>7.2f} {peer_text(r):>7} {ci_text(r, True):>11}"
                + (f"  {NO_EFFECT}" if r.no_effect else "")
            )
    floors = {(r.mode, r.rate_mbit): r.noise_floor for r in report.rows if r.noise_floor is not None}
    if floors:
        links = ", ".join(f"{m} {f'{k:g} Mb/s' if k else 'uncapped'} {v:.1%}" for (m, k), v in floors.items())
        floor = f"{report.noise_floor:.1%}"
        lines += ["", f"noise floor (the A/A control's 95% half-width): {floor}; per link: {links}"]
    if quotes := headline(report):
        lines += ["", "over the best peer (vs peer: the best peer's step time / the row's):", *quotes]
    if adds := overlap_gains(report):
        lines += ["", "what the overlap adds (the codec's step without it / the row's):", *adds]
    return "\n".join(lines)


def overlap_gains(report: ClusterReport) -> list[str]:
    """One line per overlap row: its speedup over the same codec without the overlap, with the
    95% interval of the paired rounds ("no effect measured" when it contains 1.0)."""
    lines = []
    for r in report.rows:
        if r.over_codec is None:
            continue
        ci = r.over_codec_ci95
        tail = f", {NO_EFFECT}" if no_effect(ci) else ""
        gain = f"{r.over_codec:.2f}x over {split_label(r.codec)[0]} alone (95% CI {interval_text(ci)}){tail}"
        lines.append(f"{r.codec} ({r.mode}, {link_text(r)}): {gain}")
    return lines


def format_markdown(report: ClusterReport) -> str:
    """The capped rows of every mode as one markdown table (docs/cluster_sweep.md, docs/cluster.md's)."""
    rows = report.rows
    several = len({r.codec for r in rows if r.codec != "none"}) > 1  # then each row names its codec
    peers = any(r.best_peer for r in rows)  # then the speedup over the best peer beside the baseline's
    head = ["comm", "link Mbit/s", "baseline ms/step", "f", "TACO ms/step", "r", "speedup", "95% CI", "ideal",
            "of ideal", "model err base / codec", "val loss gap"]  # fmt: skip
    if several:
        head[4:5] = ["codec", "codec ms/step"]
    if peers:
        head += ["MB/step", "best peer", "over best peer", "95% CI (peer)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.codec == "none" or not r.rate_mbit:
            continue
        base = next(b for b in rows if (b.mode, b.rate_mbit, b.codec) == (r.mode, r.rate_mbit, "none"))
        err = "-"
        if r.model_err_pct is not None and base.model_err_pct is not None:
            err = f"{base.model_err_pct:+.1f}% / {r.model_err_pct:+.1f}%"
        speed = f"{NO_EFFECT} ({r.speedup:.2f}x)" if r.no_effect else f"**{r.speedup:.2f}x**"
        cells = [r.mode, f"{r.rate_mbit:g}", f"{base.run.step_s * 1e3:.0f}", f"{r.f:.2f}",
                 f"{r.run.step_s * 1e3:.0f}", f"{r.r:.2f}", speed, ci_text(r), f"{r.ideal:.2f}x",
                 "-" if is_peer(r.codec) else f"{r.of_ideal:.1%}", err, f"{r.val_gap_pct:+.2f}%"]  # fmt: skip
        if several:
            cells.insert(4, r.codec)
        if peers:
            over = _fmt(r.peer_speedup, ".2f") + "x" if r.peer_speedup is not None else "-"
            cells += [f"{r.run.wire_bytes / 1e6:.2f}", r.best_peer or "-", over, ci_text(r, True)]
        lines.append("| " + " | ".join(cells) + " |")
    if report.noise_floor is not None:
        lines += ["", f"Noise floor (the baseline against itself, {CONTROL}, 95% half-width): "
                      f"{report.noise_floor:.1%}."]  # fmt: skip
    if quotes := headline(report):
        lines += ["", "Over the best peer (its step time / the row's; 95% intervals, paired rounds):", ""]
        lines += [f"- {q}" for q in quotes]
    return "\n".join(lines)


def write_plots(report: ClusterReport, curves: dict[str, list[tuple[float, float]]], path: str) -> list[str]:
    """Speedup against bandwidth at `path`, and modeled against measured step time at PATH_model.png
    when the model ran; the paths written."""
    from .plots import plot_speedup, plot_validation

    plot_speedup(report.rows, curves, path)
    written = [path]
    if any(r.model_step_s is not None for r in report.rows):
        val = str(Path(path).with_name(Path(path).stem + "_model.png"))
        plot_validation(report.rows, val)
        written.append(val)
    return written


def write_json(path: str, meta: dict[str, Any], results: list[LinkResult], curves: dict,
               report: ClusterReport) -> None:  # fmt: skip
    """The `--json` file: how the sweep ran (`meta`), the raw results per link, and their analysis."""
    doc = dict(meta=meta, results=[r.to_json() for r in results], curves=curves, **report.to_json(),
               headline=headline(report))  # fmt: skip
    Path(path).write_text(json.dumps(doc, indent=1))


def load_sweep(path: str) -> tuple[dict[str, Any], list[LinkResult], dict[str, dict[str, float]]]:
    """(meta, results, codec rates) of a `--json` file: what `analyse` needs to re-derive the rest.
    A config saved before `compression.tp_all_reduce` existed ran the two-shot: it says so here."""
    saved = json.loads(Path(path).read_text())
    saved["meta"]["config"]["compression"].setdefault("tp_all_reduce", "two_shot")
    return saved["meta"], [LinkResult.from_json(r) for r in saved["results"]], saved["codec_rates"]
