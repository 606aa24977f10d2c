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
| int4-hadamard | Hadamard + int4 packed nibbles (DP/PP traffic)            | 0.5 + 4/G          |

Group codecs cut the flattened tensor into groups of G along `axis` (default: the last, i.e.
contiguous memory); the tail is zero-padded on the wire. Wire layout of one chunk:
`[payload: ng*G*bits/8][scale_0: fp32 x ng][scale_1: fp32 x ng]...`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import functional as Fn
from .base import Codec, f32_view, finite_clamp, positive_finite
from .formats import fp8_format, pack_int4, unpack_int4
from .hadamard import GROUP_SIZES, check_group_size, hadamard_matrix

# (codec family, backend) -> (encode_fn, decode_fn) with the signatures of `functional`'s pair.
# `taco.kernels` registers "compile" and "triton" here; the codec never imports kernels itself.
_BACKENDS: dict[tuple[str, str], tuple[Callable, Callable]] = {}
# Optional wire-level pair of a backend: encode_into(codec, x_flat, out) -> bool and
# decode_from(codec, buf, numel, dtype) -> Tensor | None, straight between the input dtype and
# the wire bytes; False/None declines (e.g. an unsupported device) and the pair above is used.
_WIRE: dict[tuple[str, str], tuple[Callable, Callable]] = {}
_AUTO: dict[str, list[str]] = {"cpu": [], "cuda": []}
BACKENDS = ("auto", "eager", "compile", "inductor", "triton")


def register_backend(
    family: str,
    backend: str,
    encode: Callable,
    decode: Callable,
    encode_into: Callable | None = None,
    decode_from: Callable | None = None,
) -> None:
    """Make `backend` available for codec `family` ("taco", "fp8", "int"), optionally wire-level."""
    _BACKENDS[(family, backend)] = (encode, decode)
    if encode_into is not None and decode_from is not None:
        _WIRE[(family, backend)] = (encode_into, decode_from)


def set_auto_backends(device_type: str, order: list[str]) -> None:
    """Preference order that backend="auto" tries on `device_type` before falling back to eager."""
    _AUTO[device_type] = list(order)


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


