"""What the steps of `benchmarks/gpu_check.py` share: devices, timing, the codecs with a Triton kernel."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))

MIB = 2**20


def key(text: str) -> None:
    """A key figure for the summary table of gpu_check.sh."""
    print(f"KEY {text}", flush=True)


# -- devices and timing ----------------------------------------------------------------------------
def pick_device(dry: bool):
    import torch

    if dry:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run needs TRITON_INTERPRET=1 in the environment (gpu_check.sh sets it)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        key("no CUDA device (use --dry-run on a CPU machine)")
        sys.exit(3)
    return torch.device("cuda")


class Timer:
    """GPU time of back-to-back calls (CUDA events behind a sleep kernel), or CPU wall time."""

    def __init__(self, device, reps: int, inner: int, warmup: int = 3) -> None:
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.reps, self.inner, self.warmup = reps, inner, warmup
        self.cycles_per_s = self._calibrate() if self.cuda else 0.0

    def _calibrate(self) -> float:
        torch = self.torch
        if not hasattr(torch.cuda, "_sleep"):
            return 0.0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # first launch
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / (start.elapsed_time(end) / 1e3)

    def issue_seconds(self, fn: Callable[[], object]) -> float:
        """CPU seconds to issue one call (no synchronisation inside the loop)."""
        sync = self.torch.cuda.synchronize if self.cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(self.inner):
            fn()
        t = (time.perf_counter() - t0) / self.inner
        sync()
        return t

    def seconds(self, fn: Callable[[], object]) -> float:
        """Median seconds per call."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            out = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                for _ in range(self.inner):
                    fn()
                out.append((time.perf_counter() - t0) / self.inner)
            return statistics.median(out)
        issue = self.issue_seconds(fn)
        out = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            if self.cycles_per_s:  # keep the GPU busy while the calls are issued
                torch.cuda._sleep(int(min(2 * issue * self.inner + 2e-4, 0.5) * self.cycles_per_s))
            start.record()
            for _ in range(self.inner):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / self.inner)
        return statistics.median(out)


# -- the codecs with a Triton kernel ---------------------------------------------------------------
# Timed besides the registry's defaults, each right after the codec of its name: the signs="auto"
# variant (it quantizes every group under both rotations).
EXTRA_SPECS = ("int6-hadamard(group_size=128,scale_fmt=fp32,signs=false)",)
"""Beside each codec's defaults: int6-hadamard's former settings, the fused path before the measured
defaults (docs/design.md 1.2)."""


def triton_codecs(device) -> list:
    """Every registered codec whose wire-level calls the Triton kernels serve on `device`.

    Asked of the codec (`codec.kernel(device)`, the one backend interface), not hard-coded: each
    codec of `list_codecs()` that accepts a backend, built with backend="triton" and default options,
    followed by the `EXTRA_SPECS` of its name.
    """
    import taco
    import taco.kernels as K
    from taco.codec import accepted_options
    from taco.codec.specs import parse_spec

    if not K.triton_available():
        return []
    extra = [parse_spec(s) for s in EXTRA_SPECS]
    out = []
    for name in taco.list_codecs():
        opts = accepted_options(name, {"backend": "triton"})
        if not opts:
            continue
        variants = [{}] + [o for n, o in extra if n == name]
        for c in (taco.get_codec(name, **opts, **o) for o in variants):
            if c.kernel(device).name == "triton":
                out.append(c)
    return out


def need_codecs(device, dry: bool = False) -> list:
    """The codecs to measure: all of `triton_codecs`; in a dry run one per family (the interpreter
    is slow, and the families are what differs in the kernels)."""
    codecs = triton_codecs(device)
    if not codecs:
        key("no codec is served by the Triton kernels here (is triton installed?)")
        sys.exit(4)
    print("codecs with a Triton kernel: " + ", ".join(c.spec for c in codecs), flush=True)
    if dry:
        first = {}
        for c in codecs:
            first.setdefault(c.family, c)
        codecs = list(first.values())
        print("dry run, one per family: " + ", ".join(c.name for c in codecs), flush=True)
    return codecs


def size_str(mib: float) -> str:
    return f"{mib:g}MiB" if mib >= 0.25 else f"{mib * 1024:g}KiB"


def fmt_us(t: float) -> str:
    return f"{t * 1e6:9.1f}"
