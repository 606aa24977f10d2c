"""Old vs new native CPU kernels: bit-identical outputs, then a timing table in ns/element.

Builds `taco/kernels/taco_cpu.c` of a git revision (`--rev`, default 231ca9e, the kernels before
the SIMD rework) and of the working tree with native.py's flags (and its -march=native fallback),
runs both on many random and edge-case inputs (zeros, -0, NaN/Inf, 1e-30..1e30, fp32/bf16/fp16
inputs, odd sizes, every native codec and group size, 1 and 2 threads) and requires the same bytes
from encode, decode and decode-sum-encode (sums in every dtype, with and without the re-encode).
Then it times encode, decode and dsum of 1M bf16 elements on one thread (median of `--repeats`).

    PYTHONPATH=$PWD python benchmarks/native_simd_check.py [--rev REV] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import taco
from taco.kernels import native

ROOT = Path(__file__).resolve().parents[1]
CODECS = [  # (name, options): every codec family the native backend serves
    ("taco", {"fmt": "e4m3"}),
    ("taco", {"fmt": "e5m2"}),
    ("taco-1s", {"fmt": "e4m3"}),
    ("fp8-group", {"fmt": "e4m3"}),
    ("fp8-group", {"fmt": "e5m2"}),
    ("int8-group", {}),
    ("int8-hadamard", {}),
    ("int4-hadamard", {}),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def build(source: str, tmp: Path, name: str) -> ctypes.CDLL:
    """One kernel library built from `source` with native.py's flags."""
    cc = native._compiler()
    assert cc, "no C compiler"
    out = tmp / f"{name}.so"
    native._compile(cc, out, source)
    return native._bind(ctypes.CDLL(str(out)))


def build_with(flag: str, tmp: Path, name: str, source: str = native.SOURCE) -> ctypes.CDLL:
    """`build` with one more compiler flag (e.g. -mno-avx512f: every batch step takes the portable loops)."""
    saved = list(native.FLAGS)
    native.FLAGS[:] = [*saved, flag]
    try:
        return build(source, tmp, name)
    finally:
        native.FLAGS[:] = saved


