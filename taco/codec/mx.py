"""The hardware block formats as codecs: OCP MX v1.0 (MXFP8, MXFP6, MXFP4) and NVIDIA's NVFP4.

These are the formats a user can already move activations in (docs/design.md 1.2): the bar every
project codec is measured against at equal bytes, and a choice of their own when the consumer GEMM
takes MX or NVFP4 inputs.

| name        | element           | block | scale                              | bytes/elem      |
|-------------|-------------------|-------|------------------------------------|-----------------|
| mxfp8-e4m3  | FP8 E4M3          | 32    | E8M0                               | 33/32 = 1.03125 |
| mxfp8-e5m2  | FP8 E5M2          | 32    | E8M0                               | 1.03125         |
| mxfp6-e2m3  | FP6 E2M3          | 32    | E8M0                               | 25/32 = 0.78125 |
| mxfp6-e3m2  | FP6 E3M2          | 32    | E8M0                               | 0.78125         |
| mxfp4       | FP4 E2M1          | 32    | E8M0                               | 17/32 = 0.53125 |
| nvfp4       | FP4 E2M1          | 16    | E4M3, times one fp32 per message   | 9/16 + 4/n      |

MX scale rules (`scale_rule`): "floor", the spec's: X = 2^(floor(log2 amax) - emax_elem), values
above the element's largest magnitude saturate (up to ~2% of elements on real tensors); "rceil",
cuBLAS/Transformer Engine's: X = amax / fmax rounded up to a power of two, so nothing saturates.
E8M0 byte b is 2^(b - 127), 255 = NaN. NVFP4 (`per_tensor=True`, the two-level layout): a
per-message fp32 scale S = amax / (6 * 448) and per block an E4M3 scale RNE(amax_b / 6 / S), clamped
to [2^-6, 448]; elements are x / (S * s_b) cast to E2M1; `per_tensor=False` is the single-level
variant (s_b = E4M3(amax_b / 6)), which flushes blocks below 6 * 2^-6 to zero.
`hadamard=True` rotates each block by the normalised Hadamard matrix of its size before quantizing.

Wire layouts: MX, `[elements: n_b * 32 * bits / 8][E8M0: n_b]`; NVFP4, `[S: fp32][elements: n_b * 8]
[E4M3: n_b]`. Elements are packed LSB first (`formats.pack_bits`: FP6 4 values in 3 bytes, FP4 the
low nibble first), the tail zero-padded to a whole block.

The pure-function-of-the-group rule (docs/design.md 4): MX codes are a function of the block alone.
NVFP4's per-tensor scale makes a block's code depend on its whole message: S is computed per encoded
chunk and travels in that chunk's header, so a message encodes to the same bytes wherever and
however often it is encoded (recompute included), and the collectives treat it like any per-tensor
codec: chunked per destination rank, never sliced. Its codes do depend on how a collective cuts the
tensor into per-rank chunks.

Where these differ from torchao's reference (bit-identical elsewhere, tests/codec/test_codec_mx.py):
non-finite blocks get a NaN scale (torchao turns an Inf into the element's largest value); a block
whose E8M0 scale is 2^-127 is quantized and decoded with 2^-127 (torchao uses 2^-126 or 1.0 there, on
blocks whose absmax is below ~2^-119); the "rceil" exponent is computed from the bits (exact), not
through a float log2.
"""

from __future__ import annotations

import math

import torch

from .base import AxisGrouped, Codec, f32_view, finite_clamp
from .formats import pack_bits, unpack_bits
from .hadamard import hadamard_matrix
from .minifloat import ELEMENT_FORMATS, ElementFormat, from_codes, to_codes

SCALE_RULES = ("floor", "rceil")
S_MIN = 2.0**-120  # NVFP4's smallest message scale: 1 / (S_MIN * E4M3_TINY) = 2^126
E4M3_TINY = 2.0**-6  # E4M3's smallest normal: NVFP4's smallest block scale
NVFP4_RANGE = 6.0 * 448.0  # E2M1 max times E4M3 max


