"""Fused Triton kernels for the group codecs: encode, decode and decode-N + fp32 sum + re-encode.

Why fused: the eager reference makes ~15 passes over fp32 copies of the tensor; each kernel here
makes one pass from the input dtype straight to the wire layout `[q: ng*G*BITS/8][s_0 x ng][s_1]`
(BITS = 2..8 bit-packed integer codes, scales in fp32/bf16/e8m0: `triton_bits.py`; the per-group
scales, integer codes and the signs="auto" choice: `triton_quant.py`).
Imported lazily by `taco.kernels` (never at `import taco`), only where triton is importable.

Per tile of R groups (docs/design.md 1.1): load, stats, adaptive scale (taco), Walsh-Hadamard rotation,
max, scale, FP8/INT cast, store payload and scales. The rotation is a tensor-core `tl.dot` with the
Sylvester matrix (+-1, exact in bf16, generated in registers): fp32 operands are split exactly into
up to three bf16 parts (bf16 input: one part; fp16: two; fp32 or scaled: three) so every product is
exact and only the fp32 accumulation order differs from the reference's butterflies (the bound is
derived in docs/design.md 1.1, "Same bytes everywhere"). G = 256/512 use
H_G = H_{G/128} (x) H_128: one dot with H_128, then butterflies across the 128-blocks.
FP8 and bf16 casts are done with integer bit operations (round-to-nearest-even, saturating), so the
GPU and the interpreter (TRITON_INTERPRET=1, whose own bf16 casts truncate and whose bf16 dot is
unsupported: there the dot runs on the same exact parts in fp32) give the same bits. In the
interpreter that fp32 product is a per-row reduction rather than numpy's matmul, whose rounding
depends on a row's position in the tile (see `_dot`): a group's bytes depend on the group only.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from taco.codec.backend import KernelBackend
from taco.codec.scales import scale_bytes

from .triton_bits import (
    _bf16_bits,
    _flip_signs,
    _fp8_bits,
    _fp8_value,
    _load_codes,
    _load_scale,
    _round_scale,
    _store_codes,
    _store_scale,
)
from .triton_quant import (
    _absmax_scale,
    _decode_factor,
    _int_quant,
    _pick,
    _prescale,
    _saturate,
    _taco_scale,
    _wire_scale,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROWWISE = tl.constexpr(INTERPRET)  # see _dot
KIND = {"taco": 0, "fp8": 1, "int": 2}
_FP8 = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
_OUT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NSPLIT = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_SFMT = {"fp32": 0, "bf16": 1, "e8m0": 2}
_SCALE_DTYPE = {"fp32": torch.float32, "bf16": torch.int16, "e8m0": torch.uint8}


# -- device helpers -------------------------------------------------------------------------------
@triton.jit
def _trunc_bf16(x):
    """x rounded toward zero to bf16 precision, kept in fp32 (so x - result is exact)."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _sylvester(HB: tl.constexpr, DOT: tl.constexpr):
    """H_HB[i, j] = (-1)^popcount(i & j), built in registers."""
    i = tl.arange(0, HB)[:, None]
    j = tl.arange(0, HB)[None, :]
    v = i & j
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return (1 - 2 * (v & 1)).to(tl.float32).to(DOT)


@triton.jit
def _dot(a, h, acc, FIRST: tl.constexpr):
    """acc + a @ h (a @ h when FIRST) with fp32 accumulation, each row's sums in the same order.

    On the GPU that is tl.dot (every row goes through the same MMA sequence). The interpreter runs
    tl.dot through numpy's BLAS matmul, which rounds a row differently depending on its position in
    the tile, so a group's code would depend on its neighbours; there the sum over k is a plain
    reduction instead (the same per row wherever it sits; the products are exact either way).
    """
    if ROWWISE:
        p = tl.sum(a[:, :, None] * h[None, :, :], axis=1)
        return p if FIRST else acc + p
    elif FIRST:
        return tl.dot(a, h, out_dtype=tl.float32)
    else:
        return tl.dot(a, h, acc)