def old_source(rev: str) -> str:
    cmd = ["git", "show", f"{rev}:taco/kernels/taco_cpu.c"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def offsets(codec, buf: torch.Tensor | None, ng: int) -> tuple:
    return (None, None, None) if buf is None else native._offsets(codec, buf.data_ptr(), ng)


def encode(lib, codec, x: torch.Tensor, nt: int = 1, buf: torch.Tensor | None = None) -> torch.Tensor:
    buf = torch.zeros(codec.nbytes(x.numel()), dtype=torch.uint8) if buf is None else buf
    q, s0, s1 = offsets(codec, buf, codec.groups(x.numel()))
    lib.taco_encode(native.codec_cfg(codec), x.data_ptr(), native.DTYPE[x.dtype], x.numel(), q, s0, s1, nt)
    return buf


def decode(lib, codec, buf: torch.Tensor, n: int, dtype: torch.dtype, nt: int = 1, y=None) -> torch.Tensor:
    y = torch.zeros(n, dtype=dtype) if y is None else y
    q, s0, s1 = offsets(codec, buf, codec.groups(n))
    lib.taco_decode(native.codec_cfg(codec), q, s0, s1, n, y.data_ptr(), native.DTYPE[dtype], nt)
    return y


def dsum(lib, codec, bufs: torch.Tensor, k: int, n: int, own, own_index: int, reencode, sdt, nt=1):
    """decode_sum_encode of k chunks laid out back to back -> (encoded sum or None, sums or None);
    `reencode`: a bool, or the buffer to re-encode into."""
    size, ng = codec.nbytes(n), codec.groups(n)
    out = reencode if isinstance(reencode, torch.Tensor) else None
    out = torch.zeros(size, dtype=torch.uint8) if reencode is True else out
    s = None if sdt is None else torch.zeros(n, dtype=sdt)
    q, s0, s1 = offsets(codec, bufs, ng)
    oq, os0, os1 = offsets(codec, out, ng)
    odt = 0 if own is None else native.DTYPE[own.dtype]
    sd = 0 if sdt is None else native.DTYPE[sdt]
    cfg = native.codec_cfg(codec)
    args = (ptr(own), odt, own_index, oq, os0, os1, ptr(s), sd, nt)
    lib.taco_decode_sum_encode(cfg, k, size, q, s0, s1, n, *args)
    return out, s


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def same_encoding(codec, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Encodings, old `a` against new `b`: the same bytes, except for rotated groups holding some
    |x_i| >= 2^(127 - log2 G) that the old kernels gave a NaN scale (their butterflies overflowed):
    new pre-scales those (finite in, finite out), so their bytes may differ."""
    if same(a, b):
        return True
    g = codec.group_size
    ng = codec.groups(x.numel())
    pa, sa = codec._split(a)
    pb, sb = codec._split(b)
    xf = torch.nn.functional.pad(x.float(), (0, ng * g - x.numel())).view(ng, g)
    free = (xf.abs() >= 2.0 ** (127 - (g.bit_length() - 1))).any(1) & sa[0].view(-1).isnan()
    keep = ~free
    return torch.equal(pa[keep], pb[keep]) and all(
        torch.equal(u.view(-1)[keep].view(torch.int32), v.view(-1)[keep].view(torch.int32))
        for u, v in zip(sa, sb)
    )


def same_dsum(codec, stacked: torch.Tensor, n: int, ra: tuple, rb: tuple) -> bool:
    """decode-sum-encode, old `ra` against new `rb` (encoded sums, sums): the same bytes, except in the
    groups where a chunk's scale is at least 2^(111 - log2 G) (decoded in a scaled domain now) or whose
    sum old encoded with a NaN scale and new with a finite one (pre-scaled)."""
    if same(ra[0], rb[0]) and same(ra[1], rb[1]):
        return True
    g, ng, size = codec.group_size, codec.groups(n), codec.nbytes(n)
    free = torch.zeros(ng, dtype=torch.bool)
    for k in range(stacked.numel() // size):
        s = codec._split(stacked[k * size : (k + 1) * size])[1][0].view(-1).abs()
        free |= s >= 2.0 ** (111 - (g.bit_length() - 1))
    if ra[0] is not None:
        sa, sb = codec._split(ra[0])[1][0].view(-1), codec._split(rb[0])[1][0].view(-1)
        free |= sa.isnan() & ~sb.isnan()
    keep = ~free
    if ra[0] is not None:
        (pa, sa), (pb, sb) = codec._split(ra[0]), codec._split(rb[0])
        if not torch.equal(pa[keep], pb[keep]):
            return False
        for u, v in zip(sa, sb):
            if not torch.equal(u.view(-1)[keep].view(torch.int32), v.view(-1)[keep].view(torch.int32)):
                return False
    if ra[1] is not None:
        el = keep.repeat_interleave(g)[:n]
        return torch.equal(ra[1][el].view(torch.uint8), rb[1][el].view(torch.uint8))
    return True


def same_decode(codec, buf: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Decoded values, old `a` against new `b`: the same bytes, except in groups whose scale is at least
    2^(111 - log2 G), where the old kernels' butterflies could overflow: new decodes those in a scaled
    domain and saturates (finite in, finite out)."""
    if same(a, b):
        return True
    g = codec.group_size
    s = codec._split(buf)[1][0].view(-1).abs()
    keep = ~(s >= 2.0 ** (111 - (g.bit_length() - 1))).repeat_interleave(g)[: a.numel()]
    return torch.equal(a[keep].view(torch.uint8), b[keep].view(torch.uint8))


def inputs(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Random data of mixed magnitudes and the edge cases, n elements each, in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (torch.rand(n, generator=gen) * 60 - 30)  # 1e-30 .. 1e30
    xs = [
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen) * mag,
        torch.zeros(n),
        -torch.zeros(n),
        torch.randn(n, generator=gen) * 1e-30,
        torch.randn(n, generator=gen) * 1e30,
    ]
    edge = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 1e-38, 3e38, 65504.0, 1e5, 448.0])
    e = torch.randn(n, generator=gen) * 10
    pick = torch.randint(0, edge.numel(), (n,), generator=gen)
    e = torch.where(torch.rand(n, generator=gen) < 0.05, edge[pick], e)
    xs.append(e)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int32).view(torch.float32)
    xs.append(bits)  # every fp32 bit pattern class, NaN payloads included
    return [x.to(dtype) for x in xs]


