"""Bit-level formats of the Triton kernels: FP8 and bf16 casts, bit-packed INT2..INT8 codes and the
per-group scale formats (fp32, bf16, e8m0), all by integer bit operations.

Why a file of its own: `triton_taco.py` holds the codec math (scales, rotation, sums); this file
holds how values become wire bits, each helper the bit-exact twin of a torch reference
(`taco.codec.formats.pack_bits`, `taco.codec.scales`), so GPU and interpreter give the same bytes
(the interpreter's own bf16 casts truncate, and integer operations round nowhere).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fp8_bits(t, FMT: tl.constexpr):
    """Round-to-nearest-even FP8 bits (uint8) of fp32 t, |t| <= FMAX or NaN (NaN -> 0x7F | sign)."""
    MB: tl.constexpr = 3 if FMT == 0 else 2
    BIAS: tl.constexpr = 7 if FMT == 0 else 15
    SHIFT: tl.constexpr = 23 - MB
    INV_STEP: tl.constexpr = 512.0 if FMT == 0 else 65536.0  # 1 / the subnormal step
    u = t.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # subnormal grid: rint(|t| / step) by the 1.5 * 2^23 trick (exact: |t| / step < 2^MB)
    sub = (a.to(tl.float32, bitcast=True) * INV_STEP + 12582912.0).to(tl.uint32, bitcast=True) - 0x4B400000
    nrm = ((a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MB)
    code = tl.where(a < ((128 - BIAS) << 23), sub, nrm)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (sign | code).to(tl.uint8)


@triton.jit
def _fp8_value(b, FMT: tl.constexpr):
    """FP8 bits (uint8) -> exact fp32 values."""
    MB: tl.constexpr = 3 if FMT == 0 else 2
    BIAS: tl.constexpr = 7 if FMT == 0 else 15
    STEP: tl.constexpr = 0.001953125 if FMT == 0 else 1.52587890625e-05  # 2^-9, 2^-16
    a = b.to(tl.uint32) & 0x7F
    sub = a.to(tl.float32) * STEP
    nrm = ((a << (23 - MB)) + ((127 - BIAS) << 23)).to(tl.float32, bitcast=True)
    m = tl.where(a < (1 << MB), sub, nrm)
    if FMT == 1:
        m = tl.where(a == 0x7C, float("inf"), m)
        m = tl.where(a > 0x7C, float("nan"), m)
    else:
        m = tl.where(a == 0x7F, float("nan"), m)
    return tl.where(b.to(tl.uint32) >= 128, -m, m)


@triton.jit
def _bf16_bits(y):
    """fp32 -> bf16 bits (int16), round-to-nearest-even, NaN kept (the interpreter's cast truncates)."""
    u = y.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(y != y, (u >> 16) | 0x40, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


# -- bit-packed integer codes (formats.pack_bits: 8 codes in BITS bytes, LSB first) -----------------
@triton.jit
def _store_codes(q_ptr, rows, rmask, r, G: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr):
    """Integer codes r ([R, G] fp32 holding ints in [-qmax, qmax]) -> the payload of groups `rows`."""
    if BITS == 8:
        cols = tl.arange(0, G)
        code = r.to(tl.int8).to(tl.uint8, bitcast=True)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * G + cols[None, :], code, mask=rmask[:, None])
    else:
        j = tl.arange(0, 8)
        c = tl.reshape(r.to(tl.int32) & ((1 << BITS) - 1), (R, G // 8, 8)).to(tl.int64)
        w = tl.sum(c << (j * BITS).to(tl.int64)[None, None, :], axis=2)  # 8 codes, <= 56 bits
        byte = ((w[:, :, None] >> (j * 8).to(tl.int64)[None, None, :]) & 0xFF).to(tl.uint8)
        off = (rows[:, None, None].to(tl.int64) * (G * BITS // 8)
               + tl.arange(0, G // 8)[None, :, None] * BITS + j[None, None, :])  # fmt: skip
        tl.store(q_ptr + off, byte, mask=rmask[:, None, None] & (j < BITS)[None, None, :])


@triton.jit
def _load_codes(q_ptr, rows, rmask, G: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr):
    """The payload of groups `rows` -> signed integer codes as fp32 [R, G] (0 for masked rows)."""
    if BITS == 8:
        cols = tl.arange(0, G)
        b = tl.load(q_ptr + rows[:, None].to(tl.int64) * G + cols[None, :], mask=rmask[:, None], other=0)
        return b.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        j = tl.arange(0, 8)
        off = (rows[:, None, None].to(tl.int64) * (G * BITS // 8)
               + tl.arange(0, G // 8)[None, :, None] * BITS + j[None, None, :])  # fmt: skip
        m = rmask[:, None, None] & (j < BITS)[None, None, :]
        b = tl.load(q_ptr + off, mask=m, other=0).to(tl.int64)
        w = tl.sum(b << (j * 8).to(tl.int64)[None, None, :], axis=2)
        c = (w[:, :, None] >> (j * BITS).to(tl.int64)[None, None, :]) & ((1 << BITS) - 1)
        c = c - ((c >> (BITS - 1)) << BITS)  # sign-extend
        return tl.reshape(c.to(tl.float32), (R, G))


# -- per-group scales (taco.codec.scales): SFMT 0 fp32, 1 bf16, 2 e8m0 -------------------------------
@triton.jit
def _round_scale(s, SFMT: tl.constexpr):
    """fp32 scales (> 0 or NaN) -> the smallest value of the format >= s (capped at its largest)."""
    if SFMT == 0:
        return s
    u = s.to(tl.uint32, bitcast=True)
    if SFMT == 1:
        r = (u + 0xFFFF) & 0xFFFF0000
        r = tl.where(r > 0x7F7F0000, 0x7F7F0000, r)
        return tl.where(s != s, s, r.to(tl.float32, bitcast=True))
    return _e8m0_value(_e8m0_code(s))


@triton.jit
def _e8m0_code(s):
    """int32 exponent byte of the smallest power of two >= s, in [0, 254]; NaN -> 255."""
    u = s.to(tl.uint32, bitcast=True)
    e = ((u >> 23) & 0xFF).to(tl.int32)
    m = u & 0x7FFFFF
    b = tl.where(e == 0, (m > 0x400000).to(tl.int32), e + (m != 0).to(tl.int32))
    b = tl.where(b > 254, 254, b)
    return tl.where(s != s, 255, b)


@triton.jit
def _e8m0_value(b):
    """Exponent bytes (int32) -> exact fp32 2^(b - 127); 255 -> NaN."""
    bits = tl.where(b == 0, 0x400000, b << 23)
    v = bits.to(tl.float32, bitcast=True)
    return tl.where(b == 255, float("nan"), v)


@triton.jit
def _store_scale(ptr, rows, s, rmask, SFMT: tl.constexpr):
    """Scales already on the format's grid -> their wire words (fp32, int16 bf16 bits, uint8 byte)."""
    if SFMT == 0:
        tl.store(ptr + rows, s, mask=rmask)
    elif SFMT == 1:
        hi = (s.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
        tl.store(ptr + rows, hi, mask=rmask)
    else:
        tl.store(ptr + rows, _e8m0_code(s).to(tl.uint8), mask=rmask)


@triton.jit
def _load_scale(ptr, rows, rmask, SFMT: tl.constexpr):
    """Wire words of groups `rows` -> fp32 scales (1 for masked rows)."""
    if SFMT == 0:
        return tl.load(ptr + rows, mask=rmask, other=1.0)
    elif SFMT == 1:
        hi = tl.load(ptr + rows, mask=rmask, other=0x3F80).to(tl.uint16, bitcast=True)
        return (hi.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return _e8m0_value(tl.load(ptr + rows, mask=rmask, other=127).to(tl.int32))


@triton.jit
def _flip_signs(x, G: tl.constexpr, SIGNS: tl.constexpr):
    """x [R, G] times the randomized Hadamard's diagonal (hadamard.sign_flips): SIGNS = m =
    floor(log2(G) / 2) >= 1, D_i = (-1)^popcount((i mod 2^m) & ((i >> m) mod 2^m)), m <= 4. A flip is
    0 - x (exact; +0 for zeros, as the reference's sums)."""
    i = tl.arange(0, G)
    v = (i & ((1 << SIGNS) - 1)) & ((i >> SIGNS) & ((1 << SIGNS) - 1))
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return tl.where((v & 1)[None, :] == 1, 0.0 - x, x)
