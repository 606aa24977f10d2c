"""The codec and backend pairs of the numerical edge tests, and how to build each."""

from __future__ import annotations

import taco
import taco.kernels as K
from taco.codec.mx import MX_CODECS
from taco.codec.specs import parse_spec
from taco.kernels import native

# every lossy codec, and lean per-group scale formats as "name/scale_fmt" (issue 13)
SCALED = ["taco/bf16", "taco-1s/e8m0", "fp8-group/e8m0", "int8-hadamard/e8m0", "int6-hadamard/bf16",
          "int6-hadamard/e8m0", "int5-hadamard/e8m0", "int6-hadamard(signs=auto)/bf16"]  # fmt: skip


LOSSY = [n for n in taco.list_codecs() if n != "none"] + ["int6-hadamard(signs=auto)"] + SCALED


BACKENDS = ["eager", "native", "triton"]


def build(name: str, backend: str = "auto"):
    """A codec from a LOSSY entry ("name" or "spec/scale_fmt"); fp8-tensor and the hardware block
    formats have the reference only."""
    spec, _, sfmt = name.partition("/")
    base, opts = parse_spec(spec)
    if base == "fp8-tensor" or base in MX_CODECS:
        return taco.get_codec(base, **opts)
    return taco.get_codec(base, backend=backend, **opts, **({"scale_fmt": sfmt} if sfmt else {}))


def served(name: str, backend: str) -> bool:
    """Whether `backend` runs this codec itself (pairs it would hand to the eager reference, like
    native with other widths or scale formats, are the eager pair again and are left out)."""
    if name == "fp8-tensor" or name in MX_CODECS:
        return backend == "eager"
    return backend != "native" or native.implements(build(name))


# (codec, backend) pairs
PAIRS = [(n, b) for n in LOSSY for b in BACKENDS if served(n, b)]


def missing(backend: str) -> str | None:
    """Why `backend` cannot run on this machine's CPU (None: it can)."""
    if backend == "native" and native.library() is None:
        return "no C compiler: native kernels not built"
    if backend == "triton":
        if not K.triton_available():
            return "triton not installed"
        from taco.kernels import triton_taco

        if not triton_taco.INTERPRET:
            return "triton kernels on CPU need TRITON_INTERPRET=1 before triton is imported"
    return None
