"""`taco bench comm`: plain bf16 collectives against compressed ones, side by side in one run.

Why this file exists: docs/design.md 3 measures collective speedup as time(plain bf16) / time(codec)
on the same sizes in the same run. Ranks are spawned here (torch.multiprocessing, gloo over lo,
`--threads` compute threads each). With `--rate MBIT` the run re-executes itself inside a network
namespace whose lo is capped by tc (`netns.py`); `--rate auto` picks the cap at which the codec
encodes `--codec-link-ratio` (default 50) times more elements per second than the link carries
bf16 elements, about the ratio of GPU codecs to the slowest TP link of a cluster.

    python -m taco.bench.comm --sizes 256K,1M,16M,64M --world 2,4 --codecs taco --json out.json
    python -m taco.bench.comm --rate auto --sizes 16M --world 2 --slices 1,4

Columns: median time over `--repeats` (the slowest rank of each repeat), algbw = message bytes /
time, wire = bytes this rank sent, SQNR against an fp32 reduction, codec time per call, the uint8
buffers the first call allocated (`buf MB`, in the cache's size classes; later calls reuse them,
`buffers_repeat` in the JSON is 0). On CPU torch has no allocator statistics, so temporaries inside the codec
(fp32 working copies, decoded chunks) are not in that figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from .codec import best_time
from .ranks import comma_list as _csv
from .ranks import gloo_rank, spawn_ranks

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def _fmt_size(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            return f"{n / m:g} {unit}"
    return f"{n} B"


HELP = "plain vs compressed collectives"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", type=_csv(str), default=["all_reduce"], help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--sizes", type=_csv(_size), default=[_size(s) for s in "256K,1M,4M,16M,64M".split(",")])
    p.add_argument("--world", type=_csv(int), default=[2, 4], help="comma list of rank counts")
    p.add_argument("--codecs", type=_csv(str), default=["taco"], help="codec specs; plain bf16 always runs")
    p.add_argument("--slices", type=_csv(int), default=[1], help="comma list of slice counts per codec")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--backend", choices=("auto", "eager"), default="auto", help="auto: import taco.kernels")
    p.add_argument(
        "--rate",
        default=None,
        metavar="MBIT|auto",
        help="run the ranks in a network namespace whose lo is capped at this many Mbit/s (needs root); "
        "'auto': the rate at which the codec encodes --codec-link-ratio times more elements per "
        "second than the link carries bf16 elements (default: lo uncapped)",
    )
    p.add_argument(
        "--codec-link-ratio",
        type=float,
        default=50.0,
        help="codec encode rate / link element rate that --rate auto aims at (default %(default)s)",
    )
    p.add_argument("--burst", default="256kb", help="tc tbf burst")
    p.add_argument("--latency", default="400ms", help="tc tbf latency")
    p.add_argument("--delay", type=float, default=0.0, help="netem delay (ms)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--link", default=None, help=argparse.SUPPRESS)  # set when re-executed in a netns


def _load_backend(backend: str) -> str:
    if backend == "auto":
        try:
            import taco.kernels as kernels
        except ImportError:
            return "eager (taco.kernels unavailable)"
        return ",".join(kernels.auto_order("cpu")) or "eager"
    return "eager"


def codec_throughput(specs: list[str], numel: int = 1 << 22) -> dict[str, dict[str, float]]:
    """Elements/s of encode and decode per codec (best of 5, this process's threads), and of a copy."""
    from taco.codec import build_codec

    x = torch.randn(numel).to(torch.bfloat16)
    out: dict[str, dict[str, float]] = {}
    t = best_time(lambda: x.clone(), 3, x.device)
    out["copy"] = {"encode": numel / t, "decode": numel / t}
    for spec in specs:
        c = build_codec(spec)
        if c is None:
            continue
        c.decode(c.encode(x[:4096]))
        p = c.encode(x)
        te = best_time(lambda c=c, p=p: c.encode(x, out=p.data), 5, x.device)
        td = best_time(lambda c=c, p=p: c.decode(p), 5, x.device)
        out[spec] = {"encode": numel / te, "decode": numel / td}
    return out


def _timed(fn: Any) -> float:
    """Seconds of one call (each rank's; `_measure` keeps the slowest rank's)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _measure(op: str, size: int, rank: int, world: int, cfg: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist

    import taco.comm as tc
    from taco.codec import sqnr_db

    n = size // 2 // world * world  # bf16 elements of the message
    x = torch.randn(n // world if op == "all_gather" else n, generator=torch.Generator().manual_seed(rank))
    x = x.to(torch.bfloat16)
    ref = tc.all_gather(x, codec=None) if op == "all_gather" else getattr(tc, op)(x.float(), codec=None)
    fn = getattr(tc, op)
    rows = []
    ks = cfg.slices if op == "all_reduce" else [1]  # only all-reduce is sliced
    for codec, k in [(None, 1)] + [(c, k) for c in cfg.codecs for k in ks]:
        policy = tc.CommPolicy(codec=codec, check_sizes=False)
        kw = {"slices": k} if op == "all_reduce" else {}

        def call(policy: tc.CommPolicy = policy, kw: dict = kw) -> torch.Tensor:
            return fn(x, site=op, policy=policy, **kw)

        y = call()
        first = policy.buffers.allocated_bytes
        sqnr = sqnr_db(ref, y)
        del y
        for _ in range(cfg.warmup - 1):
            call()
        policy.stats.reset()
        times = []
        for _ in range(cfg.repeats):
            dist.barrier()
            t = torch.tensor([_timed(call)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(t.item())
        s, r = policy.stats[op], cfg.repeats
        rows.append(
            dict(op=op, world=world, size=size, codec=codec or "bf16", slices=k,
                 time_s=statistics.median(times), times_s=times, raw_bytes=s.raw_bytes // r,
                 wire_bytes=s.wire_bytes // r, encode_s=s.encode_s / r, decode_s=s.decode_s / r,
                 comm_s=s.comm_s / r, sqnr_db=sqnr, buffers_first=first,
                 buffers_repeat=policy.buffers.allocated_bytes - first)
        )  # fmt: skip
    return rows


def _rank_main(rank: int, world: int, port: int, cfg: argparse.Namespace) -> list[dict]:
    _load_backend(cfg.backend)
    with gloo_rank(rank, world, port, cfg.threads):
        return [r for op in cfg.ops for size in cfg.sizes for r in _measure(op, size, rank, world, cfg)]


def format_table(rows: list[dict]) -> str:
    """One block per (op, world): every variant of a size next to its plain bf16 row."""
    head = "size      variant            time ms   algbw MB/s  wire MB  x fewer  speedup  SQNR dB"
    head += "   enc ms   dec ms  comm ms  buf MB"
    lines = []
    for key in dict.fromkeys((r["op"], r["world"]) for r in rows):
        lines += ["", f"{key[0]}  world={key[1]}", head]
        block = [r for r in rows if (r["op"], r["world"]) == key]
        for r in block:
            base = next(b for b in block if b["size"] == r["size"] and b["codec"] == "bf16")
            name = r["codec"] + (f" slices={r['slices']}" if r["slices"] > 1 else "")
            lines.append(
                f"{_fmt_size(r['size']):<9} {name[:18]:<18} {r['time_s'] * 1e3:>8.1f} "
                f"{r['size'] / r['time_s'] / 1e6:>12.1f} {r['wire_bytes'] / 1e6:>8.3f} "
                f"{base['wire_bytes'] / max(r['wire_bytes'], 1):>8.2f} {base['time_s'] / r['time_s']:>8.2f} "
                f"{r['sqnr_db']:>8.2f} {r['encode_s'] * 1e3:>8.1f} {r['decode_s'] * 1e3:>8.1f} "
                f"{r['comm_s'] * 1e3:>8.1f} {r['buffers_first'] / 1e6:>7.2f}"
            )
    return "\n".join(lines)


def _rate_auto(thr: dict, codec: str, ratio: float) -> float:
    """Mbit/s of a link carrying bf16 elements `ratio` times slower than the codec encodes."""
    return 16 * thr[codec]["encode"] / ratio / 1e6


def _reexec_in_netns(args: argparse.Namespace, rate: float) -> int:
    from .netns import NetNamespace, child_env

    argv = [sys.executable, "-m", "taco.bench.comm"]
    for name in ("ops", "sizes", "world", "codecs", "slices"):
        argv += [f"--{name}", ",".join(str(v) for v in getattr(args, name))]
    for name in ("repeats", "warmup", "threads", "backend", "burst", "latency", "delay", "codec_link_ratio"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    argv += ["--rate", f"{rate:.6g}"] + (["--json", os.path.abspath(args.json)] if args.json else [])
    env = child_env()
    with NetNamespace(rate, args.burst, args.latency, args.delay) as ns:
        print(ns.describe(), flush=True)
        code = subprocess.run([*ns.command(argv), "--link", ns.describe()], env=env).returncode
        print(ns.qdisc_stats())
    return code


def run_comm(args: argparse.Namespace) -> int:
    """Run the benchmark described by `args` (see `add_arguments`); print tables; 0 on success,
    2 (one line on stderr) for an unknown op or a capped link without root."""
    bad = [op for op in args.ops if op not in OPS]
    if bad:
        raise ValueError(f"unknown ops {bad}: choose from {list(OPS)}")
    torch.set_num_threads(args.threads)
    backend = _load_backend(args.backend)
    thr = codec_throughput(args.codecs)
    if args.rate is not None and args.link is None:
        rate = (
            _rate_auto(thr, args.codecs[0], args.codec_link_ratio)
            if args.rate == "auto"
            else float(args.rate)
        )
        return _reexec_in_netns(args, rate)
    print(f"backend: {backend}; threads/rank: {args.threads}; link: {args.link or 'lo, uncapped'}")
    for name, t in thr.items():
        line = (
            f"  {name:<24} encode {t['encode'] / 1e6:8.1f} Melem/s   decode {t['decode'] / 1e6:8.1f} Melem/s"
        )
        if args.rate is not None and name != "copy":
            link = float(args.rate) * 1e6 / 16  # bf16 elements per second on the capped lo
            line += f"   link {link / 1e6:.2f} Melem/s bf16 -> encode/link = {t['encode'] / link:.1f}x"
        print(line)
    rows = [r for w in args.world for r in spawn_ranks(_rank_main, w, args)]
    print(format_table(rows))
    if args.json:
        meta = dict(backend=backend, threads=args.threads, link=args.link, rate_mbit=args.rate,
                    codec_throughput=thr, torch=torch.__version__, argv=sys.argv[1:])  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":  # `python -m taco.bench.comm ARGS` = `taco bench comm ARGS`
    from taco.cli import main

    sys.exit(main(["bench", "comm", *sys.argv[1:]]))