@triton.jit
def _hadamard(x, R: tl.constexpr, G: tl.constexpr, HB: tl.constexpr, NSPLIT: tl.constexpr, DOT: tl.constexpr):
    """x [R, G] fp32 -> x @ H_G (unnormalised): exact products, fp32 accumulation."""
    A: tl.constexpr = G // HB
    h = _sylvester(HB, DOT)
    xr = tl.reshape(x, (R * A, HB))
    hi = _trunc_bf16(xr)
    acc = _dot(hi.to(DOT), h, None, True)
    if NSPLIT >= 2:
        r = xr - hi
        mid = _trunc_bf16(r)
        acc = _dot(mid.to(DOT), h, acc, False)
        if NSPLIT >= 3:
            acc = _dot((r - mid).to(DOT), h, acc, False)
    if A == 2:  # H_2 (x) H_128: butterfly across the two 128-blocks
        y = tl.reshape(acc, (R, 2, HB))
        u, w = tl.split(tl.permute(y, (0, 2, 1)))
        acc = tl.permute(tl.join(u + w, u - w), (0, 2, 1))
    if A == 4:  # H_4 = H_2 (x) H_2 on the block index (a1, a0)
        y = tl.reshape(acc, (R, 2, 2, HB))
        u, w = tl.split(tl.permute(y, (0, 1, 3, 2)))
        y = tl.permute(tl.join(u + w, u - w), (0, 1, 3, 2))
        u, w = tl.split(tl.permute(y, (0, 2, 3, 1)))
        acc = tl.permute(tl.join(u + w, u - w), (0, 3, 1, 2))
    return tl.reshape(acc, (R, G))


@triton.jit
def _rotate(x, sqrt_g, R: tl.constexpr, G: tl.constexpr, HB: tl.constexpr, NSPLIT: tl.constexpr,
            DOT: tl.constexpr):  # fmt: skip
    """x [R, G] -> x @ H_G / sqrt(G) (the reference's rounding: the exact product sums, then one division)."""
    return tl.div_rn(_hadamard(x, R, G, HB, NSPLIT, DOT), tl.full((R, G), 1.0, tl.float32) * sqrt_g)


@triton.jit
def _load_x(x_ptr, idx, n, IN: tl.constexpr):
    """Input tile as fp32, zero-padded beyond n. IN: 0 fp32, 1 bf16 (given as int16 bits), 2 fp16."""
    if IN == 1:
        u = tl.load(x_ptr + idx, mask=idx < n, other=0).to(tl.uint16, bitcast=True)
        return (u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)


@triton.jit
def _encode_tile(
    x, rows, ng, q_ptr, s0_ptr, s1_ptr, fmax, lam, target, qmax, sqrt_g,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, NSPLIT: tl.constexpr, DOT: tl.constexpr, BITS: tl.constexpr, SFMT: tl.constexpr,
    SIGNS: tl.constexpr, PICK: tl.constexpr,
):  # fmt: skip
    """Encode a [R, G] fp32 tile of groups `rows` (docs/design.md 1.1 steps 1-4, or the one-scale codecs).
    PICK (intB-hadamard signs="auto"): both rotations, per group the one with the smaller scale (`_pick`)."""
    cols = tl.arange(0, G)
    rmask = rows < ng
    sa = tl.zeros((R,), tl.float32)
    if KIND == 0:  # s_a = clamp(FMAX / sqrt(mean(x^2) + lam), 1e-3, 1e3), as reciprocal * FMAX
        ms = tl.sum(x * x, axis=1) / G
        sa = tl.div_rn(tl.full((R,), 1.0, tl.float32), tl.sqrt_rn(ms + lam)) * fmax
        sa = tl.where(sa < 1e-3, 1e-3, sa)
        sa = tl.where(sa > 1e3, 1e3, sa)
        sa = _round_scale(sa, SFMT)
        x = x * sa[:, None]
    p = tl.full((R,), 1.0, tl.float32)
    if KIND != 0 and ROTATE:  # groups near fp32's max are rotated in a scaled domain (exact)
        p = _prescale(x, G)
        x = x * p[:, None]
    if SIGNS and not PICK:  # the randomized Hadamard: x D (exact)
        x = _flip_signs(x, G, SIGNS)
    z = _rotate(x, sqrt_g, R, G, HB, NSPLIT, DOT) if ROTATE else x
    if KIND == 2:
        r, s = _int_quant(z, qmax, p, R, G, SFMT)
        if PICK:  # the same with x D rotated; the kept one's scale carries the choice in its sign
            r2, s2 = _int_quant(_rotate(_flip_signs(x, G, SIGNS), sqrt_g, R, G, HB, NSPLIT, DOT),
                                qmax, p, R, G, SFMT)  # fmt: skip
            r, s = _pick(r, s, r2, s2)
        _store_codes(q_ptr, rows, rmask, r, G, R, BITS)
    else:
        if KIND == 0:
            s = _taco_scale(z, target, R, SFMT)
            sc = s
        else:
            s, sc = _wire_scale(_absmax_scale(z, fmax, R, SFMT), p, SFMT)
        t = tl.div_rn(z, sc[:, None] + tl.zeros((R, G), tl.float32))
        t = tl.where(t < -fmax, -fmax, t)
        t = tl.where(t > fmax, fmax, t)
        code = _fp8_bits(t, FMT)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * G + cols[None, :], code, mask=rmask[:, None])
    _store_scale(s0_ptr, rows, s, rmask, SFMT)
    if KIND == 0:
        _store_scale(s1_ptr, rows, sa, rmask, SFMT)


