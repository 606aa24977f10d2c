"""The "native" backend: the C kernels of `taco_cpu.c` on CPU tensors, built, cached and bound here.

The shared library is compiled once per machine with the system C compiler (`$CC`, else cc/gcc),
about 2 s, into `$TACO_CACHE_DIR/kernels` (default `~/.cache/taco/kernels`, else a temp
dir), keyed by a hash of the source, the flags and the CPU, and renamed into place atomically, so
concurrent ranks may race to build it safely. No torch headers, no OpenMP (short-lived pthreads:
safe after fork). If nothing can be built, `library()` returns None and callers use the eager
reference (one log line says why).

`NativeBackend` implements the codec backend interface (`taco.codec.backend`) at the wire level: any
float dtype in, the codec's layout `[payload][scale_0 x ng][scale_1 x ng]` out, with no fp32 copy,
no padding copy and no scale copies (scales are written unaligned-safe, so buffers may start at any
byte); decode writes straight into the caller's tensor.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from taco.codec.backend import KernelBackend

SOURCE = (Path(__file__).with_name("taco_cpu.c")).read_text()

log = logging.getLogger("taco.kernels")

FLAGS = ["-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11"]

KIND = {"taco": 0, "fp8": 1, "int": 2}
FMT = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
SFMT = {"fp32": 0, "bf16": 1, "e8m0": 2}


class Cfg(ctypes.Structure):
    """Mirror of `cfg_t` in the C source: one codec configuration."""

    _fields_ = [
        ("kind", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("rotate", ctypes.c_int32),
        ("fmt", ctypes.c_int32),
        ("bits", ctypes.c_int32),
        ("fmax", ctypes.c_float),
        ("lam", ctypes.c_float),
        ("target", ctypes.c_float),
        ("qmax", ctypes.c_float),
        ("sfmt", ctypes.c_int32),
        ("signs", ctypes.c_int32),  # last: a build of an older source reads the prefix
    ]


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("flags", "model name", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _cache_dir() -> Path:
    root = os.environ.get("TACO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "taco")
    d = Path(root) / "kernels"
    try:
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    d = Path(tempfile.gettempdir()) / f"taco-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _compile(cc: str, out: Path, source: str = SOURCE) -> None:
    """Compile `source` (default: SOURCE) to `out`, with -march=native when the compiler accepts it."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "taco_cpu.c"
        src.write_text(source)
        so = Path(tmp) / out.name
        err = ""
        for extra in (["-march=native"], []):
            cmd = [cc, *FLAGS, *extra, str(src), "-o", str(so), "-lm"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                os.replace(so, out)  # atomic: a racing rank sees the old file or the whole new one
                return
            err = r.stderr[-2000:]
        raise RuntimeError(f"{cc} failed: {err}")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    cfg = ctypes.POINTER(Cfg)
    lib.taco_init.argtypes = []
    lib.taco_lut.argtypes = [i32, i32]
    lib.taco_lut.restype = ctypes.c_float
    lib.taco_encode.argtypes = [cfg, p, i32, i64, p, p, p, i32]
    lib.taco_decode.argtypes = [cfg, p, p, p, i64, p, i32, i32]
    lib.taco_decode_sum_encode.argtypes = [cfg, i32, i64, p, p, p, i64, p, i32, i32, p, p, p, p, i32, i32]
    for f in (lib.taco_init, lib.taco_encode, lib.taco_decode, lib.taco_decode_sum_encode):
        f.restype = None
    lib.taco_init()
    return lib


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded native library, building it on first use; None if it cannot be built."""
    if os.environ.get("TACO_NO_NATIVE"):
        log.info("taco.kernels: native CPU kernels disabled by TACO_NO_NATIVE")
        return None
    cc = _compiler()
    if cc is None:
        log.warning("taco.kernels: no C compiler found (set CC); CPU codecs use the eager reference")
        return None
    key = hashlib.sha256("\0".join([SOURCE, " ".join(FLAGS), _cpu_id(), cc]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"taco_cpu_{key}.so"
    try:
        if not out.exists():
            _compile(cc, out)
        return _bind(ctypes.CDLL(str(out)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("taco.kernels: native CPU kernels unavailable (%s); using the eager reference", e)
        return None


def num_threads() -> int:
    """Threads for one kernel call: torch's intra-op setting (TACO_CPU_THREADS overrides)."""
    env = os.environ.get("TACO_CPU_THREADS")
    return max(1, int(env)) if env else torch.get_num_threads()


def cfg(
    kind: str,
    group: int,
    rotate: bool,
    fp8: torch.dtype | None = None,
    fmax: float = 0.0,
    lam: float = 0.0,
    target: float = 1.0,
    qmax: float = 0.0,
    bits: int = 8,
    scale_fmt: str = "fp32",
    signs: bool | str = False,
) -> Cfg:
    """One codec configuration for the C entry points (signs: the randomized Hadamard's +-1 diagonal,
    True; "auto": per group the plain or the randomized rotation, the choice in the scale's sign bit)."""
    return Cfg(
        KIND[kind], group, int(rotate), FMT.get(fp8, 0), bits, fmax, lam, target, qmax, SFMT[scale_fmt],
        2 if signs == "auto" else int(signs),
    )  # fmt: skip


# -- the backend ----------------------------------------------------------------------------------
def codec_cfg(codec) -> Cfg:
    """The C configuration of a GroupCodec instance (taco, taco-1s, fp8-group, int*), made once."""
    c = codec.__dict__.get("_native_cfg")
    if c is None:
        fam, g, sf = codec.family, codec.group_size, codec.scale_fmt
        if fam == "taco":
            c = cfg("taco", g, True, codec.fmt.dtype, codec.fmt.fmax, codec.lam, codec.target, scale_fmt=sf)
        elif fam == "fp8":
            c = cfg("fp8", g, codec.rotate, codec.fmt.dtype, codec.fmt.fmax, scale_fmt=sf)
        else:
            q, signs = float(codec.qmax), getattr(codec, "signs", False)
            c = cfg("int", g, codec.rotate, qmax=q, bits=codec.bits, scale_fmt=sf, signs=signs)
        codec.__dict__["_native_cfg"] = c
    return c


def implements(codec) -> bool:
    """Whether the C kernels implement this codec: the taco/fp8/int families (taco, taco-1s,
    fp8-group, int8-group, int2..int8-hadamard: B-bit codes packed LSB first, signs False, True or
    "auto"), each with fp32, bf16 or e8m0 scales, G in 8..512. Anything else runs the eager reference."""
    fam, g = getattr(codec, "family", None), getattr(codec, "group_size", 0)
    ok = fam in KIND and 8 <= g <= 512 and (fam == "taco" or g % 8 == 0)
    bits = getattr(codec, "bits", 8)
    ok = ok and (2 <= bits <= 8 if fam == "int" else bits == 8)
    return ok and getattr(codec, "scale_fmt", "fp32") in SFMT


def _offsets(codec, base: int, ng: int) -> tuple[int, int, int | None]:
    """Addresses of payload, scale 0 and scale 1 (None) of one chunk starting at `base`."""
    p = ng * codec.group_size * codec.bits // 8
    return base, base + p, (base + p + codec.scale_bytes * ng if codec.n_scales == 2 else None)


class NativeBackend(KernelBackend):
    """The C kernels (one pass per batch of 16 groups) on CPU tensors."""

    name = "native"

    def supports(self, codec, device: torch.device) -> bool:
        return device.type == "cpu" and implements(codec) and library() is not None

    def encode(self, codec, x: torch.Tensor, out: torch.Tensor) -> None:
        x = x.contiguous()
        q, s0, s1 = _offsets(codec, out.data_ptr(), codec.groups(x.numel()))
        n, dt = x.numel(), DTYPE[x.dtype]
        library().taco_encode(codec_cfg(codec), x.data_ptr(), dt, n, q, s0, s1, num_threads())

    def decode(self, codec, buf: torch.Tensor, y: torch.Tensor) -> None:
        n = y.numel()
        q, s0, s1 = _offsets(codec, buf.data_ptr(), codec.groups(n))
        library().taco_decode(codec_cfg(codec), q, s0, s1, n, y.data_ptr(), DTYPE[y.dtype], num_threads())

    def decode_sum_encode(self, codec, bufs, stride, nchunks, numel, own, own_index, out, sum_out) -> None:
        ng = codec.groups(numel)
        q, s0, s1 = _offsets(codec, bufs.data_ptr(), ng)
        oq, os0, os1 = (None, None, None) if out is None else _offsets(codec, out.data_ptr(), ng)
        if own is not None:
            own = own.contiguous()
        op, odt = (None, 0) if own is None else (own.data_ptr(), DTYPE[own.dtype])
        sp, sdt = (None, 0) if sum_out is None else (sum_out.data_ptr(), DTYPE[sum_out.dtype])
        library().taco_decode_sum_encode(
            codec_cfg(codec), nchunks, stride, q, s0, s1, numel, op, odt, own_index, oq, os0, os1, sp, sdt,
            num_threads(),
        )  # fmt: skip