class GroupCodec(Codec):
    """Base of per-group codecs: padding, the wire layout, grouping axis and backend dispatch."""

    family = "?"
    bits = 8
    n_scales = 1
    rotate = False

    def __init__(self, group_size: int = 128, axis: int = -1, backend: str = "auto") -> None:
        self.group_size = check_group_size(group_size, GROUP_SIZES)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"axis must be an int, got {type(axis).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: use one of {list(BACKENDS)}")
        self.axis = axis
        self.backend = backend
        self.spec = f"{self.name}({self._options()})"

    def _options(self) -> str:
        s = f"group_size={self.group_size}"
        return s + (f",axis={self.axis}" if self.axis != -1 else "")

    # -- layout ---------------------------------------------------------------------------------
    def groups(self, numel: int) -> int:
        return -(-numel // self.group_size)

    def nbytes(self, numel: int, dtype: torch.dtype = torch.bfloat16) -> int:
        ng = self.groups(numel)
        return ng * self.group_size * self.bits // 8 + 4 * self.n_scales * ng

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        if self.axis != -1 and x.dim() >= 2 and self.axis % x.dim() != x.dim() - 1:
            x = x.movedim(self.axis, -1)
        return x.contiguous()

    def _finish(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.axis != -1 and len(shape) >= 2 and self.axis % len(shape) != len(shape) - 1:
            moved = list(shape)
            moved.append(moved.pop(self.axis))
            return y.view(moved).movedim(-1, self.axis).contiguous()
        return y.view(shape)

    def _split(self, buf: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """uint8 buffer -> (payload [ng, G*bits/8], [scale [ng, 1] fp32 views])."""
        ng = (buf.numel()) // (self.group_size * self.bits // 8 + 4 * self.n_scales)
        p = ng * self.group_size * self.bits // 8
        scales = [
            f32_view(buf[p + 4 * ng * i : p + 4 * ng * (i + 1)]).view(ng, 1) for i in range(self.n_scales)
        ]
        return buf[:p].view(ng, -1), scales

    def _backend(self, device: torch.device) -> str:
        """The registered backend serving `device` ("eager" when none)."""
        order = _AUTO.get(device.type, []) if self.backend == "auto" else [self.backend]
        for b in order:
            if (self.family, b) in _BACKENDS:
                return b
        if self.backend not in ("auto", "eager"):
            raise ValueError(
                f"{self.spec}: backend {self.backend!r} is not available for {self.family} codecs "
                f"(import taco.kernels; triton needs a GPU); use backend='eager' or 'auto'"
            )
        return "eager"

    def _fns(self, device: torch.device) -> tuple[Callable, Callable]:
        return _BACKENDS.get((self.family, self._backend(device)), self._eager)

    # -- encode / decode ------------------------------------------------------------------------
    def _encode_flat(self, x: torch.Tensor, out: torch.Tensor) -> None:
        wire = _WIRE.get((self.family, self._backend(x.device)))
        if wire is not None and wire[0](self, x, out):
            return
        g = self.group_size
        ng = self.groups(x.numel())
        xf = x.float()
        if ng * g != x.numel():
            xf = F.pad(xf, (0, ng * g - x.numel()))
        enc, _ = self._fns(x.device)
        q, *s = enc(xf.view(ng, g), *self._args(x.device))
        if self.bits == 4:
            q = pack_int4(q)
        p = ng * g * self.bits // 8
        out[:p].view(ng, -1).copy_(q.view(torch.uint8).view(ng, -1))
        for i, si in enumerate(s):  # byte copies: correct whatever out's alignment
            out[p + 4 * ng * i : p + 4 * ng * (i + 1)].copy_(si.reshape(-1).view(torch.uint8))

    def _decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        wire = _WIRE.get((self.family, self._backend(buf.device)))
        y = None if wire is None else wire[1](self, buf, numel, dtype)
        if y is not None:
            return y
        payload, scales = self._split(buf)
        if self.bits == 4:
            payload = unpack_int4(payload)
        elif self.family == "int":
            payload = payload.view(torch.int8)
        _, dec = self._fns(buf.device)
        y = dec(payload, *scales, *self._dargs(buf.device))
        return finite_clamp(y.view(-1)[:numel], dtype)

    def _h(self, device: torch.device) -> torch.Tensor | None:
        return hadamard_matrix(self.group_size, device) if self.rotate else None

    @property
    def _eager(self) -> tuple[Callable, Callable]:
        raise NotImplementedError

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
    ) -> None:
        self.fmt = fp8_format(fmt)
        self.lam = positive_finite(self.name, "lam", lam)
        target = self.fmt.fmax if target is None else target
        self.target = positive_finite(self.name, "target", target, upper=self.fmt.fmax)
        super().__init__(group_size, axis, backend)

    def _options(self) -> str:
        extra = f",fmt={self.fmt.name}"
        if self.lam != 1e-6:
            extra += f",lam={self.lam:g}"
        if self.target != self.fmt.fmax:
            extra += f",target={self.target:g}"
        return super()._options() + extra

    _eager = (Fn.taco_encode, Fn.taco_decode)

    def _args(self, device: torch.device) -> tuple:
        return (self._h(device), self.fmt.dtype, self.fmt.fmax, self.lam, self.target)

    def _dargs(self, device: torch.device) -> tuple:
        return (self._h(device), self.fmt.dtype)


class FP8GroupCodec(GroupCodec):
    """Per-group absmax FP8 without rotation (the plain blockwise-FP8 baseline)."""

    name = "fp8-group"
    family = "fp8"

    def __init__(
        self, group_size: int = 128, fmt: str = "e4m3", axis: int = -1, backend: str = "auto"
    ) -> None:
        self.fmt = fp8_format(fmt)
        super().__init__(group_size, axis, backend)

    def _options(self) -> str:
        return super()._options() + f",fmt={self.fmt.name}"

    _eager = (Fn.fp8_encode, Fn.fp8_decode)

    def _args(self, device: torch.device) -> tuple:
        return (self._h(device), self.fmt.dtype, self.fmt.fmax)

    def _dargs(self, device: torch.device) -> tuple:
        return (self._h(device), self.fmt.dtype)


class Taco1sCodec(FP8GroupCodec):
    """TACO with a single scale per group: Hadamard + per-group absmax FP8 (s_a cancels exactly)."""

    name = "taco-1s"
    rotate = True


class IntGroupCodec(GroupCodec):
    family = "int"
    qmax = 127

    _eager = (Fn.int_encode, Fn.int_decode)

    def _args(self, device: torch.device) -> tuple:
        return (self._h(device), self.qmax)

    def _dargs(self, device: torch.device) -> tuple:
        return (self._h(device),)


class Int8GroupCodec(IntGroupCodec):
    """Per-group absmax INT8, no rotation."""

    name = "int8-group"


class Int8HadamardCodec(IntGroupCodec):
    """Hadamard rotation + per-group absmax INT8 (about 44 dB on Gaussian-like data)."""

    name = "int8-hadamard"
    rotate = True


class Int4HadamardCodec(IntGroupCodec):
    """Hadamard rotation + per-group absmax INT4 in packed nibbles, for DP/PP traffic."""

    name = "int4-hadamard"
    rotate = True
    bits = 4
    qmax = 7


CODECS: dict[str, type[Codec]] = {
    c.name: c
    for c in (
        NoneCodec,
        FP8TensorCodec,
        FP8GroupCodec,
        Int8GroupCodec,
        TacoCodec,
        Taco1sCodec,
        Int8HadamardCodec,
        Int4HadamardCodec,
    )
}


def list_codecs() -> list[str]:
    """Names accepted by `get_codec`."""
    return list(CODECS)


def codec_options(name: str) -> list[str]:
    """The keyword options codec `name` accepts (its constructor's parameters)."""
    import inspect

    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}: choose one of {list_codecs()}")
    return [p for p in inspect.signature(CODECS[name].__init__).parameters if p != "self"]


def accepted_options(name: str, options: dict) -> dict:
    """The subset of `options` that codec `name` accepts (e.g. no group_size for fp8-tensor)."""
    params = codec_options(name)
    return {k: v for k, v in options.items() if k in params}


def get_codec(name: str | Codec | None = "taco", **options) -> Codec:
    """Build a codec by name with keyword options, e.g. get_codec("taco", group_size=128, fmt="e4m3").

    A `Codec` instance is returned as is; None means "none".
    """
    if isinstance(name, Codec):
        if options:
            raise ValueError("options cannot be given with a codec instance")
        return name
    if name is None:
        name = "none"
    if not isinstance(name, str):
        raise TypeError(f"codec must be a name or a Codec, got {type(name).__name__}")
    cls = CODECS.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}: choose one of {list_codecs()}")
    try:
        return cls(**options)
    except TypeError as e:
        raise TypeError(f"codec {name!r} accepts options {codec_options(name)}: {e}") from None


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """10 log10(sum x^2 / sum (x - y)^2) in fp64 (inf for an exact match)."""
    x64, y64 = x.double(), y.double()
    err = (x64 - y64).square().sum().item()
    sig = x64.square().sum().item()
    return math.inf if err == 0 else 10 * math.log10(sig / err) if sig > 0 else -math.inf
