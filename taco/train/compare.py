"""`taco compare`: the same run (seed, data, steps) with the uncompressed baseline and each codec.

Writes `{out}/compare.csv` (loss curves), `{out}/compare.png`, `{out}/compare.md` (the table:
final validation loss, gap %, TP wire bytes per step, tokens/s) and `{out}/compare.json`.

With several seeds (`--seeds 1337,1338,1339`) every codec and the baseline run once per seed
(`{out}/{codec}/seed{S}`), each gap taken against the baseline of the same seed, and the table
gains the seed summary (`seed_summary`): per codec the mean final validation loss, the mean gap,
the baseline's seed band (max - min of its final losses) and whether |mean gap| lies inside it.
compare.json is then `{"runs": [...], "seeds": [...], "summary": [...]}`.
"""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path
from typing import Any

from taco.train.config import Config


def _curve(run_dir: Path) -> list[dict[str, Any]]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def compare(
    cfg: Config, codecs: list[str], out: Path, baseline: str = "none", seeds: list[int] | None = None
) -> list[dict[str, Any]]:
    """Run baseline then each codec, once per seed (default: the config's `train.seed`, in
    `{out}/{codec}`); returns one row per run (per seed: baseline first), each with its `seed`."""
    from taco.train.launch import launch

    out.mkdir(parents=True, exist_ok=True)
    multi = seeds is not None and len(seeds) > 1
    rows, curves = [], {}
    for seed in seeds or [cfg.train.seed]:
        for name in [baseline, *[c for c in codecs if c != baseline]]:
            c = copy.deepcopy(cfg)
            c.train.seed = seed
            c.compression.set_tp_codec(name)
            key = f"{name}/seed{seed}" if multi else name
            c.train.out_dir = str(out / key)
            c.train.name = name
            c.train.resume = False
            c.train.overwrite = True  # a fresh run (curve, TensorBoard, checkpoints) per codec
            print(f"[taco compare] === {key} ===", flush=True)
            res = launch(c)
            curves[key] = _curve(Path(c.train.out_dir))
            rows.append({"codec": name, "seed": seed, **res})
    base = {r["seed"]: r["final_val_loss"] for r in rows if r["codec"] == baseline}
    for r in rows:
        r["gap_pct"] = 100.0 * (r["final_val_loss"] - base[r["seed"]]) / base[r["seed"]]
    _write(out, rows, curves, seed_summary(rows, baseline) if multi else None)
    return rows


def seed_summary(rows: list[dict[str, Any]], baseline: str = "none") -> list[dict[str, Any]]:
    """Per codec over the seeds: mean final validation loss, the mean gap to the baseline of the
    same seed (in loss and in % of the baseline's mean), the baseline's seed band (max - min of its
    final losses) and `inside_band`: |mean gap| <= band."""
    by: dict[str, dict[int, float]] = {}
    for r in rows:
        by.setdefault(r["codec"], {})[r["seed"]] = r["final_val_loss"]
    base = by[baseline]
    band = max(base.values()) - min(base.values())
    base_mean = sum(base.values()) / len(base)
    out = []
    for name, losses in by.items():
        gaps = [losses[s] - base[s] for s in losses]
        gap = sum(gaps) / len(gaps)
        out.append({
            "codec": name, "seeds": sorted(losses), "mean_final_val_loss": sum(losses.values()) / len(losses),
            "mean_gap": gap, "mean_gap_pct": 100.0 * gap / base_mean, "band": band,
            "inside_band": abs(gap) <= band,
        })  # fmt: skip
    return out


def _write(
    out: Path,
    rows: list[dict[str, Any]],
    curves: dict[str, list[dict[str, Any]]],
    summary: list[dict[str, Any]] | None = None,
) -> None:
    with open(out / "compare.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["codec", "step", "loss", "val_loss"])
        for name, recs in curves.items():
            for r in recs:
                w.writerow([name, r["step"], r["loss"], r.get("val_loss", "")])
    seed = "| seed " if summary else ""
    lines = [
        f"| codec {seed}| final val loss | gap vs none | TP wire MiB/step | TP wire / raw (input dtype) "
        "| tokens/s |",
        "|---" * (6 + bool(summary)) + "|",
    ]
    for r in rows:
        ratio = (
            r["tp_wire_bytes_per_step"] / r["tp_raw_bytes_per_step"] if r["tp_raw_bytes_per_step"] else 1.0
        )
        lines.append(
            f"| {r['codec']} {'| ' + str(r['seed']) + ' ' if summary else ''}"
            f"| {r['final_val_loss']:.4f} | {r['gap_pct']:+.2f}% | "
            f"{r['tp_wire_bytes_per_step'] / 2**20:.2f} | {ratio:.3f} | {r['tokens_per_s']:,.0f} |"
        )
    if summary:
        lines += ["", _summary_table(summary)]
    table = "\n".join(lines)
    (out / "compare.md").write_text(table + "\n")
    data: Any = rows if summary is None else {"runs": rows, "seeds": summary[0]["seeds"], "summary": summary}
    (out / "compare.json").write_text(json.dumps(data, indent=2))
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


def _summary_table(summary: list[dict[str, Any]]) -> str:
    """The seed summary as a markdown table (the band is the baseline's, the same on every row)."""
    lines = [
        f"seeds {', '.join(map(str, summary[0]['seeds']))}; baseline seed band (max - min final val loss) "
        f"= {summary[0]['band']:.4f}",
        "",
        "| codec | mean final val loss | mean gap vs none | mean gap % | inside band (abs(gap) <= band) |",
        "|---|---|---|---|---|",
    ]
    for e in summary:
        lines.append(
            f"| {e['codec']} | {e['mean_final_val_loss']:.4f} | {e['mean_gap']:+.4f} | "
            f"{e['mean_gap_pct']:+.2f}% | {'yes' if e['inside_band'] else 'no'} |"
        )
    return "\n".join(lines)
