"""`taco compare`: the same run (seed, data, steps) with the uncompressed baseline and each codec.

Writes `{out}/compare.csv` (loss curves), `{out}/compare.png`, `{out}/compare.md` (the table:
final validation loss, gap %, TP wire bytes per step, tokens/s) and `{out}/compare.json`.
"""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path
from typing import Any

from taco.codec import accepted_options
from taco.train.config import Config


def _curve(run_dir: Path) -> list[dict[str, Any]]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def compare(cfg: Config, codecs: list[str], out: Path, baseline: str = "none") -> list[dict[str, Any]]:
    """Run baseline then each codec; returns one row per run (baseline first)."""
    from taco.train.launch import launch

    out.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for name in [baseline, *[c for c in codecs if c != baseline]]:
        c = copy.deepcopy(cfg)
        c.compression.tp_codec = name
        # keep the options this codec accepts (group_size for group codecs, fmt for FP8 ones, ...)
        c.compression.tp_codec_options = accepted_options(name, cfg.compression.tp_codec_options)
        c.train.out_dir = str(out / name)
        c.train.name = name
        c.train.resume = False
        c.train.overwrite = True  # a fresh run (curve, TensorBoard, checkpoints) per codec
        print(f"[taco compare] === {name} ===", flush=True)
        res = launch(c)
        curves[name] = _curve(Path(c.train.out_dir))
        rows.append({"codec": name, **res})
    base = rows[0]["final_val_loss"]
    for r in rows:
        r["gap_pct"] = 100.0 * (r["final_val_loss"] - base) / base
    _write(out, rows, curves)
    return rows


def _write(out: Path, rows: list[dict[str, Any]], curves: dict[str, list[dict[str, Any]]]) -> None:
    with open(out / "compare.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["codec", "step", "loss", "val_loss"])
        for name, recs in curves.items():
            for r in recs:
                w.writerow([name, r["step"], r["loss"], r.get("val_loss", "")])
    lines = [
        "| codec | final val loss | gap vs none | TP wire MiB/step | TP wire / raw (input dtype) "
        "| tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = (
            r["tp_wire_bytes_per_step"] / r["tp_raw_bytes_per_step"] if r["tp_raw_bytes_per_step"] else 1.0
        )
        lines.append(
            f"| {r['codec']} | {r['final_val_loss']:.4f} | {r['gap_pct']:+.2f}% | "
            f"{r['tp_wire_bytes_per_step'] / 2**20:.2f} | {ratio:.3f} | {r['tokens_per_s']:,.0f} |"
        )
    table = "\n".join(lines)
    (out / "compare.md").write_text(table + "\n")
    (out / "compare.json").write_text(json.dumps(rows, indent=2))
    print(table, flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, recs in curves.items():
            axes[0].plot([r["step"] for r in recs], [r["loss"] for r in recs], label=name, lw=0.8)
            v = [r for r in recs if "val_loss" in r]
            axes[1].plot([r["step"] for r in v], [r["val_loss"] for r in v], marker="o", label=name)
        axes[0].set(title="training loss", xlabel="step", ylabel="loss")
        axes[1].set(title="validation loss", xlabel="step")
        for a in axes:
            a.grid(alpha=0.3)
            a.legend()
        fig.tight_layout()
        fig.savefig(out / "compare.png", dpi=120)
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        pass
