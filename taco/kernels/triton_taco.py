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
def _hadamard(x, R: tl.constexpr, G: tl.constexpr, HB: tl.constexpr, NSPLIT, DOT: tl.constexpr):
    """x [R, G] fp32 -> x @ H_G (unnormalised): exact products, fp32 accumulation. NSPLIT: bf16 parts
    of x (1, 2 or 3; a runtime value, so one kernel serves every input dtype)."""
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
def _rotate(x, sqrt_g, R: tl.constexpr, G: tl.constexpr, HB: tl.constexpr, NSPLIT,
            DOT: tl.constexpr):  # fmt: skip
    """x [R, G] -> x @ H_G / sqrt(G) (the reference's rounding: the exact product sums, then one division)."""
    return tl.div_rn(_hadamard(x, R, G, HB, NSPLIT, DOT), tl.full((R, G), 1.0, tl.float32) * sqrt_g)


@triton.jit
def _load_x(x_ptr, idx, n, IN):
    """Input tile as fp32, zero-padded beyond n, from the bytes at x_ptr. IN (a runtime value, so one
    kernel serves every dtype): 0 fp32, 1 bf16 (read as uint16 bits), 2 fp16."""
    if IN == 1:
        u = tl.load(x_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + idx, mask=idx < n, other=0)
        x = (u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif IN == 2:
        x = tl.load(x_ptr.to(tl.pointer_type(tl.float16), bitcast=True) + idx, mask=idx < n, other=0.0)
        x = x.to(tl.float32)
    else:
        x = tl.load(x_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + idx, mask=idx < n, other=0.0)
    return x


@triton.jit
def _store_y(y_ptr, idx, n, y, OUT):
    """fp32 tile -> the bytes at y_ptr, beyond n untouched. OUT (runtime, as IN): 0 fp32, 1 bf16
    (round-to-nearest-even bits), 2 fp16 (saturated: fp16 never overflows, finite_clamp; NaN stays)."""
    if OUT == 1:
        bits = _bf16_bits(_saturate(y, 3.3895313892515355e38)).to(tl.uint16, bitcast=True)  # bf16's largest
        tl.store(y_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + idx, bits, mask=idx < n)
    elif OUT == 2:
        y = tl.where(y < -65504.0, -65504.0, y)
        y = tl.where(y > 65504.0, 65504.0, y)
        tl.store(y_ptr.to(tl.pointer_type(tl.float16), bitcast=True) + idx, y.to(tl.float16), mask=idx < n)
    else:
        tl.store(y_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + idx, y, mask=idx < n)


@triton.jit
def _encode_tile(
    x, rows, ng, q_ptr, s0_ptr, s1_ptr, fmax, lam, target, qmax, sqrt_g,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, NSPLIT, DOT: tl.constexpr, BITS: tl.constexpr, SFMT: tl.constexpr,
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
        if PICK:  # the same with x D rotated; the kept one's scale carries the choice in its sign
            z2 = _rotate(_flip_signs(x, G, SIGNS), sqrt_g, R, G, HB, NSPLIT, DOT)
            z, w = _pick(z, z2, qmax, p, R, SFMT)
            r, s = _int_quant(z, qmax, p, R, G, SFMT, w)
        else:
            r, s = _int_quant(z, qmax, p, R, G, SFMT)
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
# Sizes, offsets, strides, the dtypes in and out (IN, OUT, OWN_IN, SUM_OUT, with NSPLIT) and the
# decode-sum-encode's SUM/ENC are runtime arguments, never specialized on (`_RUNTIME`; tensors are
# passed as their bytes), so one compiled kernel per codec serves every message length and dtype.
# Chunk c of a launch (grid axis 1) is chunk j = c, or c + 1 from `skip` on, of a progression:
# elements e0 + j * estride of the flat tensor, min(q, n_end - e) of them, encoded at byte
# c * bstride of the buffer (payload, then its scale words: `_chunk`).
_RUNTIME = ["e0", "estride", "skip", "bstride", "q", "n_end", "stride", "nterms", "own_index", "n", "ng",
            "IN", "NSPLIT", "OUT", "SUM", "SUM_OUT", "ENC", "OWN_IN"]


@triton.jit
def _chunk(e0, estride, skip, bstride, q, n_end, G: tl.constexpr, PB: tl.constexpr, SB: tl.constexpr):
    """(element offset, numel, groups, byte offset, scale-word offset) of this program's chunk."""
    c = tl.program_id(1)
    j = (c + (c >= skip).to(tl.int32)).to(tl.int64)
    e = tl.multiple_of(e0 + j * estride, G)  # chunks start on group boundaries (host-checked)
    n = tl.minimum(n_end - e, q)
    ng = ((n + (G - 1)) // G).to(tl.int32)
    bo = tl.multiple_of(c.to(tl.int64) * bstride, 16)
    return e, n, ng, bo, (bo + ng.to(tl.int64) * PB) // SB


@triton.jit(do_not_specialize=_RUNTIME)
def _encode_kernel(
    x_ptr, q_ptr, w_ptr, e0, estride, skip, bstride, q, n_end, fmax, lam, target, qmax, sqrt_g, IN, NSPLIT,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, DOT: tl.constexpr, BITS: tl.constexpr, SFMT: tl.constexpr, SIGNS: tl.constexpr,
    PICK: tl.constexpr, PB: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    e, n, ng, bo, so = _chunk(e0, estride, skip, bstride, q, n_end, G, PB, SB)
    xc, qc, s0 = x_ptr + e * tl.where(IN == 0, 4, 2), q_ptr + bo, w_ptr + so  # x_ptr: bytes
    # the tile loop once per input dtype, with it and the count of bf16 parts of the rotation's input
    # as constants: runtime branches inside the tile hold their registers at once (docs/design.md 1.3).
    # NSPLIT follows IN (bf16 1, fp16 2, fp32 3) but for taco (x * s_a: always 3). Integer codes take
    # fp16's two parts as three: the third is zeros, it can only turn a -0 sum into +0 (code 0 alike).
    NS_BF16: tl.constexpr = 1 + 2 * (KIND == 0)
    NS_FP16: tl.constexpr = 2 + (KIND != 1)
    if IN == 1:
        _encode_tiles(xc, qc, s0, n, ng, fmax, lam, target, qmax, sqrt_g, 1, NS_BF16,
                      KIND, ROTATE, FMT, G, HB, R, DOT, BITS, SFMT, SIGNS, PICK)  # fmt: skip
    elif IN == 2:
        _encode_tiles(xc, qc, s0, n, ng, fmax, lam, target, qmax, sqrt_g, 2, NS_FP16,
                      KIND, ROTATE, FMT, G, HB, R, DOT, BITS, SFMT, SIGNS, PICK)  # fmt: skip
    else:
        _encode_tiles(xc, qc, s0, n, ng, fmax, lam, target, qmax, sqrt_g, 0, 3,
                      KIND, ROTATE, FMT, G, HB, R, DOT, BITS, SFMT, SIGNS, PICK)  # fmt: skip


@triton.jit
def _encode_tiles(
    xc, qc, s0, n, ng, fmax, lam, target, qmax, sqrt_g, IN: tl.constexpr, NSPLIT: tl.constexpr,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, DOT: tl.constexpr, BITS: tl.constexpr, SFMT: tl.constexpr, SIGNS: tl.constexpr,
    PICK: tl.constexpr,
):  # fmt: skip
    """This program's tiles of a chunk: load, encode (xc: the chunk's input bytes, qc: its payload,
    s0: its scale words)."""
    for tile in range(tl.program_id(0), tl.cdiv(ng, R), tl.num_programs(0)):
        rows = tile * R + tl.arange(0, R)
        idx = rows[:, None].to(tl.int64) * G + tl.arange(0, G)[None, :]
        x = _load_x(xc, idx, n, IN)
        _encode_tile(x, rows, ng, qc, s0, s0 + ng, fmax, lam, target, qmax, sqrt_g,
                     KIND, ROTATE, FMT, G, HB, R, NSPLIT, DOT, BITS, SFMT, SIGNS, PICK)  # fmt: skip


@triton.jit(do_not_specialize=_RUNTIME)
def _decode_kernel(
    q_ptr, w_ptr, y_ptr, e0, estride, skip, bstride, q, n_end, sqrt_g, OUT,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, DOT: tl.constexpr, BITS: tl.constexpr, SFMT: tl.constexpr,
    SIGNS: tl.constexpr, PICK: tl.constexpr, PB: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    e, n, ng, bo, so = _chunk(e0, estride, skip, bstride, q, n_end, G, PB, SB)
    qc, s0, yc = q_ptr + bo, w_ptr + so, y_ptr + e * tl.where(OUT == 0, 4, 2)  # y_ptr: bytes
    for tile in range(tl.program_id(0), tl.cdiv(ng, R), tl.num_programs(0)):
        rows = tile * R + tl.arange(0, R)
        idx = rows[:, None].to(tl.int64) * G + tl.arange(0, G)[None, :]
        y = _decode_tile(qc, s0, s0 + ng, rows, ng, sqrt_g, KIND, ROTATE, FMT, G, HB, R, DOT, BITS, SFMT,
                         SIGNS, PICK)  # fmt: skip
        _store_y(yc, idx, n, y, OUT)


@triton.jit
def _add_term(acc, y, t):
    """Term t of the in-order sum: y_0, then acc + y_t."""
    return tl.where(t == 0, y, acc + y)


@triton.jit
def _peer(
    q_ptr, w_ptr, k, stride, so, rows, ng, idx, n, sqrt_g,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, DOT: tl.constexpr, BITS: tl.constexpr, SFMT: tl.constexpr, SIGNS: tl.constexpr,
    PICK: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    """Chunk k's groups `rows` decoded (payload at byte k * stride, scale words after its ng payloads),
    zero beyond n."""
    k = tl.cast(k, tl.int64)  # int64 byte offsets
    s0 = w_ptr + (k * stride) // SB + so
    y = _decode_tile(q_ptr + k * stride, s0, s0 + ng, rows, ng, sqrt_g,
                     KIND, ROTATE, FMT, G, HB, R, DOT, BITS, SFMT, SIGNS, PICK)  # fmt: skip
    return tl.where(idx < n, y, 0.0)


@triton.jit(do_not_specialize=_RUNTIME)
def _decode_sum_encode_kernel(
    q_ptr, w_ptr, stride, nterms, own_ptr, own_index, oq_ptr, ow_ptr, sum_ptr, n, ng,
    fmax, lam, target, qmax, sqrt_g, SUM, SUM_OUT, ENC, OWN_IN,
    KIND: tl.constexpr, ROTATE: tl.constexpr, FMT: tl.constexpr, G: tl.constexpr, HB: tl.constexpr,
    R: tl.constexpr, DOT: tl.constexpr, BITS: tl.constexpr, SFMT: tl.constexpr, SIGNS: tl.constexpr,
    PICK: tl.constexpr, PB: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    """Chunk k's payload at byte k * stride of q_ptr, its scale words at (k * stride + ng * PB) / SB of
    w_ptr (the same buffer); the re-encoded sum the same way at oq_ptr / ow_ptr (byte 0). own_ptr and
    sum_ptr: bytes, of the dtypes OWN_IN and SUM_OUT say; SUM, ENC: store the sum, encode it."""
    so = ng.to(tl.int64) * PB // SB
    for tile in range(tl.program_id(0), tl.cdiv(ng, R), tl.num_programs(0)):
        rows = tile * R + tl.arange(0, R)
        idx = rows[:, None].to(tl.int64) * G + tl.arange(0, G)[None, :]
        # s = y_0 + y_1 + ... in order; term own_index is the raw own tile (none: own_index = nterms).
        # One loop over the peers' chunks with no branch in its body (a runtime branch between the own
        # load and a decode, or a loop on each side of the own term, keeps the decode's invariants twice
        # and doubled the live registers): the own tile, loaded once, joins the sum just before peer
        # own_index (or after the last peer) by a select.
        own = _load_x(own_ptr, idx, n * (own_index < nterms).to(tl.int64), OWN_IN)  # zeros without one
        acc = tl.zeros((R, G), tl.float32)
        for j in range(nterms - 1 + (own_index >= nterms).to(tl.int32)):  # peer j is term t
            t = j + (j >= own_index).to(tl.int32)
            acc = tl.where(j == own_index, _add_term(acc, own, own_index), acc)
            y = _peer(q_ptr, w_ptr, j, stride, so, rows, ng, idx, n, sqrt_g,
                      KIND, ROTATE, FMT, G, HB, R, DOT, BITS, SFMT, SIGNS, PICK, SB)  # fmt: skip
            acc = _add_term(acc, y, t)
        acc = tl.where(own_index == nterms - 1, _add_term(acc, own, own_index), acc)
        if SUM:
            if SUM_OUT == 1:  # bf16: round to nearest even
                tl.store(sum_ptr.to(tl.pointer_type(tl.uint16), bitcast=True) + idx,
                         _bf16_bits(acc).to(tl.uint16, bitcast=True), mask=idx < n)  # fmt: skip
            elif SUM_OUT == 2:  # fp16: the plain collective's cast (inf beyond 65504)
                tl.store(sum_ptr.to(tl.pointer_type(tl.float16), bitcast=True) + idx, acc.to(tl.float16),
                         mask=idx < n)  # fmt: skip
            else:
                tl.store(sum_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + idx, acc, mask=idx < n)
        if ENC:
            os0 = ow_ptr + so
            _encode_tile(acc, rows, ng, oq_ptr, os0, os0 + ng, fmax, lam, target, qmax, sqrt_g,
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


TILE = int(os.environ.get("TACO_TRITON_TILE", "2048"))
"""elements per tile (R * G), read once at import"""
LAUNCH = {
    "encode": dict(num_warps=8, num_stages=1, maxnreg=128),
    "decode": dict(num_warps=8, num_stages=1, maxnreg=128),
    "decode_sum_encode": dict(num_warps=8, num_stages=1, maxnreg=168),
    "decode_sum_encode_int": dict(num_warps=16, num_stages=1),
}
"""launch options per kernel, from `benchmarks/kernel_resources.py --arch sm_90` (each variant
compiled for sm_90: registers and spills; docs/design.md 1.3). The rule: no variant spills and none
holds more than 168 registers. Eight warps on tiles of 2048 elements: a tile's values spread over
256 threads; encode and decode fit 128 without spilling (two CTAs of eight warps per SM), the
taco/FP8 decode-sum-encode 168 (one). One stage: the tile loop carries no loads worth prefetching
(each tile is read once) and more stages only hold registers and shared memory. The integer
codecs' decode-sum-encode runs sixteen warps (at most 128 registers, none spilled; at eight warps
capped to 168 it spills)."""


def _geometry(g: int) -> tuple[int, int]:
    """(HB, R): Hadamard block (<= 128) and groups per tile (R * G = TILE elements)."""
    hb = min(g, 128)
    return hb, max(TILE // g, 16 * hb // g, 1)


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(tiles: int, chunks: int, device: torch.device) -> tuple[int, int]:
    """Persistent launch, (programs per chunk, chunks): about 4 programs per SM in all (4 in the
    interpreter), each looping over its chunk's tiles."""
    if device.type != "cuda":
        return (max(1, min(tiles, 4)), chunks)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (max(1, min(tiles, -(-4 * _sm_count(index) // chunks))), chunks)


def _bytes(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A flat contiguous fp32/bf16/fp16 tensor as (its bytes, its dtype code: 0 fp32, 1 bf16, 2 fp16)."""
    return t.view(torch.uint8), _OUT[t.dtype]


Progression = tuple[int, int, int, int, int, int, int, int]
"""(k, e0, estride, skip, b0, bstride, q, n_end): chunk c = 0..k-1 holds the elements from
e = e0 + j * estride on (j = c, or c + 1 from `skip` on), min(q, n_end - e) of them, at byte
b0 + c * bstride."""


def progression(spans, g: int, nbytes) -> Progression | None:
    """The spans ((element offset, numel, byte offset) each) as one `Progression`, or None.

    What one launch serves: every chunk starts on a group boundary, chunks of q elements but the
    last (<= q) at a constant element stride with at most one position skipped (the own chunk of an
    all-to-all), at a constant byte stride, 16-byte aligned, none overlapping. Checked by rebuilding
    every span from the parameters (remembered per spans: a collective repeats the same ones)."""
    spans = tuple(spans)
    return _progression(spans, g, nbytes(spans[0][1]))


@functools.lru_cache(maxsize=1024)
def _progression(spans: tuple, g: int, qbytes: int) -> Progression | None:
    (e0, q, b0), k = spans[0], len(spans)
    if k == 1:
        est, skip, bst = 0, 1, 0
    else:
        steps = [spans[i + 1][0] - spans[i][0] for i in range(k - 1)]
        est, bst = min(steps), spans[1][2] - b0
        skip = next((i + 1 for i, d in enumerate(steps) if d != est), k)
    end = spans[-1][0] + spans[-1][1]
    if e0 % g or est % g or b0 % 16 or bst % 16 or (k > 1 and (est < q or bst < qbytes)):
        return None
    for i, (eo, n, bo) in enumerate(spans):
        e = e0 + (i + (i >= skip)) * est
        if (eo, n, bo) != (e, min(q, end - e), b0 + i * bst) or n < 1:
            return None
    return k, e0, est, skip, b0, bst, q, end


class _Spec:
    """Kernel parameters of one codec configuration (built once per codec: `of`)."""

    _cache: dict[str, _Spec] = {}

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
        self.pb, self.sb = g * bits // 8, _SCALE_DTYPE[sfmt].itemsize  # bytes per group's payload, scale
        self.sdtype = _SCALE_DTYPE[sfmt]
        self.dse_launch = "decode_sum_encode_int" if self.kind == 2 else "decode_sum_encode"  # LAUNCH
        self._consts = dict(
            KIND=self.kind, ROTATE=self.rotate, FMT=self.fmt, G=self.g, HB=self.hb, R=self.r, DOT=_DOT,
            BITS=self.bits, SFMT=self.sfmt, SIGNS=self.signs, PICK=self.pick, PB=self.pb, SB=self.sb,
        )  # fmt: skip

    @classmethod
    def of(cls, codec) -> _Spec:
        """The codec's spec, built once per `codec.spec` (which names every option)."""
        sp = cls._cache.get(codec.spec)
        if sp is None:
            sp = cls._cache[codec.spec] = cls._build(codec)
        return sp

    @classmethod
    def _build(cls, codec) -> _Spec:
        fam, g, sf = codec.family, codec.group_size, codec.scale_fmt
        if fam == "taco":
            return cls("taco", g, True, codec.fmt.dtype, codec.fmt.fmax, codec.lam, codec.target, sfmt=sf)
        if fam == "fp8":
            return cls("fp8", g, codec.rotate, codec.fmt.dtype, codec.fmt.fmax, sfmt=sf)
        signs = getattr(codec, "signs", False)
        return cls("int", g, codec.rotate, qmax=codec.qmax, bits=codec.bits, sfmt=sf, signs=signs)

    def consts(self) -> dict:
        return self._consts

    def words(self, buf: torch.Tensor) -> torch.Tensor:
        """uint8 `buf` (aligned to a scale word) read as scale words from its byte 0."""
        return buf[: buf.numel() // self.sb * self.sb].view(self.sdtype)

    def tiles(self, q: int) -> int:
        return -(-q // (self.g * self.r))

    def encode(self, x: torch.Tensor, buf: torch.Tensor, pr: Progression) -> None:
        """The chunks of flat x that `pr` names -> their wire bytes at their offsets of uint8 `buf`."""
        k, e0, est, skip, b0, bst, q, end = pr
        xb, in_code = _bytes(x)
        nsplit = 3 if self.kind == 0 else _NSPLIT[x.dtype]
        out = buf[b0:]
        _encode_kernel[_grid(self.tiles(q), k, x.device)](
            xb, out, self.words(out), e0, est, skip, bst, q, end, self.fmax, self.lam, self.target, self.qmax,
            self.sqrt_g, in_code, nsplit, **self._consts, **LAUNCH["encode"],
        )  # fmt: skip

    def decode(self, buf: torch.Tensor, y: torch.Tensor, pr: Progression) -> None:
        """The chunks of uint8 `buf` that `pr` names -> their elements of flat y (fp32/bf16/fp16)."""
        k, e0, est, skip, b0, bst, q, end = pr
        src = buf[b0:]
        _decode_kernel[_grid(self.tiles(q), k, y.device)](
            src, self.words(src), *_bytes(y)[:1], e0, est, skip, bst, q, end, self.sqrt_g, _OUT[y.dtype],
            **self._consts, **LAUNCH["decode"],
        )  # fmt: skip


# -- wire level (a GroupCodec's layout; see taco.kernels) ------------------------------------------
def _aligned(buf: torch.Tensor) -> bool:
    return buf.data_ptr() % 16 == 0


class TritonBackend(KernelBackend):
    """The Triton kernels: one launch per encode, decode or decode-sum-encode, and one per
    `encode_chunks`/`decode_chunks` whose chunks form a `progression` (docs/design.md 1.3)."""

    name = "triton"

    def supports(self, codec, device: torch.device) -> bool:
        return supports(codec, device)

    def encode(self, codec, x: torch.Tensor, out: torch.Tensor) -> None:
        dst = out if _aligned(out) else torch.empty_like(out)
        n = x.numel()
        _Spec.of(codec).encode(x.contiguous(), dst, (1, 0, 0, 1, 0, 0, n, n))
        if dst is not out:
            out.copy_(dst)

    def decode(self, codec, buf: torch.Tensor, y: torch.Tensor) -> None:
        buf = buf if _aligned(buf) else buf.clone()
        n = y.numel()
        _Spec.of(codec).decode(buf, y, (1, 0, 0, 1, 0, 0, n, n))

    def encode_chunks(self, codec, x: torch.Tensor, out: torch.Tensor, spans) -> None:
        pr = progression(spans, codec.group_size, codec.nbytes) if _aligned(out) else None
        if pr is None or not x.is_contiguous():
            return super().encode_chunks(codec, x, out, spans)
        _Spec.of(codec).encode(x, out, pr)

    def decode_chunks(self, codec, buf: torch.Tensor, y: torch.Tensor, spans) -> None:
        pr = progression(spans, codec.group_size, codec.nbytes) if _aligned(buf) else None
        if pr is None or not y.is_contiguous():
            return super().decode_chunks(codec, buf, y, spans)
        _Spec.of(codec).decode(buf, y, pr)

    def decode_sum_encode(self, codec, bufs, stride, nchunks, numel, own, own_index, out, sum_out) -> None:
        sp = _Spec.of(codec)
        if stride % 16 or not _aligned(bufs):  # chunk k's scale words are read at k * stride
            size = codec.nbytes(numel)  # (chunks of the collectives lie 16-byte aligned: no copy)
            step = -(-size // 16) * 16
            packed = torch.empty(step * nchunks, dtype=torch.uint8, device=bufs.device)
            for k in range(nchunks):
                packed[k * step : k * step + size].copy_(bufs[k * stride : k * stride + size])
            bufs, stride = packed, step
        dst = None if out is None else out if _aligned(out) else torch.empty_like(out)
        ng = codec.groups(numel)
        nterms = nchunks + (own is not None)
        # the tensors a variant does not use are stood for by `bufs` (never read or written)
        own_arg, own_in = (bufs, 0) if own is None else _bytes(own.contiguous())
        own_index = nterms if own is None else own_index
        sum_arg, sum_code = (bufs, 0) if sum_out is None else _bytes(sum_out)
        words = sp.words(bufs)
        oq, ow = (bufs, words) if dst is None else (dst, sp.words(dst))
        _decode_sum_encode_kernel[_grid(sp.tiles(numel), 1, bufs.device)](
            bufs, words, stride, nterms, own_arg, own_index, oq, ow, sum_arg, numel, ng,
            sp.fmax, sp.lam, sp.target, sp.qmax, sp.sqrt_g, int(sum_out is not None), sum_code,
            int(dst is not None), own_in, **sp.consts(), **LAUNCH[sp.dse_launch],
        )  # fmt: skip
        if dst is not None and dst is not out:
            out.copy_(dst)
