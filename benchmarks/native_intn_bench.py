"""Native CPU kernel speed of the integer codecs against `taco` (issue 13): encode and decode ns/element.

Times the loaded native library (`taco.kernels.native`) on `-n` bf16 Gaussian elements (default 4M,
G = 128, one thread, into preallocated buffers). The machine may be shared, so each codec is timed
back to back with `taco` (their calls interleaved), each figure the best of `--repeats` calls, as
CPU time of the calling thread (the kernels run on it). The issue's target: int5/int6-hadamard
encode and decode at least as fast per element as `taco`'s. `SPECS` (G=64, bf16 scales, signs off,
on and "auto") keep their own options.

    PYTHONPATH=$PWD python benchmarks/native_intn_bench.py [-n 4194304] [--repeats 7] [--scale-fmt fp32]
"""

from __future__ import annotations

import argparse

import torch

import taco
from benchmarks.native_simd_check import decode, encode, timeit
from taco.codec.specs import parse_spec
from taco.kernels import native

CODECS = ("int4-hadamard", "int5-hadamard", "int6-hadamard", "int8-hadamard")
# specs with their own options (--scale-fmt not applied): issue 13's 0.78 B/elem candidates at G=64
SPECS = tuple(
    f"int6-hadamard(group_size=64,scale_fmt=bf16{s})" for s in ("", ",signs=true", ",signs=auto")
)


def ops(lib, codec, x: torch.Tensor) -> dict:
    """encode/decode closures of one codec writing into buffers made here."""
    n = x.numel()
    buf = encode(lib, codec, x)
    y = torch.empty_like(x)
    return {
        "encode": lambda: encode(lib, codec, x, 1, buf),
        "decode": lambda: decode(lib, codec, buf, n, x.dtype, 1, y),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=1 << 22)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--scale-fmt", default="fp32", choices=("fp32", "bf16", "e8m0"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    lib = native.library()
    assert lib is not None, "native kernels unavailable (no C compiler?)"
    x = torch.randn(a.n, generator=torch.Generator().manual_seed(0)).bfloat16()
    base = ops(lib, taco.get_codec("taco", backend="native", scale_fmt=a.scale_fmt), x)
    print(f"ns/element, {a.n} bf16 elements, G=128, scale_fmt={a.scale_fmt}, 1 thread, thread CPU time,")
    print(f"best of {a.repeats}; each codec timed back to back with taco (interleaved)")
    print(f"{'codec':48s} {'op':7s} {'codec':>7s} {'taco':>7s}  codec/taco")
    codecs = [taco.get_codec(name, backend="native", scale_fmt=a.scale_fmt) for name in CODECS]
    codecs += [taco.get_codec(n, backend="native", **o) for n, o in map(parse_spec, SPECS)]
    for c in codecs:
        assert native.implements(c), c.spec
        mine = ops(lib, c, x)
        for op in ("encode", "decode"):
            tc, tt = (t / a.n * 1e9 for t in timeit([mine[op], base[op]], a.repeats, stat=min))
            print(f"{c.spec:48s} {op:7s} {tc:7.2f} {tt:7.2f}  {tc / tt:6.2f}x")


if __name__ == "__main__":
    main()
