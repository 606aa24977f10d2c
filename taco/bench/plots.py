"""Figures of the cluster benchmark: speedup against link bandwidth, measured and modeled (PNG).

Why this file exists: the question "from which link speed down does TP compression pay, and does
the cost model see it coming" is answered by one picture per communication dtype: the measured
speedups of `cluster.py` as markers, the model's curve over the same axes, and the ideal speedup
1 / (1 - f + f / r) of each measured point. matplotlib runs headless (Agg).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cluster_analysis import ReportRow


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str) -> None:
    """Lay out, write `path` (its folder created) at 120 dpi and free the figure."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _frame(ax: Any, xlabel: str, ylabel: str, legend_size: int = 8) -> None:
    """The frame every figure here shares: a log x axis, the axis labels, a grid on the major and
    minor ticks and the legend."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)


def plot_speedup(rows: list[ReportRow], curves: dict[str, list[tuple[float, float]]], path: str) -> None:
    """One panel per comm mode: measured speedup (o, with its 95% interval when the sweep has repeated
    rounds), ideal (x) and model (line) vs Mbit/s; the A/A control's band shaded around 1.0. With
    peers: each peer's own speedup (^), and each codec's speedup over the best peer (hollow squares)."""
    from .cluster_noise import CONTROL
    from .peers import is_peer

    plt = _pyplot()
    modes = list(dict.fromkeys(r.mode for r in rows if r.codec not in ("none", CONTROL) and r.rate_mbit))
    if not modes:
        raise ValueError("no capped runs with a codec to plot")
    fig, axes = plt.subplots(1, len(modes), figsize=(5.2 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        codecs = dict.fromkeys(r.codec for r in rows if r.mode == mode and r.codec not in ("none", CONTROL))
        for i, codec in enumerate(codecs):
            color = f"C{i}"
            sel = sorted((r for r in rows if (r.mode, r.codec) == (mode, codec) and r.rate_mbit),
                         key=lambda r: r.rate_mbit)  # fmt: skip
            pts = [(r.rate_mbit, r.speedup, r.ideal) for r in sel]
            marker = "^" if is_peer(codec) else "o"
            if all(r.speedup_ci95 for r in sel):
                lo = [max(0.0, r.speedup - r.speedup_ci95[0]) for r in sel]
                err = [lo, [max(0.0, r.speedup_ci95[1] - r.speedup) for r in sel]]
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=err, fmt=marker, color=color,
                            capsize=3, label=f"{codec} measured (95% interval)")  # fmt: skip
            else:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, color=color,
                        label=f"{codec} measured")  # fmt: skip
            over = [r for r in sel if r.peer_speedup is not None and r.codec != r.best_peer]
            if over and not is_peer(codec):
                ci = [r.peer_ci95 or (r.peer_speedup, r.peer_speedup) for r in over]
                err = [[max(0.0, r.peer_speedup - c[0]) for r, c in zip(over, ci)],
                       [max(0.0, c[1] - r.peer_speedup) for r, c in zip(over, ci)]]  # fmt: skip
                ax.errorbar([r.rate_mbit for r in over], [r.peer_speedup for r in over], yerr=err,
                            fmt="s", mfc="none", color=color, capsize=3,
                            label=f"{codec} over the best peer")  # fmt: skip
            if is_peer(codec):
                continue
            ax.plot(
                [p[0] for p in pts], [p[2] for p in pts], "x", color=color, alpha=0.6, label=f"{codec} ideal"
            )
            curve = curves.get(f"{mode}/{codec}")
            if curve:
                ax.plot(
                    [c[0] for c in curve], [c[1] for c in curve], "-", color=color, label=f"{codec} model"
                )
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        floors = [r.noise_floor for r in rows if r.mode == mode and r.noise_floor is not None]
        if floors:  # the widest A/A half-width of the mode's links
            ax.axhspan(1 - max(floors), 1 + max(floors), color="grey", alpha=0.15, label="A/A noise floor")
        ax.set_title(f"TP traffic: {mode}")
        _frame(ax, "emulated link (Mbit/s, tc-capped lo)", "end-to-end speedup over the uncompressed run")
    _save(plt, fig, path)


def plot_projection(rows: list[dict[str, Any]], path: str, gpu: str = "H100") -> None:
    """Modeled TACO speedup against the TP link's bandwidth, one line per (model, TP) of
    `gpu_projection.projection` rows."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for key in dict.fromkeys((r["model"], r["tp"]) for r in rows):
        pts = sorted((r["link_gbs"], r[f"speedup_{gpu}"]) for r in rows if (r["model"], r["tp"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{key[0]} TP={key[1]}")
    labels: dict[float, list[str]] = {}
    for link, gbs in dict.fromkeys((r["link"], r["link_gbs"]) for r in rows):
        near = next((g for g in labels if abs(g / gbs - 1) < 0.1), gbs)  # e.g. PCIe4 and IB200
        labels.setdefault(near, []).append(link)
    for gbs, names in labels.items():
        ax.annotate(" / ".join(names), (gbs, 1.0), textcoords="offset points", xytext=(0, -14),
                    ha="center", fontsize=7)  # fmt: skip
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    _frame(
        ax,
        "TP link bandwidth per GPU (GB/s, achieved, one direction)",
        f"modeled step speedup (TACO vs bf16, {gpu})",
    )
    _save(plt, fig, path)


def plot_validation(rows: list[ReportRow], path: str, tolerance: float = 0.15) -> None:
    """Modeled against measured step time of every run, with the +-tolerance band around y = x."""
    plt = _pyplot()
    pts = [(r, r.run.step_s, r.model_step_s) for r in rows if r.model_step_s is not None]
    if not pts:
        raise ValueError("no rows with a modeled step time (run with the uncapped reference)")
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    for i, mode in enumerate(dict.fromkeys(r.mode for r, _, _ in pts)):
        for codec, marker in (("none", "s"), ("*", "o")):
            sel = [(m, p) for r, m, p in pts if r.mode == mode and (r.codec == "none") == (codec == "none")]
            label = f"{mode} {'baseline' if codec == 'none' else 'codec'}"
            ax.plot([m * 1e3 for m, _ in sel], [p * 1e3 for _, p in sel], marker,
                    color=f"C{i}", ls="", label=label, alpha=0.8)  # fmt: skip
    lo = min(min(m, p) for _, m, p in pts) * 1e3 * 0.8
    hi = max(max(m, p) for _, m, p in pts) * 1e3 * 1.2
    xs = [lo, hi]
    ax.plot(xs, xs, "k-", lw=0.8)
    ax.fill_between(xs, [x * (1 - tolerance) for x in xs], [x * (1 + tolerance) for x in xs], color="grey",
                    alpha=0.15, label=f"+-{tolerance:.0%}")  # fmt: skip
    ax.set_yscale("log")
    _frame(ax, "measured step time (ms)", "modeled step time (ms)", legend_size=7)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):  # plain numbers on both log axes (after the scales are set)
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    _save(plt, fig, path)
