"""Each TP site's codec over the steps of a ladder run, from its run folder's ladder.json.

    python benchmarks/ladder_plot.py RUN_DIR docs/ladder_sites.png [--steps N]

One line per site (forward sites solid, backward dashed): the wire bytes per element of its rung
from each decision to the next, up to the run's last step (`--steps`, else the last decision).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from taco.codec import build_codec, parse_ladder  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=0, help="the run's last step (default: the last decision)")
    a = p.parse_args()
    doc = json.loads((Path(a.run_dir) / "ladder.json").read_text())
    ladder = parse_ladder(doc["ladder"])
    assert ladder is not None
    widths = []
    for r in ladder.rungs:
        codec = build_codec(r)
        widths.append(codec.bytes_per_elem() if codec is not None else 2.0)
    end = max(a.steps, doc["step"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (site, st) in enumerate(sorted(doc["sites"].items())):
        xs, ys = [], []
        for step, rung in st["rungs"]:
            xs.append(step)
            ys.append(widths[rung] + 0.004 * (i - len(doc["sites"]) / 2))  # a small offset per site
        xs.append(end)
        ys.append(ys[-1])
        ax.step(xs, ys, where="post", linestyle="--" if site.endswith(".bwd") else "-", lw=1, label=site)
    ax.set_yticks(widths, [f"{r.split('(')[0]} ({w:.2f})" for r, w in zip(ladder.rungs, widths)])
    ax.set_xlabel("step")
    ax.set_ylabel("codec (wire bytes / element)")
    ax.set_title("Each TP site's rung over the run (solid: forward, dashed: backward)")
    ax.legend(fontsize=6, ncol=3, loc="upper right")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
