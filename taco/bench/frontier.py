"""`taco bench codec --frontier`: SQNR against bytes per element, project codecs and hardware formats.

Why this file exists: the first question about a compression library in a world where activations
already move in MXFP8 or NVFP4 is what its codecs buy over those at the same bytes (docs/design.md
1.2). For every codec (the project's, at their defaults, and the hardware block formats with each
scale rule, with and without a Hadamard rotation) it measures exact bytes/elem and SQNR on captured
TP tensors (forward activations and backward activation gradients separately: min and mean over
tensors) and on synthetic Gaussian, Student-t(3) and channel-outlier sets, next to the Gaussian
rate-distortion bound at the same bytes (6.02 dB per bit, D(R) = sigma^2 2^(-2R)). Then, per byte
budget of a hardware format, the project codec with the same bytes against the strongest variant of
the format tensor by tensor (the least lead, the mean lead, the tensors won). It writes the tables
(terminal, `--markdown`, `--json`) and the plot (`--plot`): the figures in docs/frontier.md come
from here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

import taco
from taco.codec import sqnr_db
from taco.codec.specs import parse_spec, split_specs

PROJECT = ("fp8-tensor", "fp8-group", "int8-group", "taco", "taco-1s", "int8-hadamard", "int7-hadamard",
           "int6-hadamard", "int5-hadamard", "int4-hadamard-g32", "int4-hadamard", "int3-hadamard",
           "int2-hadamard")  # fmt: skip
"""Project codecs at their defaults."""
FORMER = tuple(
    f"int{b}-hadamard(group_size=128,scale_fmt=fp32,signs=false,scale_search=absmax)" for b in (8, 6, 4)
)
"""The intB-hadamard settings before the measured defaults, for comparison."""


def _hardware() -> tuple[str, ...]:
    out = []
    for name in ("mxfp8-e4m3", "mxfp8-e5m2", "mxfp6-e2m3", "mxfp6-e3m2", "mxfp4", "nvfp4"):
        for rule in ["floor", "rceil"] if name.startswith("mx") else [None]:
            for h in (False, True):
                opts = ([f"scale_rule={rule}"] if rule else []) + (["hadamard=True"] if h else [])
                out.append(f"{name}({','.join(opts)})" if opts else name)
    return tuple(out)


HARDWARE = _hardware()
"""Every hardware format with each scale rule (MX: floor, rceil), without and with a Hadamard."""
HEAD_TO_HEAD = (("int8-hadamard", "mxfp8-"), ("int6-hadamard", "mxfp6-"), ("int4-hadamard", "mxfp4"),
                ("int4-hadamard-g32", "nvfp4"))  # fmt: skip
"""(project codec, hardware format prefix) pairs of equal bytes (within a per-message header)."""
SYNTHETIC = ("gaussian", "student-t3", "channel-outliers")


def is_hardware(spec: str) -> bool:
    return parse_spec(spec)[0].startswith(("mxfp", "nvfp"))


def rd_bound_db(bytes_per_elem: float) -> float:
    """Gaussian rate-distortion bound: 6.02 dB per bit of the total rate (payload + scales)."""
    return 20 * math.log10(2) * 8 * bytes_per_elem


def captured(folders: list[str]) -> dict[str, torch.Tensor]:
    """Captured TP tensors (`train.capture_dir`, one file per site and step) of several folders;
    the site's direction is in its name (".fwd" activations, ".bwd" activation gradients)."""
    from .samples import load_tensors

    out = {}
    for folder in folders:
        tag = Path(folder).name
        for name, t in load_tensors(folder).items():
            if ".fwd" in name or ".bwd" in name:
                out[f"{tag}/{name}"] = t
    return out


def measure(specs: list[str], real: dict[str, torch.Tensor], synth: dict[str, torch.Tensor],
            progress: Callable[[str], None] = lambda s: None) -> dict:  # fmt: skip
    """SQNR of every codec on every tensor -> {"codecs": [row], "sqnr": {spec: {tensor: dB}}}."""
    rows, per = [], {}
    n_ref = next(iter(real.values())).numel() if real else 1 << 20
    for spec in specs:
        name, opts = parse_spec(spec)
        codec = taco.get_codec(name, **opts)
        s = {k: sqnr_db(x.float(), codec.roundtrip(x).float()) for k, x in {**real, **synth}.items()}
        per[spec] = s
        bpe = codec.nbytes(n_ref) / n_ref
        row = {"spec": spec, "codec": codec.spec, "hardware": is_hardware(spec), "bytes_per_elem": bpe,
               "rd_bound_db": rd_bound_db(bpe)}  # fmt: skip
        for d in ("fwd", "bwd"):
            v = [s[k] for k in real if f".{d}" in k]
            row[f"{d}_mean"] = sum(v) / len(v) if v else math.nan
            row[f"{d}_min"] = min(v) if v else math.nan
        row.update({f: s[f] for f in synth})
        rows.append(row)
        progress(f"{spec}: {bpe:.4f} B/elem, fwd {row['fwd_mean']:.2f} bwd {row['bwd_mean']:.2f} dB")
    return {"codecs": rows, "sqnr": per, "tensors": {"fwd": sum(".fwd" in k for k in real),
                                                       "bwd": sum(".bwd" in k for k in real)}}  # fmt: skip


