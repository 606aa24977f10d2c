"""Codec calls back to back against the same calls after an idle gap, on this CPU.

Why this exists: inside `taco bench cluster` the per-step encode + decode milliseconds are about
twice what the native kernels take on the same message in a tight loop. A training step calls the
codec right after a blocking wait on gloo (or after other work), not back to back; on a virtual
machine the first memory traffic after such a gap can cost far more than a cache refill. This
times one TP message (the cluster config's 16 x 128 x 128 bf16 elements) through
`encode_chunks` and the two-rank gather all-reduce's `decode_sum_encode` (2 parts, sum into bf16),
median of `--repeats` calls: back to back, after `--gap-ms` of sleep, and after `--gap-ms` of a
busy loop that touches no memory (docs/cluster.md, "Codec time inside training").

    PYTHONPATH=$PWD python benchmarks/idle_gap_check.py [--numel 262144] [--gap-ms 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import taco


def timed(fn: Callable[[], None], gap_s: float, spin: bool, repeats: int) -> float:
    """Median wall seconds of `fn`, each call preceded by `gap_s` of sleep (or of spinning)."""
    ts = []
    for _ in range(repeats):
        if gap_s and spin:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
        elif gap_s:
            time.sleep(gap_s)
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=16 * 128 * 128, help="bf16 elements per message")
    ap.add_argument("--codec", default="taco", help="codec name (taco.get_codec, default options)")
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2, help="the table, this many times (drift shows)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    codec = taco.get_codec(a.codec)
    n = a.numel
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    nb = codec.nbytes(n, torch.bfloat16)
    bufs = torch.empty(2 * nb, dtype=torch.uint8)
    codec.encode_chunks(x, bufs, [(0, n, 0)])
    bufs[nb:].copy_(bufs[:nb])  # the two gathered parts
    y = torch.empty(n, dtype=torch.bfloat16)
    ops = {
        "encode": lambda: codec.encode_chunks(x, bufs, [(0, n, 0)]),
        "decode-sum (2 parts)": lambda: codec.decode_sum_encode(bufs, nb, 2, n, torch.bfloat16, sum_out=y),
    }
    for fn in ops.values():  # warm-up: the kernel build, first touches
        for _ in range(20):
            fn()
    gap = a.gap_ms / 1e3
    print(f"{codec.spec}: {n} bf16 elements, 1 thread, median of {a.repeats} calls, microseconds")
    print(f"{'op':22s} {'back to back':>13s} {f'{a.gap_ms:g} ms sleep':>13s} {f'{a.gap_ms:g} ms spin':>13s}")
    for _ in range(a.rounds):
        for name, fn in ops.items():
            cases = ((0.0, False), (gap, False), (gap, True))
            row = [timed(fn, g, spin, a.repeats) * 1e6 for g, spin in cases]
            print(f"{name:22s} " + " ".join(f"{v:13.0f}" for v in row))


if __name__ == "__main__":
    main()
