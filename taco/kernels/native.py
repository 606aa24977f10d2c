"""Build, cache and bind the native CPU kernels of `cpu_source.py` (plain C, loaded with ctypes).

The shared library is compiled once per machine with the system C compiler (`$CC`, else cc/gcc),
about 2 s, into `$TACO_CACHE_DIR/kernels` (default `~/.cache/taco/kernels`, else a temp
dir), keyed by a hash of the source, the flags and the CPU, and renamed into place atomically, so
concurrent ranks may race to build it safely. No torch headers, no OpenMP (short-lived pthreads:
safe after fork). If nothing can be built, `library()` returns None and callers use the eager
reference (one log line says why).
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

from .cpu_source import SOURCE

log = logging.getLogger("taco.kernels")

FLAGS = ["-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11"]

KIND = {"taco": 0, "fp8": 1, "int": 2}
FMT = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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


def _compile(cc: str, out: Path) -> None:
    """Compile SOURCE to `out`, with -march=native when the compiler accepts it."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "taco_cpu.c"
        src.write_text(SOURCE)
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
    lib.taco_decode_sum_encode.argtypes = [cfg, i32, i64, p, p, p, i64, p, i32, i32, p, p, p, p, i32]
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
) -> Cfg:
    """One codec configuration for the C entry points."""
    return Cfg(KIND[kind], group, int(rotate), FMT.get(fp8, 0), bits, fmax, lam, target, qmax)
