"""The codec zoo: the faithful TACO preset, the baselines a user would pick instead, and variants.

| name          | what                                                      | bytes/elem (G=128) |
|---------------|-----------------------------------------------------------|--------------------|
| none          | the raw tensor, bit-identical                             | 2 (bf16)           |
| fp8-tensor    | one fp32 scale per tensor, saturating cast                | 1 + 4/n            |
| fp8-group     | per-group absmax fp32 scale, no rotation                  | 1 + 4/G            |
| int8-group    | per-group absmax int8                                     | 1 + 4/G            |
| taco          | docs/design.md 1.1: adaptive scale, Hadamard, dual scales | 1 + 8/G            |
| taco-1s       | taco with one scale per group (s_a cancels)               | 1 + 4/G            |
| int8-hadamard | Hadamard + int8, one scale per group                      | 1 + 4/G            |
| intB-hadamard | Hadamard + B-bit ints, B = 2..7, bit-packed (int6: 4 codes in 3 bytes) | B/8 + 4/G |
| int4-hadamard | Hadamard + int4 packed nibbles (DP/PP traffic)            | 0.5 + 4/G          |
| mxfp8-e4m3 .. mxfp4, nvfp4 | the hardware block formats (`taco.codec.mx`) | 1.03 .. 0.53   |

Codecs by name (`CODECS`, `get_codec`) are `taco.codec.registry`.

The intB-hadamard codecs take `signs=True`: the randomized Hadamard (a fixed +-1 diagonal before
the rotation, `hadamard.sign_flips`), same bytes per element; the default keeps the plain rotation;
`signs="auto"` picks per group whichever of the two gives the smaller scale, the finer grid (the
choice is the sign of the group's scale, so fp32 or bf16 scales only).

Group codecs cut the flattened tensor into groups of G along `axis` (default: the last, i.e.
contiguous memory); the tail is zero-padded on the wire. Wire layout of one chunk:
`[payload: ng*G*bits/8][scale_0 x ng][scale_1 x ng]...`, each scale in the codec's `scale_fmt`
(`taco.codec.scales`: fp32 by default, 4 bytes; bf16, 2; e8m0, 1), so e.g. int6-hadamard with
e8m0 scales is 0.75 + 1/G bytes/elem. Integer codes of B < 8 bits are packed LSB first
(`formats.pack_bits`; int4's nibble layout is that stream's B = 4 case).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import backend as kb
from . import functional as Fn
from .base import AxisGrouped, Codec, f32_view, finite_clamp, positive_finite
from .formats import fp8_format, int_qmax
from .hadamard import GROUP_SIZES, check_group_size, hadamard_matrix, sign_flips
from .scales import check_scale_fmt, from_bytes, scale_bytes


class NoneCodec(Codec):
    """No compression: the tensor's own bytes (bit-identical round trip)."""

    name = "none"

    def nbytes(self, numel: int, dtype: torch.dtype = torch.bfloat16) -> int:
        return numel * dtype.itemsize

    def _encode_flat(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x.view(torch.uint8))

    def _decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if buf.data_ptr() % dtype.itemsize:
            buf = buf.clone()
        return buf.view(dtype)


class FP8TensorCodec(Codec):
    """One fp32 absmax scale per tensor, saturating RNE cast (the torchao-style FP8 cast)."""

    name = "fp8-tensor"

    def __init__(self, fmt: str = "e4m3") -> None:
        self.fmt = fp8_format(fmt)
        self.spec = f"{self.name}(fmt={fmt})"

    def nbytes(self, numel: int, dtype: torch.dtype = torch.bfloat16) -> int:
        return numel + 4 if numel else 0

    def _encode_flat(self, x: torch.Tensor, out: torch.Tensor) -> None:
        q, s = Fn.fp8_encode(x.float().view(1, -1), None, self.fmt.dtype, self.fmt.fmax)
        n = x.numel()
        out[:n].copy_(q.view(-1))
        out[n:].copy_(s.view(-1).view(torch.uint8))

    def _decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        s = f32_view(buf[numel:]).view(1, 1)
        y = Fn.fp8_decode(buf[:numel].view(1, -1), s, None, self.fmt.dtype)
        return finite_clamp(y.view(-1), dtype)


