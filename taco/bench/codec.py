"""`taco bench codec`: fidelity and throughput of every codec, side by side in one run (docs/design.md 3).

Why this file exists: the codec choices of docs/design.md 1.2 are decided by measurement, not by
assumption. For each codec x data family x backend it measures bytes/elem (exact, from
`Packed.nbytes`), SQNR, the worst relative group error, encode/decode elements/s, and the encode
time as a ratio to `x.clone()` of the same tensor in the same run (the memory-bound floor).
Families: synthetic (gaussian, student-t(3), channel outliers, tiny gradients with outliers,
sparse) and, with `--tensors DIR`, real captured tensors (.pt / .safetensors, one per file).
`--range` adds the extreme-range table: the relative error of each codec on gaussian groups
scaled from 1e-30 to 1e30, which documents the faithful `taco` preset's usable range.
`--scale-fmts fp32,bf16,e8m0` repeats every group codec with each per-group scale format. After the
main table comes the fidelity table (docs/design.md 1.2): per codec, bytes/elem, the wire ratio vs
bf16 and, per family, SQNR and its gap to `taco` (fp32 scales) on the same tensor.

Run: `taco bench codec --size 4194304 --backend all --json out.json` or `python -m taco.bench.codec`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import taco
from taco.codec import CODECS, sqnr_db
from taco.codec.codecs import GroupCodec
from taco.codec.scales import check_scale_fmt
from taco.codec.specs import parse_spec, split_specs
from taco.comm.stats import sync_device

from .samples import FAMILIES, json_safe, load_tensors, synthetic

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RANGE_SCALES = (1e-30, 1e-20, 1e-15, 1e-10, 1e-5, 1.0, 1e5, 1e10, 1e11, 1e12, 1e15, 1e20, 1e30)
# -- metrics --------------------------------------------------------------------------------------
def max_group_rel_err(x: torch.Tensor, y: torch.Tensor, g: int) -> float:
    """max over groups of ||x_g - y_g|| / ||x_g|| (fp64; a zero group must decode to zeros)."""
    xf, yf = x.reshape(-1).double(), y.reshape(-1).double()
    pad = (-xf.numel()) % g
    xf, yf = (
        torch.nn.functional.pad(xf, (0, pad)).view(-1, g),
        torch.nn.functional.pad(yf, (0, pad)).view(-1, g),
    )
    err, norm = (xf - yf).norm(dim=1), xf.norm(dim=1)
    if torch.isnan(err).any():
        return math.nan
    zero = norm == 0
    if (err[zero] > 0).any():
        return math.inf
    return (err[~zero] / norm[~zero]).max().item() if (~zero).any() else 0.0


def best_time(fn: Callable[[], object], repeat: int, device: torch.device) -> float:
    """Best of `repeat` timed calls after one warm-up call (seconds); `comm` and `cluster` use it too."""
    fn()
    sync_device(device)
    best = math.inf
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        sync_device(device)
        best = min(best, time.perf_counter() - t0)
    return best


# -- the benchmark --------------------------------------------------------------------------------
def grid_codec(spec: str, group_size: int, backend: str, scale_fmt: str = "fp32") -> taco.Codec:
    """A codec name or spec string ("int6-hadamard(signs=true)": its options win over the others)."""
    name, opts = parse_spec(spec)
    cls = CODECS[name]
    if issubclass(cls, GroupCodec):
        common = {"group_size": group_size, "backend": backend, "scale_fmt": scale_fmt}
        pinned = getattr(cls, "PINNED", ())  # "int4-hadamard-g32": its name fixes G and the scales
        return taco.get_codec(name, **{**{k: v for k, v in common.items() if k not in pinned}, **opts})
    return taco.get_codec(name, **opts)


def label(name: str, scale_fmt: str, signs: bool | str = False, group_size: int | None = None) -> str:
    """A codec's row label: its name, "+signs" for the randomized Hadamard ("+signs=auto" for the
    per-group choice) where that is not the codec's default, "/G64" for a group size other than the
    run's, "/bf16" or "/e8m0" for a lean scale format."""
    default = getattr(CODECS.get(name), "DEFAULTS", {}).get("signs", False)
    name += "" if not signs or signs == default else "+signs=auto" if signs == "auto" else "+signs"
    name += f"/G{group_size}" if group_size else ""
    return name if scale_fmt == "fp32" else f"{name}/{scale_fmt}"


def backends_for(name: str, choice: str, device: torch.device) -> list[str]:
    if not issubclass(CODECS[parse_spec(name)[0]], GroupCodec):
        return ["-"]
    if choice != "all":
        return [choice]
    import taco.kernels as K

    out = ["eager", "native"] if device.type == "cpu" else ["eager"]
    if device.type == "cuda" and K.triton_available():
        out.append("triton")
    return out