def e8m0_value(b: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (int32, 0..255) -> exact fp32 2^(b - 127) (2^-127 a subnormal, 255 NaN)."""
    v = torch.where(b == 0, torch.full_like(b, 0x400000), b << 23).view(torch.float32)
    return torch.where(b == 255, torch.full_like(v, math.nan), v)


def _exponent(a: torch.Tensor) -> torch.Tensor:
    """Biased fp32 exponent field of non-negative `a` (int32)."""
    return (a.contiguous().view(torch.int32) >> 23) & 0xFF


def e8m0_scale(amax: torch.Tensor, elem: ElementFormat, rule: str) -> torch.Tensor:
    """Blocks' absmax (fp32) -> E8M0 scale bytes (int32): "floor" per OCP MX v1.0 section 6.3,
    "rceil" the smallest power of two >= amax / fmax; 255 (NaN) for non-finite blocks."""
    if rule == "floor":
        b = (_exponent(amax) - 127 - elem.emax).clamp(-127, 127) + 127
    else:
        d = (amax / elem.fmax).contiguous()
        e, m = _exponent(d), d.view(torch.int32) & 0x7FFFFF
        # subnormal d: 2^-127 holds it when d <= 2^-127 (mantissa <= 0x400000), else 2^-126
        b = torch.where(e == 0, (m > 0x400000).to(torch.int32), e + (m != 0).to(torch.int32))
        b = b.clamp(0, 254)
    return torch.where(torch.isfinite(amax), b, torch.full_like(b, 255))


class BlockFloatCodec(AxisGrouped, Codec):
    """Base of the hardware formats: blocks of `block` values along `axis`, optional Hadamard."""

    block = 32
    elem: ElementFormat = ELEMENT_FORMATS["e4m3"]
    scale_bytes = 1

    def __init__(self, hadamard: bool = False, axis: int = -1) -> None:
        if not isinstance(hadamard, bool):
            raise TypeError(f"{self.name}: hadamard must be a bool, got {hadamard!r}")
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"{self.name}: axis must be an int, got {type(axis).__name__}")
        self.hadamard, self.axis = hadamard, axis
        self.bits = self.elem.bits

    def _set_spec(self, opts: list[str]) -> None:
        opts = opts + (["hadamard=True"] if self.hadamard else [])
        opts += [f"axis={self.axis}"] if self.axis != -1 else []
        self.spec = f"{self.name}({','.join(opts)})" if opts else self.name

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def _payload(self, nb: int) -> int:
        return nb * self.block * self.bits // 8

    # grouping axis, as the group codecs do (docs/design.md 1.1: data-driven reshaping)

    def _in_memory_order(self, shape: torch.Size) -> bool:
        return len(shape) < 2 or self.axis % len(shape) == len(shape) - 1

    def _to_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Flat x -> fp32 [n_b, block], zero-padded, rotated when `hadamard`."""
        nb = self.blocks(x.numel())
        xb = torch.nn.functional.pad(x.float(), (0, nb * self.block - x.numel())).view(nb, self.block)
        return self._rotate(xb)

    def _rotate(self, v: torch.Tensor) -> torch.Tensor:
        if not self.hadamard:
            return v
        return (v @ hadamard_matrix(self.block, v.device)) / math.sqrt(self.block)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.reshape(-1) if self.bits == 8 else pack_bits(codes, self.bits).reshape(-1)

    def _unpack(self, payload: torch.Tensor, nb: int) -> torch.Tensor:
        if self.bits == 8:
            return payload.view(nb, self.block)
        return unpack_bits(payload.view(nb, -1), self.bits).view(torch.uint8) & ((1 << self.bits) - 1)


class MXCodec(BlockFloatCodec):
    """An OCP MX v1.0 format: blocks of 32 elements sharing one E8M0 (power-of-two) scale."""

    group_size = 32  # a block's code is a function of the block: collectives cut chunks on blocks

    def __init__(self, scale_rule: str = "floor", hadamard: bool = False, axis: int = -1) -> None:
        if scale_rule not in SCALE_RULES:
            raise ValueError(f"{self.name}: scale_rule={scale_rule!r} is not one of {list(SCALE_RULES)}")
        super().__init__(hadamard, axis)
        self.scale_rule = scale_rule
        self._set_spec([f"scale_rule={scale_rule}"] if scale_rule != "floor" else [])

    def nbytes(self, numel: int, dtype: torch.dtype = torch.bfloat16) -> int:
        nb = self.blocks(numel)
        return self._payload(nb) + nb

    def quantize(self, xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 blocks [n_b, 32] -> (element codes uint8 [n_b, 32], E8M0 bytes int32 [n_b, 1])."""
        amax = xb.abs().amax(1, keepdim=True)
        b = e8m0_scale(amax, self.elem, self.scale_rule)
        recip = e8m0_value(254 - b.clamp_max(254))  # 2^(127 - b), exact (2^-127 subnormal)
        recip = torch.where(b == 255, torch.full_like(recip, math.nan), recip)
        return to_codes(xb * recip, self.elem), b

    def _encode_flat(self, x: torch.Tensor, out: torch.Tensor) -> None:
        codes, b = self.quantize(self._to_blocks(x))
        p = self._payload(codes.shape[0])
        out[:p].copy_(self._pack(codes))
        out[p:].copy_(b.view(-1).to(torch.uint8))

    def _decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nb = self.blocks(numel)
        p = self._payload(nb)
        v = from_codes(self._unpack(buf[:p], nb), self.elem) * e8m0_value(buf[p:].to(torch.int32)).view(nb, 1)
        return finite_clamp(self._rotate(v).view(-1)[:numel], dtype)


class NVFP4Codec(BlockFloatCodec):
    """NVIDIA's NVFP4: E2M1 elements, blocks of 16 with an E4M3 scale, one fp32 scale per message."""

    name = "nvfp4"
    block = 16
    elem = ELEMENT_FORMATS["e2m1"]

    def __init__(self, per_tensor: bool = True, hadamard: bool = False, axis: int = -1) -> None:
        if not isinstance(per_tensor, bool):
            raise TypeError(f"{self.name}: per_tensor must be a bool, got {per_tensor!r}")
        super().__init__(hadamard, axis)
        self.per_tensor = per_tensor
        self._set_spec([] if per_tensor else ["per_tensor=False"])

    def _header(self) -> int:
        return 4 if self.per_tensor else 0

    def nbytes(self, numel: int, dtype: torch.dtype = torch.bfloat16) -> int:
        nb = self.blocks(numel)
        return self._header() + self._payload(nb) + nb if numel else 0

    def tensor_scale(self, xb: torch.Tensor) -> torch.Tensor:
        """The message's fp32 scale S = amax / (6 * 448) over its finite values, shape [1, 1]; at
        least 2^-120, so that 1 / (S s_b) stays finite for the smallest block scale s_b = 2^-6
        (messages whose amax is below ~1e-33 quantize on that coarser grid)."""
        a = xb.abs()
        amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax().view(1, 1)
        return (amax / NVFP4_RANGE).clamp_min(S_MIN)

    def quantize(self, xb: torch.Tensor, s: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 blocks [n_b, 16] and the message scale S (None: single level) -> (element codes
        uint8 [n_b, 16], E4M3 block scales [n_b, 1]), in torchao's order of operations."""
        amax = xb.abs().amax(1, keepdim=True)
        bs = amax / self.elem.fmax
        scaled = bs if s is None else bs / s
        s8 = scaled.clamp(E4M3_TINY, 448.0).to(torch.float8_e4m3fn)
        s8 = torch.where(torch.isfinite(amax), s8.float(), math.nan).to(torch.float8_e4m3fn)
        recip = (1.0 / s8.float()) if s is None else (1.0 / s) / s8.float()
        return to_codes(xb * recip, self.elem), s8

    def _encode_flat(self, x: torch.Tensor, out: torch.Tensor) -> None:
        xb = self._to_blocks(x)
        s = self.tensor_scale(xb) if self.per_tensor else None
        codes, s8 = self.quantize(xb, s)
        h, p = self._header(), self._payload(codes.shape[0])
        if s is not None:
            out[:h].copy_(s.view(-1).view(torch.uint8))
        out[h : h + p].copy_(self._pack(codes))
        out[h + p :].copy_(s8.view(-1).view(torch.uint8))

    def _decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nb = self.blocks(numel)
        h, p = self._header(), self._payload(nb)
        scale = buf[h + p :].view(torch.float8_e4m3fn).float().view(nb, 1)
        if self.per_tensor:
            scale = f32_view(buf[:h]).view(1, 1) * scale
        v = from_codes(self._unpack(buf[h : h + p], nb), self.elem) * scale
        return finite_clamp(self._rotate(v).view(-1)[:numel], dtype)


def _mx(name: str, elem: str) -> type[MXCodec]:
    f = ELEMENT_FORMATS[elem]
    doc = f"OCP MX {name.upper()}: {f.bits}-bit {elem.upper()} elements, blocks of 32, an E8M0 scale each."
    attrs = {"name": name, "elem": f, "__doc__": doc}
    return type(name.replace("-", "_").upper() + "Codec", (MXCodec,), attrs)


MX_CODECS: dict[str, type[BlockFloatCodec]] = {
    c.name: c
    for c in (
        _mx("mxfp8-e4m3", "e4m3"),
        _mx("mxfp8-e5m2", "e5m2"),
        _mx("mxfp6-e2m3", "e2m3"),
        _mx("mxfp6-e3m2", "e3m2"),
        _mx("mxfp4", "e2m1"),
        NVFP4Codec,
    )
}
"""The hardware block formats by name."""