def head_to_head(result: dict, real: list[str]) -> list[dict]:
    """Per pair of HEAD_TO_HEAD: the project codec minus the strongest variant of the format, tensor
    by tensor (over captured tensors, forward and backward) and on the mean of each direction."""
    out = []
    per = result["sqnr"]
    for ours, prefix in HEAD_TO_HEAD:
        theirs = [s for s in per if s.startswith(prefix)]
        if ours not in per or not theirs or not real:
            continue
        best = {k: max(per[t][k] for t in theirs) for k in real}
        d = [per[ours][k] - best[k] for k in real]
        row = {"codec": ours, "format": prefix.rstrip("-"), "variants": len(theirs), "min_lead_db": min(d),
               "wins": sum(v > 0 for v in d), "tensors": len(d)}  # fmt: skip
        for dirn in ("fwd", "bwd"):
            keys = [k for k in real if f".{dirn}" in k]
            means = {c: sum(per[c][k] for k in keys) / max(1, len(keys)) for c in (ours, *theirs)}
            row[f"{dirn}_mean_lead_db"] = min(means[ours] - means[t] for t in theirs) if keys else math.nan
        out.append(row)
    return out


def _f(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


COLUMNS = ("fwd_mean", "fwd_min", "bwd_mean", "bwd_min", *SYNTHETIC, "rd_bound_db")
HEADS = ("fwd mean", "fwd min", "bwd mean", "bwd min", *SYNTHETIC, "RD bound")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown(result: dict) -> str:
    """The two tables of docs/frontier.md."""
    t = result["tensors"]
    lines = [
        f"SQNR in dB on {t['fwd']} forward and {t['bwd']} backward captured TP tensors and on synthetic "
        f"sets of {result['synthetic_numel']:,} values; RD bound: the Gaussian rate-distortion bound at "
        "the same bytes (6.02 dB per bit).",
        "",
        _row(["codec", "B/elem", *HEADS]),
        _row(["---"] * (2 + len(HEADS))),
    ]
    for r in sorted(result["codecs"], key=lambda r: (-r["bytes_per_elem"], r["hardware"], -r["fwd_mean"])):
        name = f"{r['spec']} (hardware)" if r["hardware"] else r["spec"]
        lines.append(_row([name, f"{r['bytes_per_elem']:.4f}", *(_f(r[k]) for k in COLUMNS)]))
    lines += [
        "",
        "Head to head at equal bytes, against the strongest variant of the format on each tensor (lead = "
        "project codec minus format, dB; the mean lead is against the variant of the best mean):",
        "",
        _row(["codec", "format (variants)", "fwd mean lead", "bwd mean lead", "least lead", "tensors won"]),
        _row(["---"] * 6),
    ]
    for h in result["head_to_head"]:
        lead = [f"{h[k]:+.2f}" for k in ("fwd_mean_lead_db", "bwd_mean_lead_db", "min_lead_db")]
        fmt, won = f"{h['format']} ({h['variants']})", f"{h['wins']}/{h['tensors']}"
        lines.append(_row([h["codec"], fmt, *lead, won]))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """SQNR (captured, mean of forward and backward) against bytes/elem; the RD bound as a line."""
    from .plots import _pyplot, _save

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    rows = [r for r in result["codecs"] if r["bytes_per_elem"] <= 1.2]
    for ax, key, title in ((axes[0], "captured", "captured TP tensors (fwd and bwd mean)"),
                           (axes[1], "student-t3", "synthetic Student-t(3)")):  # fmt: skip
        for hw, marker, color in ((False, "o", "C0"), (True, "s", "C3")):
            sel = [r for r in rows if r["hardware"] == hw]
            ys = [(r["fwd_mean"] + r["bwd_mean"]) / 2 if key == "captured" else r[key] for r in sel]
            ax.scatter([r["bytes_per_elem"] for r in sel], ys, marker=marker, color=color,
                       label="hardware formats" if hw else "taco codecs")  # fmt: skip
            for r, y in zip(sel, ys):
                if not hw or "hadamard" not in r["spec"]:
                    ax.annotate(r["spec"].split("(")[0], (r["bytes_per_elem"], y), fontsize=6,
                                xytext=(3, -3 if hw else 3), textcoords="offset points")  # fmt: skip
        xs = [0.2 + i * 0.01 for i in range(101)]
        ax.plot(xs, [rd_bound_db(x) for x in xs], "k--", lw=0.8, label="Gaussian RD bound")
        ax.set(xlabel="bytes per element (payload + scales)", ylabel="SQNR (dB)", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(plt, fig, path)


def replace_region(page: str, table: str) -> None:
    """Write `table` between the frontier markers of `page` (the rest of the page is prose)."""
    text = Path(page).read_text()
    begin, end = "<!-- frontier:begin -->", "<!-- frontier:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"--docs {page}: no {begin} ... {end} region to write the tables into")
    head, rest = text.split(begin, 1)
    Path(page).write_text(head + begin + "\n" + table + end + rest.split(end, 1)[1])


def run_frontier(args) -> int:
    """`taco bench codec --frontier`: measure, print, write --json/--markdown/--plot/--docs."""
    from .samples import synthetic

    folders = [f for f in args.tensors.split(",") if f]
    real = captured(folders) if folders else {}
    gen = torch.Generator().manual_seed(args.seed)
    synth = {f: synthetic(f, args.size, gen) for f in SYNTHETIC}
    specs = split_specs(args.codecs) if args.codecs else [*PROJECT, *FORMER, *HARDWARE]
    result = measure(specs, real, synth, progress=lambda s: print(s, flush=True))
    result["synthetic_numel"] = next(iter(synth.values())).numel()
    result["head_to_head"] = head_to_head(result, list(real))
    table = markdown(result)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.docs:
        replace_region(args.docs, table)
    if args.plot:
        plot(result, args.plot)
    if args.json:
        from .samples import json_safe

        Path(args.json).write_text(json.dumps(json_safe(result), indent=1, allow_nan=False))
    return 0