def measure(codec: taco.Codec, x: torch.Tensor, repeat: int, group_size: int, copy_s: float) -> dict:
    """One row: fidelity and speed of `codec` on `x`."""
    n = x.numel()
    packed = codec.encode(x)
    y = codec.decode(packed)
    t_enc = best_time(lambda: codec.encode(x), repeat, x.device)
    t_dec = best_time(lambda: codec.decode(packed), repeat, x.device)
    g = getattr(codec, "group_size", group_size)
    sf = getattr(codec, "scale_fmt", "fp32")
    pinned = getattr(codec, "PINNED", ())  # its name says them: no "/G32" or "/bf16" in the label
    return {
        "codec": label(codec.name, "fp32" if "scale_fmt" in pinned else sf, getattr(codec, "signs", False),
                       g if g != group_size and "group_size" not in pinned else None),
        "scale_fmt": sf,
        "spec": codec.spec,
        "bytes_per_elem": packed.nbytes / n,
        "nbytes": packed.nbytes,
        "sqnr_db": sqnr_db(x.float(), y.float()),
        "max_group_rel_err": max_group_rel_err(x, y, g),
        "encode_elems_per_s": n / t_enc,
        "decode_elems_per_s": n / t_dec,
        "encode_s": t_enc,
        "decode_s": t_dec,
        "encode_vs_copy": t_enc / copy_s,
        "decode_vs_copy": t_dec / copy_s,
    }


def range_table(codecs: list[str], group_size: int, device: torch.device) -> dict[str, dict[str, float]]:
    """codec -> {scale: max relative group error} on 64 gaussian fp32 groups times each scale."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(64, group_size, generator=gen).to(device)
    out: dict[str, dict[str, float]] = {}
    for name in codecs:
        if name == "none":
            continue
        c = grid_codec(name, group_size, "auto")
        out[name] = {
            f"{s:g}": max_group_rel_err(base * s, c.roundtrip(base * s), group_size) for s in RANGE_SCALES
        }
    return out


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark described by the parsed arguments; returns the JSON-ready result."""
    import taco.kernels  # noqa: F401  (registers the compile/triton backends)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    codecs = split_specs(args.codecs) if args.codecs else taco.list_codecs()
    for name in codecs:
        if parse_spec(name)[0] not in CODECS:
            raise ValueError(f"unknown codec {name!r}: choose from {taco.list_codecs()}")
    sfmts = [check_scale_fmt(f) for f in (args.scale_fmts or "fp32").split(",")]
    gen = torch.Generator().manual_seed(args.seed)
    data = {
        f: synthetic(f, args.size, gen) for f in (args.families.split(",") if args.families else FAMILIES)
    }
    if args.tensors:
        data.update(load_tensors(args.tensors))
    rows = []
    for fam, t in data.items():
        x = t.to(device=device, dtype=dtype).contiguous()
        copy_s = best_time(lambda x=x: x.clone(), args.repeat, device)
        for name in codecs:
            grouped = issubclass(CODECS[parse_spec(name)[0]], GroupCodec)
            for sf in sfmts if grouped else ["fp32"]:
                for b in backends_for(name, args.backend, device):
                    c = grid_codec(name, args.group_size, "auto" if b == "-" else b, sf)
                    row = measure(c, x, args.repeat, args.group_size, copy_s)
                    rows.append({"family": fam, "backend": b, "dtype": args.dtype, "numel": x.numel(), **row})
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "func"} | {"device": str(device)},
        "rows": rows,
        "fidelity": fidelity_table(rows),
    }
    if args.range:
        result["range"] = range_table(codecs, args.group_size, device)
    return result


def fidelity_table(rows: list[dict], reference: str = "taco") -> list[dict]:
    """Per codec label (first backend measured): bytes/elem, wire ratio vs bf16 (2 / bytes), and per
    family SQNR and its gap to `reference` on the same tensor (None where it was not measured)."""
    first: dict[tuple[str, str], dict] = {}
    for r in rows:
        first.setdefault((r["codec"], r["family"]), r)
    families = list(dict.fromkeys(r["family"] for r in rows))
    out = []
    for name in dict.fromkeys(r["codec"] for r in rows):
        mine = [first[(name, f)] for f in families if (name, f) in first]
        bpe = mine[0]["bytes_per_elem"]
        sq = {f: first[(name, f)]["sqnr_db"] for f in families if (name, f) in first}
        ref = {f: first[(reference, f)]["sqnr_db"] for f in sq if (reference, f) in first}
        gap = {f: sq[f] - ref[f] for f in ref if math.isfinite(sq[f]) and math.isfinite(ref[f])}
        out.append({"codec": name, "bytes_per_elem": bpe, "ratio_vs_bf16": 2 / bpe, "sqnr_db": sq,
                    "gap_to_taco_db": gap})  # fmt: skip
    return out


