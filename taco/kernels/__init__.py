"""Fused compression operators for the codec families (docs/design.md 2: codec <- kernels <- comm).

Importing this package registers two backends in `taco.codec`'s registry:
- "compile" (CPU): one native C pass per batch of groups, built once per machine (`native.py`,
  ~2 s, cached on disk; ~10x the eager reference on 16M bf16 elements, encode + decode);
  results within one FP8/INT step of the reference where summation order differs (see tests).
With "compile" and "triton" a group's bytes depend on that group only (not on its neighbours, its
position in a batch or tile, or the thread count), so slicing a message never changes them; the
eager reference inherits this from torch's matmul (tested on CPU; cuBLAS picks kernels by shape).
- "inductor" (opt-in, any device): `torch.compile` of the reference functions (`inductor.py`).
- "triton" (CUDA, or anywhere under TRITON_INTERPRET=1): fused Triton kernels (`triton_taco.py`),
  imported lazily on first use and only if triton is importable.
backend="auto" then picks "compile" on CPU and "triton" on CUDA. `TACO_CODEC_BACKEND` overrides
the auto choice for every device: "eager" (reference only), "compile", "triton", or "auto".

Wire-level entry points (for `taco.comm`; flat tensors in the codec's grouping order, i.e. the
codec's `axis=-1`; each falls back to the reference composition where no fused path applies):
- `encode_into(codec, x, out)`: x (any float dtype) -> out, the codec's exact wire bytes;
- `decode_from(codec, buf, numel, dtype)`: one wire chunk -> `numel` values of `dtype`;
- `decode_sum_encode(codec, bufs, numel, own=None, own_index=0)`: the middle of the two-shot
  all-reduce (docs/design.md 1.3): N consecutive chunks of `numel` elements (and optionally the local
  raw values as term `own_index`) -> decode each in fp32, sum in order, re-encode; one pass.
The codecs use the first two on their own (`register_backend(..., encode_into, decode_from)`), so
`codec.encode`/`codec.decode` skip the fp32 copies once this package is imported.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from taco.codec import register_backend, set_auto_backends
from taco.codec.base import Codec

from . import compiled, inductor

__all__ = [
    "auto_order",
    "decode_from",
    "decode_sum_encode",
    "encode_into",
    "resolve_auto",
    "triton_available",
]

_FAMILIES = {
    "taco": ("taco_encode", "taco_decode"),
    "fp8": ("fp8_encode", "fp8_decode"),
    "int": ("int_encode", "int_decode"),
}


def triton_available() -> bool:
    """Whether triton can be imported (the kernels also need CUDA or TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


def _lazy_triton(name: str) -> Callable:
    def call(*args):
        from . import triton_taco

        return getattr(triton_taco, name)(*args)

    call.__name__ = f"triton_{name}"
    return call


def _compile_encode_into(codec: Codec, x: torch.Tensor, out: torch.Tensor) -> bool:
    if not compiled.supports(codec, x, out):
        return False
    compiled.encode_wire(codec, x, out)
    return True


def _compile_decode_from(codec: Codec, buf: torch.Tensor, numel: int, dtype: torch.dtype):
    return compiled.decode_wire(codec, buf, numel, dtype) if compiled.supports(codec, buf) else None


def _triton_encode_into(codec: Codec, x: torch.Tensor, out: torch.Tensor) -> bool:
    from . import triton_taco

    if not triton_taco.supports(codec, x.device):
        return False
    triton_taco.encode_wire(codec, x, out)
    return True


def _triton_decode_from(codec: Codec, buf: torch.Tensor, numel: int, dtype: torch.dtype):
    from . import triton_taco

    return (
        triton_taco.decode_wire(codec, buf, numel, dtype) if triton_taco.supports(codec, buf.device) else None
    )


def resolve_auto(choice: str, triton_ok: bool, interpret: bool = False) -> dict[str, list[str]]:
    """The auto order per device for a TACO_CODEC_BACKEND value (a pure function, for tests).

    Default ("auto"): "compile" on CPU (built in about a second once per machine, then loaded in
    milliseconds) and "triton" on CUDA. "eager" keeps the reference everywhere.
    """
    choice = choice.strip().lower() or "auto"
    if choice not in ("auto", "eager", "compile", "triton"):
        raise ValueError(f"TACO_CODEC_BACKEND={choice!r}: use auto, eager, compile or triton")
    cuda = ["triton"] if triton_ok and choice in ("auto", "triton") else []
    cpu = ["compile"] if choice in ("auto", "compile") else []
    if choice == "triton" and interpret and triton_ok:
        cpu = ["triton"]
    return {"cpu": cpu, "cuda": cuda}


def _register() -> dict[str, list[str]]:
    for fam, (enc, dec) in inductor.FUNCTIONS.items():
        register_backend(fam, "inductor", enc, dec)
    for fam, (enc, dec) in _FAMILIES.items():
        fns = (getattr(compiled, enc), getattr(compiled, dec), _compile_encode_into, _compile_decode_from)
        register_backend(fam, "compile", *fns)
        if triton_available():
            fns = (_lazy_triton(enc), _lazy_triton(dec), _triton_encode_into, _triton_decode_from)
            register_backend(fam, "triton", *fns)
    order = resolve_auto(
        os.environ.get("TACO_CODEC_BACKEND", "auto"),
        triton_available(),
        os.environ.get("TRITON_INTERPRET") == "1",
    )
    for dev, o in order.items():
        set_auto_backends(dev, o)
    return order


_AUTO = _register()


def auto_order(device_type: str) -> list[str]:
    """The backends backend="auto" tries on `device_type` (set at import, see module docstring)."""
    return list(_AUTO.get(device_type, []))


def _path(codec: Codec, device: torch.device) -> str:
    """Which implementation serves the wire-level calls: "triton", "compile" or "reference"."""
    if getattr(codec, "family", None) not in _FAMILIES:
        return "reference"
    order = auto_order(device.type) if codec.backend == "auto" else [codec.backend]
    for b in order:
        if b == "compile" and device.type == "cpu" and compiled.supports(codec):
            return "compile"
        if b == "triton" and triton_available():
            from . import triton_taco

            if triton_taco.supports(codec, device):
                return "triton"
    return "reference"


def encode_into(codec: Codec, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Encode flat `x` (fp32/bf16/fp16) into `out` (1-D uint8 of codec.nbytes(numel)); returns out."""
    n = x.numel()
    size = codec.nbytes(n, x.dtype)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8, device=x.device)
    if out.dtype != torch.uint8 or out.numel() != size:
        raise ValueError(f"{codec.spec}: out must be a 1-D uint8 tensor of {size} bytes")
    if n == 0:
        return out
    path = _path(codec, x.device)
    if path == "compile":
        compiled.encode_wire(codec, x.reshape(-1), out)
    elif path == "triton":
        from . import triton_taco

        triton_taco.encode_wire(codec, x.reshape(-1), out)
    else:
        codec.encode(x.reshape(-1), out=out)
    return out


def decode_from(
    codec: Codec, buf: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode one wire chunk (1-D uint8 of codec.nbytes(numel)) into a flat tensor of `dtype`."""
    if buf.numel() != codec.nbytes(numel, dtype):
        raise ValueError(f"{codec.spec}: buffer of {buf.numel()} bytes does not hold {numel} elements")
    if numel == 0:
        return torch.empty(0, dtype=dtype, device=buf.device)
    path = _path(codec, buf.device)
    if path == "compile":
        return compiled.decode_wire(codec, buf, numel, dtype)
    if path == "triton":
        from . import triton_taco

        return triton_taco.decode_wire(codec, buf, numel, dtype)
    return codec.decode(codec.wrap(buf, (numel,), dtype))


def decode_sum_encode(
    codec: Codec,
    bufs: torch.Tensor,
    numel: int,
    out: torch.Tensor | None = None,
    with_sum: bool = False,
    own: torch.Tensor | None = None,
    own_index: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Two-shot all-reduce middle step: received chunks -> (encoded fp32 sum, the sum or None).

    bufs: uint8, N chunks of codec.nbytes(numel) bytes laid out consecutively ([N * nbytes] or
    [N, nbytes]). Each chunk is decoded in fp32 (not rounded to the input dtype) and the terms are
    summed in fp32 in order, s = y_0 + y_1 + ..., where `own` (numel raw values of any float
    dtype, e.g. the local chunk that never went through the codec) is term number `own_index`;
    the sum is encoded once into `out` (codec.nbytes(numel) bytes).
    """
    size = codec.nbytes(numel)
    bufs = bufs.reshape(-1)
    if size == 0 or bufs.numel() % size:
        raise ValueError(f"{codec.spec}: {bufs.numel()} bytes is not a whole number of {size}-byte chunks")
    nchunks = bufs.numel() // size
    if own is not None and (own.numel() != numel or not 0 <= own_index <= nchunks):
        raise ValueError(f"own must hold {numel} values and 0 <= own_index <= {nchunks}")
    if nchunks + (own is not None) == 0:
        raise ValueError("decode_sum_encode needs at least one term")
    dev = bufs.device
    out = torch.empty(size, dtype=torch.uint8, device=dev) if out is None else out
    sum_out = torch.empty(numel, dtype=torch.float32, device=dev) if with_sum else None
    path = _path(codec, dev) if nchunks else "reference"
    if path == "compile":
        compiled.decode_sum_encode_wire(codec, bufs, nchunks, numel, out, sum_out, own, own_index)
    elif path == "triton":
        from . import triton_taco

        triton_taco.decode_sum_encode_wire(codec, bufs, nchunks, numel, out, sum_out, own, own_index)
    else:
        terms = [codec.decode(codec.wrap(bufs[k * size : (k + 1) * size], (numel,), torch.float32))
                 for k in range(nchunks)]  # fmt: skip
        if own is not None:
            terms.insert(own_index, own.reshape(-1).to(torch.float32))
        s = terms[0].clone()
        for y in terms[1:]:
            s += y
        codec.encode(s, out=out)
        if sum_out is not None:
            sum_out.copy_(s)
    return out, sum_out