class GroupCodec(AxisGrouped, Codec):
    """Base of per-group codecs: padding, the wire layout, grouping axis and backend dispatch."""

    family = "?"
    bits = 8
    n_scales = 1
    rotate = False

    def __init__(
        self, group_size: int = 128, axis: int = -1, backend: str = "auto", scale_fmt: str = "fp32"
    ) -> None:
        self.group_size = check_group_size(group_size, GROUP_SIZES)
        self.scale_fmt = check_scale_fmt(scale_fmt)
        self.scale_bytes = scale_bytes(scale_fmt)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"axis must be an int, got {type(axis).__name__}")
        self.axis = axis
        self.backend = kb.canonical(backend)
        self._kernels: dict[str, tuple[int, kb.KernelBackend]] = {}
        lean = f",scale_fmt={self.scale_fmt}" if self.scale_fmt != "fp32" else ""
        self.spec = f"{self.name}({self._options()}{lean})"

    def _options(self) -> str:
        s = f"group_size={self.group_size}"
        return s + (f",axis={self.axis}" if self.axis != -1 else "")

    # -- layout ---------------------------------------------------------------------------------
    def groups(self, numel: int) -> int:
        return -(-numel // self.group_size)

    def nbytes(self, numel: int, dtype: torch.dtype = torch.bfloat16) -> int:
        ng = self.groups(numel)
        return ng * (self.group_size * self.bits // 8 + self.scale_bytes * self.n_scales)

    def _split(self, buf: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """uint8 buffer -> (payload [ng, G*bits/8], [scale [ng, 1] fp32])."""
        sb = self.scale_bytes
        ng = (buf.numel()) // (self.group_size * self.bits // 8 + sb * self.n_scales)
        p = ng * self.group_size * self.bits // 8
        scales = [
            from_bytes(buf[p + sb * ng * i : p + sb * ng * (i + 1)], self.scale_fmt).view(ng, 1)
            for i in range(self.n_scales)
        ]
        return buf[:p].view(ng, -1), scales

    def kernel(self, device: torch.device) -> kb.KernelBackend:
        """The backend serving this codec on `device` (asked once per device type and registry state)."""
        gen = kb.generation()
        hit = self._kernels.get(device.type)
        if hit is None or hit[0] != gen:
            hit = self._kernels[device.type] = (gen, kb.select(self, device))
        return hit[1]

    # -- encode / decode: everything goes through the one backend interface ----------------------
    def _encode_flat(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self.kernel(x.device).encode(self, x, out)

    def _decode_into(self, buf: torch.Tensor, y: torch.Tensor) -> None:
        self.kernel(buf.device).decode(self, buf, y)

    def _decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        y = torch.empty(numel, dtype=dtype, device=buf.device)
        self._decode_into(buf, y)
        return y

    def encode_chunks(self, x: torch.Tensor, out: torch.Tensor, spans: Sequence[kb.Span]) -> None:
        if spans:
            self.kernel(x.device).encode_chunks(self, x, out, spans)

    def decode_chunks(self, buf: torch.Tensor, y: torch.Tensor, spans: Sequence[kb.Span]) -> None:
        if spans:
            self.kernel(buf.device).decode_chunks(self, buf, y, spans)

    def _decode_sum_encode(self, bufs, stride, nchunks, numel, dtype, own, own_index, out, sum_out) -> None:
        kernel = self.kernel(bufs.device)
        kernel.decode_sum_encode(self, bufs, stride, nchunks, numel, own, own_index, out, sum_out)

    def _h(self, device: torch.device) -> torch.Tensor | None:
        return hadamard_matrix(self.group_size, device) if self.rotate else None

    def _args(self, device: torch.device) -> tuple:
        raise NotImplementedError

    def _dargs(self, device: torch.device) -> tuple:
        raise NotImplementedError


class TacoCodec(GroupCodec):
    """The faithful TACO preset (docs/design.md 1.1): adaptive scale s_a, Hadamard, dual-scale FP8."""

    name = "taco"
    family = "taco"
    n_scales = 2
    rotate = True

    def __init__(
        self,
        group_size: int = 128,
        fmt: str = "e4m3",
        lam: float = 1e-6,
        target: float | None = None,
        axis: int = -1,
        backend: str = "auto",
        scale_fmt: str = "fp32",
    ) -> None:
        self.fmt = fp8_format(fmt)
        self.lam = positive_finite(self.name, "lam", lam)
        target = self.fmt.fmax if target is None else target
        self.target = positive_finite(self.name, "target", target, upper=self.fmt.fmax)
        super().__init__(group_size, axis, backend, scale_fmt)

    def _options(self) -> str:
        extra = f",fmt={self.fmt.name}"
        if self.lam != 1e-6:
            extra += f",lam={self.lam:g}"
        if self.target != self.fmt.fmax:
            extra += f",target={self.target:g}"
        return super()._options() + extra

    def _args(self, device: torch.device) -> tuple:
        return (self._h(device), self.fmt.dtype, self.fmt.fmax, self.lam, self.target, self.scale_fmt)

    def _dargs(self, device: torch.device) -> tuple:
        return (self._h(device), self.fmt.dtype)


class FP8GroupCodec(GroupCodec):
    """Per-group absmax FP8 without rotation (the plain blockwise-FP8 baseline)."""

    name = "fp8-group"
    family = "fp8"

    def __init__(
        self,
        group_size: int = 128,
        fmt: str = "e4m3",
        axis: int = -1,
        backend: str = "auto",
        scale_fmt: str = "fp32",
    ) -> None:
        self.fmt = fp8_format(fmt)
        super().__init__(group_size, axis, backend, scale_fmt)

    def _options(self) -> str:
        return super()._options() + f",fmt={self.fmt.name}"

    def _args(self, device: torch.device) -> tuple:
        return (self._h(device), self.fmt.dtype, self.fmt.fmax, self.scale_fmt)

    def _dargs(self, device: torch.device) -> tuple:
        return (self._h(device), self.fmt.dtype)


class Taco1sCodec(FP8GroupCodec):
    """TACO with a single scale per group: Hadamard + per-group absmax FP8 (s_a cancels exactly).

    This is the lean-scale `taco`: with scale_fmt="e8m0" it costs 1 + 1/G bytes/elem. (The faithful
    preset keeps its two scales: s_a only exists to dodge the clamps of s_q, docs/design.md 1.1.)"""

    name = "taco-1s"
    rotate = True


class IntGroupCodec(GroupCodec):
    family = "int"
    qmax = 127

    def _args(self, device: torch.device) -> tuple:
        return (self._h(device), self.qmax, self.scale_fmt)

    def _dargs(self, device: torch.device) -> tuple:
        return (self._h(device),)


class Int8GroupCodec(IntGroupCodec):
    """Per-group absmax INT8, no rotation."""

    name = "int8-group"


class IntHadamardCodec(IntGroupCodec):
    """Base of the intB-hadamard codecs. `signs`: False, the plain rotation; True, the randomized
    Hadamard transform (each group times a fixed +-1 diagonal D before the rotation and after its
    inverse; `hadamard.sign_flips`), which spreads groups the plain rotation concentrates (constant or
    Walsh-like groups); "auto", per group the one of the two with the smaller scale (finer grid), the
    choice carried by the sign of the group's scale (same bytes; fp32 or bf16 scales, which have a
    sign bit; docs/design.md 1.2). `scale_search`: "absmax", the group's absmax / qmax; "mse", per
    group the scale (and, with signs="auto", the rotation) of least squared error among fractions of
    absmax (`taco.codec.search`; the eager reference serves it, the fused kernels do not yet).

    Defaults (`DEFAULTS`, chosen on captured TP tensors, docs/design.md 1.2): G = 64 with bf16 scales
    (the bytes of G = 128 with fp32 ones: B/8 + 1/32 per element) and signs="auto"; int4 adds the
    least-squares scale. Options left out take these; a spec prints every option explicitly."""

    rotate = True
    DEFAULTS = {"group_size": 64, "scale_fmt": "bf16", "signs": "auto", "scale_search": "absmax"}
    SEARCHES = ("absmax", "mse")

    def __init__(
        self,
        group_size: int | None = None,
        axis: int = -1,
        backend: str = "auto",
        scale_fmt: str | None = None,
        signs: bool | str | None = None,
        scale_search: str | None = None,
    ) -> None:
        d = self.DEFAULTS
        group_size = d["group_size"] if group_size is None else group_size
        scale_fmt = d["scale_fmt"] if scale_fmt is None else scale_fmt
        if signs is None:  # the default rotation choice needs a sign bit in the scale: not e8m0's
            signs = d["signs"] if scale_fmt != "e8m0" or d["signs"] != "auto" else False
        if isinstance(signs, str) and signs.lower() == "auto":
            signs = "auto"
            if scale_fmt == "e8m0":
                raise ValueError(
                    f"{self.name}: signs='auto' stores its per-group choice in the scale's sign bit, which "
                    "e8m0 scales do not have: use scale_fmt 'fp32' or 'bf16'"
                )
        elif not isinstance(signs, bool):
            raise TypeError(f"{self.name}: signs must be a bool or 'auto', got {signs!r}")
        scale_search = d["scale_search"] if scale_search is None else scale_search
        if scale_search not in self.SEARCHES:
            raise ValueError(f"{self.name}: scale_search={scale_search!r}: use one of {list(self.SEARCHES)}")
        self.signs = signs
        self.scale_search = scale_search
        self.family = "int-mse" if scale_search == "mse" else "int"
        super().__init__(group_size, axis, backend, scale_fmt)
        search = f",scale_search={scale_search}" if "mse" in (scale_search, d["scale_search"]) else ""
        self.spec = f"{self.name}({self._options()},scale_fmt={self.scale_fmt}{search})"

    def _options(self) -> str:
        return super()._options() + f",signs={self.signs}"

    def _with_signs(self, args: tuple, device: torch.device) -> tuple:
        """`args` plus the sign-flip diagonal per `signs`: none (False), the flips alone ("auto": the
        kernel picks per group) or the flips and True (every group flipped); encode and decode alike."""
        if not self.signs:
            return args
        flips = sign_flips(self.group_size, device)
        return (*args, flips) if self.signs == "auto" else (*args, flips, True)

    def _args(self, device: torch.device) -> tuple:
        return self._with_signs(super()._args(device), device)

    def _dargs(self, device: torch.device) -> tuple:
        return self._with_signs(super()._dargs(device), device)


class Int8HadamardCodec(IntHadamardCodec):
    """Hadamard rotation + per-group absmax INT8 (about 44 dB on Gaussian-like data)."""

    name = "int8-hadamard"


class Int4HadamardCodec(IntHadamardCodec):
    """Hadamard rotation + per-group INT4 in packed nibbles, least-squares scales (0.53 B/elem)."""

    name = "int4-hadamard"
    bits = 4
    qmax = 7
    DEFAULTS = {**IntHadamardCodec.DEFAULTS, "scale_search": "mse"}


class Int4Hadamard32Codec(Int4HadamardCodec):
    """int4-hadamard at NVFP4's 0.5625 B/elem: groups of 32 with bf16 scales, least-squares scales."""

    name = "int4-hadamard-g32"
    DEFAULTS = {**Int4HadamardCodec.DEFAULTS, "group_size": 32}
    PINNED = ("group_size", "scale_fmt")
    """options its name fixes: a sweep's common settings (`taco bench codec --group-size`) leave them"""


def _int_hadamard(bits: int) -> type[IntHadamardCodec]:
    """Hadamard rotation + per-group absmax INT`bits` codes in [-qmax, qmax], bit-packed LSB first."""
    qmax = int_qmax(bits)
    doc = f"Hadamard rotation + per-group absmax INT{bits} ({bits}-bit packed codes, qmax {qmax})."
    attrs = {"name": f"int{bits}-hadamard", "bits": bits, "qmax": qmax, "__doc__": doc}
    return type(f"Int{bits}HadamardCodec", (IntHadamardCodec,), attrs)


INT_HADAMARD: dict[int, type[IntHadamardCodec]] = {
    b: {8: Int8HadamardCodec, 4: Int4HadamardCodec}.get(b) or _int_hadamard(b) for b in range(8, 1, -1)
}
"""intB-hadamard by width B = 8..2 (int8 and int4 are the classes above: same names and bytes)."""


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """10 log10(sum x^2 / sum (x - y)^2) in fp64 (inf for an exact match)."""
    x64, y64 = x.double(), y.double()
    err = (x64 - y64).square().sum().item()
    sig = x64.square().sum().item()
    return math.inf if err == 0 else 10 * math.log10(sig / err) if sig > 0 else -math.inf
