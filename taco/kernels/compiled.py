"""The "compile" backend: the codec families on the CPU through one fused native pass per group.

Two levels of entry points, both with the reference's semantics (`taco.codec.functional`):
- registry level, the exact signatures of the functional pairs on [ng, G] fp32 groups
  (`taco_encode`, `fp8_decode`, ...), registered as backend "compile" by `taco.kernels`;
- wire level (`encode_wire`, `decode_wire`, `decode_sum_encode_wire`): any float dtype in, the
  codec's wire layout `[payload][scale_0 x ng][scale_1 x ng]` out, with no fp32 copy, no padding
  copy and no scale copies (scales are written unaligned-safe, so `out` may start at any byte).
Every function falls back to the eager reference when the native library is unavailable, the
tensor is not on the CPU, or the rotation matrix is not the codec's own Sylvester matrix.
"""

from __future__ import annotations

import ctypes

import torch

from taco.codec import functional as Fn
from taco.codec.hadamard import hadamard_matrix

from . import native


def _lib(*tensors: torch.Tensor | None) -> ctypes.CDLL | None:
    if any(t is not None and t.device.type != "cpu" for t in tensors):
        return None
    return native.library()


def _is_sylvester(h: torch.Tensor | None, g: int) -> bool:
    return h is None or (h.shape == (g, g) and 8 <= g <= 512 and h is hadamard_matrix(g, h.device))


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


# -- registry level ([ng, G] fp32 groups, the functional signatures) ------------------------------
def taco_encode(xg: torch.Tensor, h: torch.Tensor, fp8: torch.dtype, fmax: float, lam: float, target: float):
    lib = _lib(xg, h)
    ng, g = xg.shape
    if lib is None or not _is_sylvester(h, g) or h is None:
        return Fn.taco_encode(xg, h, fp8, fmax, lam, target)
    xg = xg.float().contiguous()
    c = native.cfg("taco", g, True, fp8, fmax, lam, target)
    dev = xg.device  # the native kernels run on CPU tensors only; explicit, whatever the default device
    q = torch.empty(ng, g, dtype=torch.uint8, device=dev)
    s_q, s_a = torch.empty(ng, 1, device=dev), torch.empty(ng, 1, device=dev)
    lib.taco_encode(c, _ptr(xg), 0, xg.numel(), _ptr(q), _ptr(s_q), _ptr(s_a), native.num_threads())
    return q, s_q, s_a


def taco_decode(q: torch.Tensor, s_q: torch.Tensor, s_a: torch.Tensor, h: torch.Tensor, fp8: torch.dtype):
    lib = _lib(q, h)
    ng, g = q.shape
    if lib is None or not _is_sylvester(h, g) or h is None:
        return Fn.taco_decode(q, s_q, s_a, h, fp8)
    q, s_q, s_a = q.contiguous(), s_q.float().contiguous(), s_a.float().contiguous()
    y = torch.empty(ng, g, device=q.device)
    c = native.cfg("taco", g, True, fp8)
    lib.taco_decode(c, _ptr(q), _ptr(s_q), _ptr(s_a), y.numel(), _ptr(y), 0, native.num_threads())
    return y


def fp8_encode(xg: torch.Tensor, h: torch.Tensor | None, fp8: torch.dtype, fmax: float):
    lib = _lib(xg, h)
    ng, g = xg.shape
    if lib is None or not _is_sylvester(h, g) or g % 8:
        return Fn.fp8_encode(xg, h, fp8, fmax)
    xg = xg.float().contiguous()
    c = native.cfg("fp8", g, h is not None, fp8, fmax)
    q, s = torch.empty(ng, g, dtype=torch.uint8, device=xg.device), torch.empty(ng, 1, device=xg.device)
    lib.taco_encode(c, _ptr(xg), 0, xg.numel(), _ptr(q), _ptr(s), None, native.num_threads())
    return q, s


def fp8_decode(q: torch.Tensor, s: torch.Tensor, h: torch.Tensor | None, fp8: torch.dtype):
    lib = _lib(q, h)
    ng, g = q.shape
    if lib is None or not _is_sylvester(h, g) or g % 8:
        return Fn.fp8_decode(q, s, h, fp8)
    q, s = q.contiguous(), s.float().contiguous()
    y = torch.empty(ng, g, device=q.device)
    c = native.cfg("fp8", g, h is not None, fp8)
    lib.taco_decode(c, _ptr(q), _ptr(s), None, y.numel(), _ptr(y), 0, native.num_threads())
    return y