@triton.jit
def _decode_tile(
    q_ptr, s0_ptr, s1_ptr, rows, ng, sqrt_g,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, DOT: tl.constexpr, BITS: tl.constexpr, SFMT: tl.constexpr, SIGNS: tl.constexpr,
    PICK: tl.constexpr,
):  # fmt: skip
    """Decode the groups `rows` to a [R, G] fp32 tile (docs/design.md 1.1 step 5). PICK: the groups
    with a negative scale were rotated as x D, so decode with |s| and flip them after the rotation."""
    cols = tl.arange(0, G)
    rmask = rows < ng
    if KIND == 2:
        v = _load_codes(q_ptr, rows, rmask, G, R, BITS)
    else:
        b = tl.load(q_ptr + rows[:, None].to(tl.int64) * G + cols[None, :], mask=rmask[:, None], other=0)
        v = _fp8_value(b, FMT)
    s = _load_scale(s0_ptr, rows, rmask, SFMT)
    if PICK:
        flip = s < 0
        s = tl.abs(s)
    d = _decode_factor(s, G) if KIND != 0 else tl.full((R,), 1.0, tl.float32)
    s = s * d  # big scales: decoded in a scaled domain (exact)
    if ROTATE:  # (q @ H) * s: the codes are exact in bf16, one dot
        y = tl.div_rn(_hadamard(v, R, G, HB, 1, DOT) * s[:, None], tl.full((R, G), 1.0, tl.float32) * sqrt_g)
    else:
        y = v * s[:, None]
    if PICK:
        y = tl.where(flip[:, None], _flip_signs(y, G, SIGNS), y)
    elif SIGNS:
        y = _flip_signs(y, G, SIGNS)
    if KIND == 0:
        sa = _load_scale(s1_ptr, rows, rmask, SFMT)
        y = tl.div_rn(y, sa[:, None] + tl.zeros((R, G), tl.float32))
    else:
        y = y * tl.div_rn(tl.full((R,), 1.0, tl.float32), d)[:, None]
    return _saturate(y, 3.4028234663852886e38)  # finite_clamp: fp32's largest