# -- output ---------------------------------------------------------------------------------------
def _fmt(v: object, spec: str) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def print_tables(result: dict, file=None) -> None:
    """The main table, then the extreme-range table if measured (plain text, to stdout by default)."""
    file = file or sys.stdout
    cols = [
        ("codec", "codec", "s"), ("family", "family", "s"), ("backend", "backend", "s"),
        ("bytes/elem", "bytes_per_elem", ".4f"), ("SQNR dB", "sqnr_db", ".2f"),
        ("max grp rel err", "max_group_rel_err", ".3e"), ("enc elem/s", "encode_elems_per_s", ".3e"),
        ("dec elem/s", "decode_elems_per_s", ".3e"), ("enc/copy", "encode_vs_copy", ".2f"),
    ]  # fmt: skip
    table = [[h for h, _, _ in cols]] + [[_fmt(r[k], f) for _, k, f in cols] for r in result["rows"]]
    _print(table, file)
    if result.get("fidelity"):
        fams = list(dict.fromkeys(f for e in result["fidelity"] for f in e["sqnr_db"]))
        print("\nfidelity: SQNR dB per family (gap to taco), bytes/elem, ratio vs bf16:", file=file)
        table = [["codec", "bytes/elem", "x vs bf16", *fams]] + [
            [e["codec"], _fmt(e["bytes_per_elem"], ".4f"), _fmt(e["ratio_vs_bf16"], ".2f")]
            + [_sq_cell(e, f) for f in fams]
            for e in result["fidelity"]
        ]
        _print(table, file)
    if "range" in result:
        scales = list(next(iter(result["range"].values()), {}))
        print("\nmax relative group error of gaussian groups scaled by:", file=file)
        table = [["codec", *scales]] + [
            [c, *(_fmt(e[s], ".2e") for s in scales)] for c, e in result["range"].items()
        ]
        _print(table, file)


def _sq_cell(entry: dict, family: str) -> str:
    if family not in entry["sqnr_db"]:
        return "-"
    gap = entry["gap_to_taco_db"].get(family)
    return _fmt(entry["sqnr_db"][family], ".2f") + ("" if gap is None else f" ({gap:+.2f})")


def _print(table: list[list[str]], file) -> None:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for k, row in enumerate(table):
        cells = (c.rjust(w) if k and i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        print("  ".join(cells), file=file)
        if k == 0:
            print("  ".join("-" * w for w in widths), file=file)


# -- command line ---------------------------------------------------------------------------------
HELP = "codec fidelity and throughput (docs/design.md 3)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--codecs",
        default="",
        help='comma-separated codec names or specs, e.g. "int6-hadamard(signs=true)" (default: all)',
    )
    p.add_argument(
        "--families", default="", help=f"comma-separated synthetic families (default: {','.join(FAMILIES)})"
    )
    p.add_argument("--tensors", default="", help="folder of captured .pt/.safetensors tensors, one per site")
    p.add_argument("--size", type=int, default=1 << 22, help="elements per synthetic tensor")
    p.add_argument("--group-size", type=int, default=128, help="G of the group codecs")
    p.add_argument(
        "--scale-fmts", default="fp32", help="comma-separated per-group scale formats: fp32, bf16, e8m0"
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "eager", "native", "compile", "triton", "all"],
        help="codec backend; 'all' gives one row per available backend",
    )
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions (best is kept)")
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--device", default="", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--range", action="store_true", help="add the 1e-30..1e30 extreme-range table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    p.add_argument(
        "--frontier",
        action="store_true",
        help="SQNR vs bytes/elem of every project codec and hardware format (MXFP8/6/4, NVFP4) on --tensors "
        "(comma-separated capture folders) and synthetic sets, with the rate-distortion bound",
    )
    p.add_argument("--markdown", default="", help="--frontier: also write the tables to this Markdown file")
    p.add_argument("--plot", default="", help="--frontier: write the SQNR vs bytes/elem plot (PNG) here")
    p.add_argument("--docs", default="", help="--frontier: write the tables into this page's frontier region")


def run_codec(args: argparse.Namespace) -> int:
    """Entry point of `taco bench codec`: print the tables, write --json; returns the exit code."""
    if args.frontier:
        from .frontier import run_frontier

        return run_frontier(args)
    result = run(args)
    print_tables(result)
    if args.json:
        Path(args.json).write_text(json.dumps(json_safe(result), indent=2, allow_nan=False))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":  # `python -m taco.bench.codec ARGS` = `taco bench codec ARGS`
    from taco.cli import main

    sys.exit(main(["bench", "codec", *sys.argv[1:]]))