def int_encode(xg: torch.Tensor, h: torch.Tensor | None, qmax: int):
    lib = _lib(xg, h)
    ng, g = xg.shape
    if lib is None or not _is_sylvester(h, g) or g % 8 or not 0 < qmax <= 127:
        return Fn.int_encode(xg, h, qmax)
    xg = xg.float().contiguous()
    c = native.cfg("int", g, h is not None, qmax=float(qmax))
    q, s = torch.empty(ng, g, dtype=torch.int8, device=xg.device), torch.empty(ng, 1, device=xg.device)
    lib.taco_encode(c, _ptr(xg), 0, xg.numel(), _ptr(q), _ptr(s), None, native.num_threads())
    return q, s


def int_decode(q: torch.Tensor, s: torch.Tensor, h: torch.Tensor | None):
    lib = _lib(q, h)
    ng, g = q.shape
    if lib is None or not _is_sylvester(h, g) or g % 8 or q.dtype != torch.int8:
        return Fn.int_decode(q, s, h)
    q, s = q.contiguous(), s.float().contiguous()
    y = torch.empty(ng, g, device=q.device)
    c = native.cfg("int", g, h is not None)
    lib.taco_decode(c, _ptr(q), _ptr(s), None, y.numel(), _ptr(y), 0, native.num_threads())
    return y


# -- wire level (a GroupCodec's layout; flat tensors in the codec's grouping order) --------------
def codec_cfg(codec) -> native.Cfg:
    """The C configuration of a GroupCodec instance (taco, taco-1s, fp8-group, int*)."""
    fam, g = codec.family, codec.group_size
    if fam == "taco":
        return native.cfg("taco", g, True, codec.fmt.dtype, codec.fmt.fmax, codec.lam, codec.target)
    if fam == "fp8":
        return native.cfg("fp8", g, codec.rotate, codec.fmt.dtype, codec.fmt.fmax)
    return native.cfg("int", g, codec.rotate, qmax=float(codec.qmax), bits=codec.bits)


def _offsets(codec, base: int, ng: int) -> tuple[int, int, int | None]:
    """Addresses of payload, scale 0 and scale 1 (None) of one chunk starting at `base`."""
    p = ng * codec.group_size * codec.bits // 8
    return base, base + p, (base + p + 4 * ng if codec.n_scales == 2 else None)


def supports(codec, *tensors: torch.Tensor | None) -> bool:
    """Whether the wire-level native path handles this codec and these (CPU) tensors."""
    return getattr(codec, "family", None) in ("taco", "fp8", "int") and _lib(*tensors) is not None


def encode_wire(codec, x: torch.Tensor, out: torch.Tensor) -> None:
    """Encode flat `x` (fp32/bf16/fp16, contiguous, CPU) into `out` (uint8, codec.nbytes(n) bytes)."""
    lib = _lib(x, out)
    x = x.contiguous()
    ng = codec.groups(x.numel())
    q, s0, s1 = _offsets(codec, _ptr(out), ng)
    lib.taco_encode(
        codec_cfg(codec), _ptr(x), native.DTYPE[x.dtype], x.numel(), q, s0, s1, native.num_threads()
    )


def decode_wire(codec, buf: torch.Tensor, numel: int, dtype: torch.dtype, out: torch.Tensor | None = None):
    """Decode one chunk of `numel` elements into a new (or the given) flat tensor of `dtype`."""
    lib = _lib(buf)
    y = torch.empty(numel, dtype=dtype, device=buf.device) if out is None else out
    q, s0, s1 = _offsets(codec, _ptr(buf), codec.groups(numel))
    lib.taco_decode(codec_cfg(codec), q, s0, s1, numel, _ptr(y), native.DTYPE[dtype], native.num_threads())
    return y


def decode_sum_encode_wire(
    codec,
    bufs: torch.Tensor,
    nchunks: int,
    numel: int,
    out: torch.Tensor,
    sum_out: torch.Tensor | None,
    own: torch.Tensor | None = None,
    own_index: int = 0,
) -> None:
    """N consecutive chunks in `bufs` (+ raw `own` as term own_index) -> fp32 sum in order -> `out`."""
    lib = _lib(bufs, out, own)
    ng = codec.groups(numel)
    stride = codec.nbytes(numel)
    q, s0, s1 = _offsets(codec, _ptr(bufs), ng)
    oq, os0, os1 = _offsets(codec, _ptr(out), ng)
    sp = None if sum_out is None else _ptr(sum_out)
    if own is not None:
        own = own.contiguous()
    op, odt = (None, 0) if own is None else (_ptr(own), native.DTYPE[own.dtype])
    lib.taco_decode_sum_encode(
        codec_cfg(codec), nchunks, stride, q, s0, s1, numel, op, odt, own_index, oq, os0, os1, sp,
        native.num_threads(),
    )  # fmt: skip