def check(old, new, quick: bool) -> int:
    """Compare old and new on everything; returns the number of comparisons (raises on a mismatch)."""
    count = 0
    groups = (32, 128, 512) if quick else (32, 64, 128, 256, 512)
    for g in groups:
        sizes = sorted({1, 7, g - 1, g, g + 1, 16 * g, 16 * g + 5, 37 * g + 3, 300 * g + 11})
        if quick:
            sizes = [7, g + 1, 37 * g + 3, 300 * g + 11]
        for name, opts in CODECS:
            codec = taco.get_codec(name, group_size=g, backend="native", **opts)
            for n in sizes:
                for dt in DTYPES:
                    for i, x in enumerate(inputs(n, dt, seed=n * 7 + g)):
                        for nt in (1, 2) if n > 256 * g else (1,):
                            a, b = encode(old, codec, x, nt), encode(new, codec, x, nt)
                            what = f"encode {name} {opts} G={g} n={n} {dt} input {i} nt={nt}"
                            assert same_encoding(codec, x, a, b), what
                            count += 1
                # decode: real encodings and random bytes (every code, NaN codes and odd scales included)
                gen = torch.Generator().manual_seed(n + g)
                size = codec.nbytes(n)
                bufs = [encode(new, codec, x) for x in inputs(n, torch.float32, seed=n)]
                bufs.append(torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8))
                for bi, buf in enumerate(bufs):
                    for dt in DTYPES:
                        nt = 2 if n > 256 * g else 1
                        ya, yb = decode(old, codec, buf, n, dt, nt), decode(new, codec, buf, n, dt, nt)
                        what = f"decode {name} {opts} G={g} n={n} {dt} buf {bi}"
                        assert same_decode(codec, buf, ya, yb), what
                        count += 1
                # decode-sum-encode: 3 chunks (one random-bytes chunk), own term in each position or none
                stacked = torch.cat([bufs[0], bufs[1], bufs[-1]])
                own = inputs(n, torch.bfloat16, seed=n + 1)[1]
                for own_t, idx in ((None, 0), (own, 0), (own, 2), (own.float(), 3), (own.half(), 1)):
                    for reenc, sdt in ((True, None), (True, torch.float32), (False, torch.bfloat16),
                                       (True, torch.float16)):  # fmt: skip
                        odt = None if own_t is None else own_t.dtype
                        ra = dsum(old, codec, stacked, 3, n, own_t, idx, reenc, sdt)
                        rb = dsum(new, codec, stacked, 3, n, own_t, idx, reenc, sdt)
                        assert same_dsum(codec, stacked, n, ra, rb), (
                            f"dsum {name} {opts} G={g} n={n} own@{idx} {odt} sum={sdt} re-encode={reenc}"
                        )
                        count += 1
    return count


def timeit(fns: list, repeats: int, stat=statistics.median) -> list[float]:
    """Median (or `stat`, e.g. min) seconds of each of `fns`, as CPU time of this thread (robust to
    other processes taking the cores: the kernels run on the calling thread), the calls interleaved
    after one warm-up call each."""
    ts: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            t = time.thread_time()
            fn()
            ts[k].append(time.thread_time() - t)
    return [stat(t) for t in ts]


def bench(libs: dict, n: int, repeats: int, codecs: list[tuple[str, dict]]) -> None:
    x = torch.randn(n).to(torch.bfloat16)
    print(f"\nns/element (thread CPU time), {n} bf16 elements, 1 thread, median of {repeats}")
    print("(dsum: 3 encoded chunks + the own bf16 chunk summed, the sum re-encoded)")
    print(f"{'codec':24s} {'op':8s} " + " ".join(f"{k:>8s}" for k in libs) + "  speedup")
    for name, opts in codecs:
        codec = taco.get_codec(name, backend="native", **opts)
        buf = encode(libs["new"], codec, x)
        stacked, out, y = torch.cat([buf, buf, buf]), torch.empty_like(buf), torch.empty_like(x)
        label = f"{name} {opts.get('fmt', '')}".strip() + f" G={codec.group_size}"
        ops = {
            "encode": lambda lib, c=codec, o=out: encode(lib, c, x, 1, o),
            "decode": lambda lib, c=codec, b=buf, y=y: decode(lib, c, b, n, torch.bfloat16, 1, y),
            "dsum": lambda lib, c=codec, b=stacked, o=out: dsum(lib, c, b, 3, n, x, 1, o, None),
        }
        for op, fn in ops.items():
            fns = [lambda lib=lib, fn=fn: fn(lib) for lib in libs.values()]
            row = [t / n * 1e9 for t in timeit(fns, repeats)]
            cells = " ".join(f"{v:8.2f}" for v in row)
            print(f"{label:24s} {op:8s} {cells}  {row[0] / row[-1]:6.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="231ca9e", help="git revision of the old kernels")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and group sizes in the check")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--all-codecs", action="store_true", help="time every codec, not only taco")
    ap.add_argument("-n", type=int, default=1 << 20)
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        libs = {"old": build(old_source(a.rev), tmp, "old"), "new": build(native.SOURCE, tmp, "new")}
        if not a.no_check:
            t = time.perf_counter()
            k = check(libs["old"], libs["new"], a.quick)
            print(f"bit-identical: {k} comparisons of old ({a.rev}) and new, {time.perf_counter() - t:.0f} s")
        bench(libs, a.n, a.repeats, CODECS if a.all_codecs else CODECS[:1])


if __name__ == "__main__":
    main()