# -- kernels --------------------------------------------------------------------------------------
@triton.jit
def _encode_kernel(
    x_ptr, q_ptr, s0_ptr, s1_ptr, n, ng, fmax, lam, target, qmax, sqrt_g,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, NSPLIT: tl.constexpr, DOT: tl.constexpr, IN: tl.constexpr, BITS: tl.constexpr,
    SFMT: tl.constexpr, SIGNS: tl.constexpr, PICK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    for tile in range(pid, tl.cdiv(ng, R), tl.num_programs(0)):
        rows = tile * R + tl.arange(0, R)
        idx = rows[:, None].to(tl.int64) * G + tl.arange(0, G)[None, :]
        x = _load_x(x_ptr, idx, n, IN)
        _encode_tile(x, rows, ng, q_ptr, s0_ptr, s1_ptr, fmax, lam, target, qmax, sqrt_g,
                     KIND, ROTATE, FMT, G, HB, R, NSPLIT, DOT, BITS, SFMT, SIGNS, PICK)  # fmt: skip


@triton.jit
def _decode_kernel(
    q_ptr, s0_ptr, s1_ptr, y_ptr, n, ng, sqrt_g,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, DOT: tl.constexpr, OUT: tl.constexpr, BITS: tl.constexpr, SFMT: tl.constexpr,
    SIGNS: tl.constexpr, PICK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    for tile in range(pid, tl.cdiv(ng, R), tl.num_programs(0)):
        rows = tile * R + tl.arange(0, R)
        idx = rows[:, None].to(tl.int64) * G + tl.arange(0, G)[None, :]
        y = _decode_tile(
            q_ptr, s0_ptr, s1_ptr, rows, ng, sqrt_g, KIND, ROTATE, FMT, G, HB, R, DOT, BITS, SFMT, SIGNS, PICK
        )
        if OUT == 1:
            tl.store(y_ptr + idx, _bf16_bits(_saturate(y, 3.3895313892515355e38)), mask=idx < n)
        elif OUT == 2:  # fp16 never overflows (finite_clamp); NaN stays NaN
            y = tl.where(y < -65504.0, -65504.0, y)
            y = tl.where(y > 65504.0, 65504.0, y)
            tl.store(y_ptr + idx, y.to(tl.float16), mask=idx < n)
        else:
            tl.store(y_ptr + idx, y, mask=idx < n)


@triton.jit
def _decode_sum_encode_kernel(
    q_ptr, s0_ptr, s1_ptr, q_stride, s_stride, nterms, own_ptr, own_index,
    oq_ptr, os0_ptr, os1_ptr, sum_ptr, n, ng, fmax, lam, target, qmax, sqrt_g,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, DOT: tl.constexpr, SUM: tl.constexpr, SUM_OUT: tl.constexpr, ENC: tl.constexpr,
    OWN_IN: tl.constexpr, BITS: tl.constexpr, SFMT: tl.constexpr, SIGNS: tl.constexpr, PICK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    for tile in range(pid, tl.cdiv(ng, R), tl.num_programs(0)):
        rows = tile * R + tl.arange(0, R)
        idx = rows[:, None].to(tl.int64) * G + tl.arange(0, G)[None, :]
        acc = tl.zeros((R, G), tl.float32)
        for t in range(nterms):  # s = y_0 + y_1 + ... in order; term own_index is the raw own tile
            if t == own_index:
                y = _load_x(own_ptr, idx, n, OWN_IN)
            else:
                k = (t - (t > own_index).to(tl.int32)).to(tl.int64)  # chunk index; int64 byte offsets
                y = _decode_tile(q_ptr + k * q_stride, s0_ptr + k * s_stride, s1_ptr + k * s_stride, rows, ng,
                                 sqrt_g, KIND, ROTATE, FMT, G, HB, R, DOT, BITS, SFMT, SIGNS,
                                 PICK)  # fmt: skip
            y = tl.where(idx < n, y, 0.0)
            acc = tl.where(t == 0, y, acc + y)
        if SUM:
            if SUM_OUT == 1:
                tl.store(sum_ptr + idx, _bf16_bits(acc), mask=idx < n)
            elif SUM_OUT == 2:
                tl.store(sum_ptr + idx, acc.to(tl.float16), mask=idx < n)
            else:
                tl.store(sum_ptr + idx, acc, mask=idx < n)
        if ENC:
            _encode_tile(acc, rows, ng, oq_ptr, os0_ptr, os1_ptr, fmax, lam, target, qmax, sqrt_g,
                         KIND, ROTATE, FMT, G, HB, R, 3, DOT, BITS, SFMT, SIGNS, PICK)  # fmt: skip


# -- host side ------------------------------------------------------------------------------------
_DOT = tl.float32 if INTERPRET else tl.bfloat16


def runs_here(t: torch.Tensor) -> bool:
    """Triton serves CUDA tensors, and CPU tensors under TRITON_INTERPRET=1."""
    return t.device.type == "cuda" or (INTERPRET and t.device.type == "cpu")


def supports(codec, device: torch.device) -> bool:
    """Whether the wire-level kernels handle this codec on `device` (FP8 or 2..8-bit integer codes,
    fp32/bf16/e8m0 scales, G <= 512; intB-hadamard with signs False, True or "auto")."""
    ok_dev = device.type == "cuda" or (INTERPRET and device.type == "cpu")
    fam = getattr(codec, "family", None)
    ok = fam in KIND and (codec.bits == 8 or (fam == "int" and 2 <= codec.bits <= 8))
    return ok_dev and ok and getattr(codec, "scale_fmt", "fp32") in _SFMT and codec.group_size <= 512


def _geometry(g: int) -> tuple[int, int]:
    """(HB, R): Hadamard block (<= 128) and groups per tile (R * G = TACO_TRITON_TILE elements)."""
    hb = min(g, 128)
    r = max(int(os.environ.get("TACO_TRITON_TILE", "4096")) // g, 16 * hb // g, 1)
    return hb, r


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(ng: int, r: int, device: torch.device) -> tuple[int]:
    """Persistent launch: at most 4 programs per SM (4 in the interpreter), each looping over tiles."""
    tiles = triton.cdiv(ng, r)
    if device.type != "cuda":
        return (max(1, min(tiles, 4)),)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (max(1, min(tiles, 4 * _sm_count(index))),)


def _x_arg(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), 1
    return x, (2 if x.dtype == torch.float16 else 0)


def _y_arg(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int16) if y.dtype == torch.bfloat16 else y


class _Spec:
    """Kernel parameters of one codec configuration."""

    def __init__(
        self, kind: str, g: int, rotate: bool, fp8=None, fmax=0.0, lam=0.0, target=1.0, qmax=0.0,
        bits: int = 8, sfmt: str = "fp32", signs: bool | str = False,
    ):  # fmt: skip
        self.kind, self.g, self.rotate = KIND[kind], g, bool(rotate)
        self.signs = (g.bit_length() - 1) // 2 if signs and rotate else 0  # SIGNS: m of sign_flips
        self.pick = signs == "auto" and self.signs > 0  # PICK: per group plain or x D (int_encode flips)
        self.bits, self.sfmt = bits, _SFMT[sfmt]
        self.fmt = _FP8.get(fp8, 0)
        self.fmax, self.lam, self.target, self.qmax = float(fmax), float(lam), float(target), float(qmax)
        self.hb, self.r = _geometry(g)
        self.sqrt_g = math.sqrt(g)

    @classmethod
    def of(cls, codec) -> _Spec:
        fam, g, sf = codec.family, codec.group_size, codec.scale_fmt
        if fam == "taco":
            return cls("taco", g, True, codec.fmt.dtype, codec.fmt.fmax, codec.lam, codec.target, sfmt=sf)
        if fam == "fp8":
            return cls("fp8", g, codec.rotate, codec.fmt.dtype, codec.fmt.fmax, sfmt=sf)
        signs = getattr(codec, "signs", False)
        return cls("int", g, codec.rotate, qmax=codec.qmax, bits=codec.bits, sfmt=sf, signs=signs)

    def consts(self) -> dict:
        return dict(
            KIND=self.kind, ROTATE=self.rotate, FMT=self.fmt, G=self.g, HB=self.hb, R=self.r, DOT=_DOT,
            BITS=self.bits, SFMT=self.sfmt, SIGNS=self.signs, PICK=self.pick,
        )  # fmt: skip

    def encode(self, x: torch.Tensor, q: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor | None) -> None:
        """x: flat input (n elements) -> q (uint8 view, ng*G), s0/s1 (fp32, ng) on the same device."""
        n, ng = x.numel(), triton.cdiv(x.numel(), self.g)
        xa, in_code = _x_arg(x)
        nsplit = 3 if self.kind == 0 else _NSPLIT[x.dtype]
        _encode_kernel[_grid(ng, self.r, x.device)](
            xa, q, s0, s0 if s1 is None else s1, n, ng, self.fmax, self.lam, self.target, self.qmax,
            self.sqrt_g, NSPLIT=nsplit, IN=in_code, **self.consts(),
        )  # fmt: skip

    def decode(self, q: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor | None, y: torch.Tensor) -> None:
        """q, s0, s1 of ng groups -> the first y.numel() values into flat y (fp32/bf16/fp16)."""
        ng = s0.numel()
        _decode_kernel[_grid(ng, self.r, y.device)](
            q, s0, s0 if s1 is None else s1, _y_arg(y), y.numel(), ng, self.sqrt_g,
            OUT=_OUT[y.dtype], **self.consts(),
        )  # fmt: skip


# -- wire level (a GroupCodec's layout; see taco.kernels) ------------------------------------------
def _aligned(buf: torch.Tensor) -> bool:
    return buf.data_ptr() % 16 == 0


def _views(codec, buf: torch.Tensor, ng: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(payload uint8, s_0, s_1 or None) views of one 16-byte-aligned chunk; the scales as fp32,
    int16 (bf16 bits) or uint8 (e8m0) words. The payload, ng * G * BITS / 8 bytes, is a multiple
    of 4 (G >= 32), so every scale word is aligned."""
    p, sb = ng * codec.group_size * codec.bits // 8, codec.scale_bytes
    f = buf[p : p + sb * ng * codec.n_scales].view(_SCALE_DTYPE[codec.scale_fmt])
    return buf[:p], f[:ng], (f[ng : 2 * ng] if codec.n_scales == 2 else None)


class TritonBackend(KernelBackend):
    """The Triton kernels: one launch per encode, decode or decode-sum-encode (docs/design.md 1.3)."""

    name = "triton"

    def supports(self, codec, device: torch.device) -> bool:
        return supports(codec, device)

    def encode(self, codec, x: torch.Tensor, out: torch.Tensor) -> None:
        dst = out if _aligned(out) else torch.empty_like(out)
        _Spec.of(codec).encode(x.contiguous(), *_views(codec, dst, codec.groups(x.numel())))
        if dst is not out:
            out.copy_(dst)

    def decode(self, codec, buf: torch.Tensor, y: torch.Tensor) -> None:
        buf = buf if _aligned(buf) else buf.clone()
        _Spec.of(codec).decode(*_views(codec, buf, codec.groups(y.numel())), y)

    def decode_sum_encode(self, codec, bufs, stride, nchunks, numel, own, own_index, out, sum_out) -> None:
        sp = _Spec.of(codec)
        if stride % 4 or not _aligned(bufs):  # chunk k's scales are read as fp32 at k * stride
            size = codec.nbytes(numel)
            bufs = torch.cat([bufs[k * stride : k * stride + size] for k in range(nchunks)])
            stride = size
        dst = None if out is None else out if _aligned(out) else torch.empty_like(out)
        ng = codec.groups(numel)
        q, s0, s1 = _views(codec, bufs, ng)
        oq, os0, os1 = (q, s0, s1) if dst is None else _views(codec, dst, ng)
        nterms = nchunks + (own is not None)
        if own is None:
            own_arg, own_in, own_index = s0, 0, nterms  # never reached
        else:
            own_arg, own_in = _x_arg(own.contiguous())
        sum_arg = s0 if sum_out is None else _y_arg(sum_out)
        _decode_sum_encode_kernel[_grid(ng, sp.r, bufs.device)](
            q, s0, s0 if s1 is None else s1, stride, stride // scale_bytes(codec.scale_fmt), nterms, own_arg,
            own_index,
            oq, os0, os0 if os1 is None else os1, sum_arg,
            numel, ng, sp.fmax, sp.lam, sp.target, sp.qmax, sp.sqrt_g,
            SUM=sum_out is not None, SUM_OUT=0 if sum_out is None else _OUT[sum_out.dtype],
            ENC=dst is not None, OWN_IN=own_in, **sp.consts(),
        )  # fmt: skip
        if dst is not None and dst is not out:
            out.copy_(dst)
