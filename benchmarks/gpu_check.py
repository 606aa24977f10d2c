"""The measurement steps of `benchmarks/gpu_check.sh`, one subcommand each.

    python benchmarks/gpu_check.py versions              # python / torch / CUDA / triton / GPU
    python benchmarks/gpu_check.py codec-check [--dry-run] # every timed codec against eager (+ compiles)
    python benchmarks/gpu_check.py bandwidth [--dry-run] # encode, decode, decode-sum-encode vs a copy
    python benchmarks/gpu_check.py host [--dry-run]      # CPU time to issue one encode + decode
    python benchmarks/gpu_check.py replay [--dry-run]    # one rank of an N=8 two-shot all-reduce
    python benchmarks/gpu_check.py corpus DIR [--mb X]   # a generated text corpus (offline data)
    python benchmarks/gpu_check.py train-check RUN_DIR --device cuda
                                                          # params on the device, loss falls, tok/s

Without --dry-run the kernels run on CUDA (the step fails if there is none); with --dry-run they
run on the CPU through the Triton interpreter (TRITON_INTERPRET=1, set by the shell script) at
tiny sizes, so only that the code runs is checked, not the figures.
Every step prints its table and "KEY <text>" lines, which the shell script collects as the key
figures of its summary. Exit status: 0 ok, anything else a failure.

Timing on the GPU (`gpu_seconds`): a `torch.cuda._sleep` kernel is queued first, so that the CPU
has issued all the timed calls before the GPU reaches the start event; the events then time the
calls back to back, without the host's launch gaps (those are what the `host` step measures).
Median over repeats of `inner` calls each, after a warm-up (which also compiles the kernels).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from gpu_codec_check import cmd_codec_check
from gpu_common import MIB, Timer, fmt_us, key, need_codecs, pick_device, size_str
from gpu_replay import cmd_replay
from gpu_train_check import cmd_corpus, cmd_train_check


# -- step: versions --------------------------------------------------------------------------------
def cmd_versions(args: argparse.Namespace) -> int:
    print(f"python  {sys.version.split()[0]} ({platform.platform()})")
    try:
        import torch
    except ImportError as e:
        key(f"python {sys.version.split()[0]}; torch missing: {e}")
        return 1
    cuda = torch.version.cuda or "none"
    print(f"torch   {torch.__version__} (CUDA build {cuda}, cuda available: {torch.cuda.is_available()})")
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "missing"
    print(f"triton  {tv}   TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}")
    gpu = "no GPU"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu = f"{p.name} {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
        print(f"gpu     {gpu} (device count {torch.cuda.device_count()})")
    import taco
    import taco.kernels as K

    print(f"taco    {taco.__file__}; auto backends cpu={K.auto_order('cpu')} cuda={K.auto_order('cuda')}")
    key(f"torch {torch.__version__} cuda {cuda} triton {tv}; {gpu}")
    return 0


# -- step: bandwidth -------------------------------------------------------------------------------
def cmd_bandwidth(args: argparse.Namespace) -> int:
    """Encode / decode / decode-sum-encode of a bf16 message, as time ratios to a copy of it."""
    import torch

    from taco.comm.compressed import group_unit, split_sizes

    dev = pick_device(args.dry_run)
    codecs = need_codecs(dev, args.dry_run)
    sizes = [1 / 256] if args.dry_run else [64, 256]  # every message larger than the L2 (60 MB)
    timer = Timer(dev, reps=1, inner=1, warmup=1) if args.dry_run else Timer(dev, reps=15, inner=10)
    nway = 8
    print(
        f"time of each op / time of a device-to-device copy of the same bf16 message (lower is better);\n"
        f"dse = decode-sum-encode of the {nway} terms of one rank's slice ({nway - 1} received chunks + "
        f"its own raw chunk, 1/{nway} of the message each: the all-reduce middle step, N = {nway});\n"
        "bw = op bytes/s over copy bytes/s (bytes = read + written)"
    )
    print(
        f"{'codec':36s} {'size':>8s} {'copy us':>9s} {'GB/s':>7s} "
        f"{'encode':>14s} {'decode':>14s} {'dse':>14s}"
    )
    worst = {}
    for c in codecs:
        for mib in sizes:
            n = int(mib * MIB) // 2
            x = torch.randn(n, device=dev).to(torch.bfloat16)
            y = torch.empty_like(x)
            nb = c.nbytes(n)
            buf = torch.empty(nb, dtype=torch.uint8, device=dev)
            c.encode(x, out=buf)
            m = split_sizes(n, nway, group_unit(c))[0]
            mb = c.nbytes(m)
            recv = torch.cat([c.encode(x[k * m : (k + 1) * m]).data for k in range(1, nway)])
            own = x[:m]
            out = torch.empty(mb, dtype=torch.uint8, device=dev)
            t_copy = timer.seconds(lambda: y.copy_(x))  # noqa: B023 - called inside the iteration
            t = {
                "encode": timer.seconds(lambda: c.encode(x, out=buf)),  # noqa: B023
                "decode": timer.seconds(lambda: c.decode(c.wrap(buf, (n,), torch.bfloat16), out=y)),  # noqa: B023
                "dse": timer.seconds(
                    lambda: c.decode_sum_encode(recv, mb, nway - 1, m, torch.bfloat16, own, 0, out)  # noqa: B023
                ),
            }
            moved = {"encode": 2 * n + nb, "decode": nb + 2 * n, "dse": recv.numel() + 2 * m + mb}
            cells = []
            for op in ("encode", "decode", "dse"):
                ratio = t[op] / t_copy
                bw = (moved[op] / t[op]) / (4 * n / t_copy)
                cells.append(f"{ratio:5.2f}x {bw:4.2f}bw")
                if mib == max(sizes):
                    worst[(c.spec, op)] = ratio  # spec: two codecs may share a name
            print(
                f"{c.spec:36s} {size_str(mib):>8s} {fmt_us(t_copy)} {4 * n / t_copy / 1e9:7.1f} "
                + " ".join(f"{s:>14s}" for s in cells),
                flush=True,
            )
    big, parts = max(sizes), []
    for op in ("encode", "decode", "dse"):
        vals = [r for (_, o), r in worst.items() if o == op]
        parts.append(f"{op} {min(vals):.2f}-{max(vals):.2f}")
    ref = next((c for c in codecs if c.name == "taco"), codecs[0])
    mine = "/".join(f"{worst[(ref.spec, op)]:.2f}" for op in ("encode", "decode", "dse"))
    key(f"x copy time at {size_str(big)}: " + ", ".join(parts) + f" ({ref.name} {mine})")
    return 0


# -- step: host overhead ---------------------------------------------------------------------------
def cmd_host(args: argparse.Namespace) -> int:
    """CPU time spent issuing encode + decode of one message vs the GPU time of the two kernels."""
    import torch

    dev = pick_device(args.dry_run)
    codecs = need_codecs(dev, args.dry_run)
    sizes = [1 / 256, 1 / 128] if args.dry_run else [0.25, 0.5, 1, 2, 4]
    inner = 2 if args.dry_run else 50
    timer = Timer(dev, reps=1 if args.dry_run else 7, inner=inner, warmup=1 if args.dry_run else 3)
    print(
        "per call = codec.encode(x, out=buf) + codec.decode(codec.wrap(buf), out=y) of a bf16 message\n"
        f"host = CPU seconds issuing the call ({inner} calls, synchronize only after the loop); "
        "gpu = kernel time back to back; wall = issue loop + synchronize, per call.\n"
        "host/gpu > 1: the calls are launch-bound at that size"
    )
    print(f"{'codec':36s} {'size':>8s} {'host us':>9s} {'gpu us':>9s} {'wall us':>9s} {'host/gpu':>9s}")
    rows = []
    for c in codecs:
        for mib in sizes:
            n = int(mib * MIB) // 2
            x = torch.randn(n, device=dev).to(torch.bfloat16)
            y = torch.empty_like(x)
            buf = torch.empty(c.nbytes(n), dtype=torch.uint8, device=dev)

            def call(c=c, x=x, y=y, buf=buf, n=n):
                c.encode(x, out=buf)
                c.decode(c.wrap(buf, (n,), torch.bfloat16), out=y)

            gpu = timer.seconds(call)  # warms up (compiles) first
            issue = statistics.median(timer.issue_seconds(call) for _ in range(1 if args.dry_run else 3))
            sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            for _ in range(inner):
                call()
            sync()
            wall = (time.perf_counter() - t0) / inner
            rows.append((c.name, mib, issue, gpu))
            print(
                f"{c.spec:36s} {size_str(mib):>8s} {fmt_us(issue)} {fmt_us(gpu)} {fmt_us(wall)} "
                f"{issue / gpu:9.2f}",
                flush=True,
            )
    names = [c.name for c in codecs]
    first = "taco" if "taco" in names else names[0]
    mine = [(mib, issue, gpu) for name, mib, issue, gpu in rows if name == first]
    ends = ", ".join(f"{size_str(m)} {i * 1e6:.0f}/{g * 1e6:.0f}" for m, i, g in (mine[0], mine[-1]))
    bound = [m for m, i, g in mine if i > g]
    limit = f"launch-bound up to {size_str(max(bound))}" if bound else "never launch-bound"
    key(f"{first} host/gpu us per call: {ends}; {limit}")
    return 0


# -- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("versions").set_defaults(func=cmd_versions)
    steps = (("codec-check", cmd_codec_check), ("bandwidth", cmd_bandwidth), ("host", cmd_host),
             ("replay", cmd_replay))
    for name, fn in steps:
        s = sub.add_parser(name)
        s.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreter")
        s.set_defaults(func=fn)
    s = sub.add_parser("corpus")
    s.add_argument("dir")
    s.add_argument("--mb", type=float, default=1.0, help="megabytes of text")
    s.set_defaults(func=cmd_corpus)
    s = sub.add_parser("train-check")
    s.add_argument("run_dir")
    s.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    s.set_defaults(func=cmd_train_check)
    args = p.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
