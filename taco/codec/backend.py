"""The one kernel backend interface of the group codecs (docs/design.md 1.1 and 2).

A backend is one implementation of a group codec's wire-level operations, writing into buffers the
caller owns (no temporaries, no copies of the result):

- `encode(codec, x, out)`: flat `x` (grouping order, fp32/bf16/fp16) -> `out`, `codec.nbytes(n)` bytes;
- `decode(codec, buf, y)`: one wire chunk -> flat `y` (its numel and dtype; fp16 saturates);
- `decode_sum_encode(...)`: the two-shot middle, N chunks -> fp32 sum in order (a raw local term
  at `own_index`) -> encode;
- `encode_chunks`, `decode_chunks`: several chunks of one tensor/buffer in one call (`Span`s);

and says which (codec, device) pairs it serves (`supports`). A codec asks once per device type
(`select`) and keeps the answer. Backends, by what they are:
- "eager": the reference composition (`functional` on [ng, G] fp32 groups), always present;
- "native": the C kernels (`taco.kernels.native`, CPU);
- "triton": the Triton kernels (CUDA; the CPU under TRITON_INTERPRET=1);
- "inductor": `torch.compile` of the reference group functions (opt-in, any device).
`taco.kernels` registers the last three and the "auto" order per device type at import.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from . import functional as Fn
from . import search
from .base import finite_clamp, sum_in_order
from .formats import pack_bits, unpack_bits
from .scales import to_bytes

log = logging.getLogger("taco.codec")

Span = tuple[int, int, int]
"""One chunk of a multi-chunk call: (element offset, numel, byte offset)."""

BACKENDS = ("auto", "eager", "native", "inductor", "triton")
ALIASES = {"compile": "native"}  # the native backend's name before issue 12


class KernelBackend:
    """Base class; `encode_chunks`/`decode_chunks` default to one `encode`/`decode` per span."""

    name = "?"

    def supports(self, codec, device: torch.device) -> bool:
        raise NotImplementedError

    def encode(self, codec, x: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def decode(self, codec, buf: torch.Tensor, y: torch.Tensor) -> None:
        raise NotImplementedError

    def decode_sum_encode(
        self,
        codec,
        bufs: torch.Tensor,
        stride: int,
        nchunks: int,
        numel: int,
        own: torch.Tensor | None,
        own_index: int,
        out: torch.Tensor | None,
        sum_out: torch.Tensor | None,
    ) -> None:
        """Chunk k of `numel` elements starts at byte k * stride of `bufs`; each is decoded in fp32
        and the terms summed in order s = y_0 + y_1 + ..., the raw `own` values being term number
        `own_index`. The sum is encoded into `out` (None: not encoded) and stored into `sum_out`
        (any float dtype; None: not stored)."""
        raise NotImplementedError

    def encode_chunks(self, codec, x: torch.Tensor, out: torch.Tensor, spans: Sequence[Span]) -> None:
        for eo, n, bo in spans:
            self.encode(codec, x[eo : eo + n], out[bo : bo + codec.nbytes(n)])

    def decode_chunks(self, codec, buf: torch.Tensor, y: torch.Tensor, spans: Sequence[Span]) -> None:
        for eo, n, bo in spans:
            self.decode(codec, buf[bo : bo + codec.nbytes(n)], y[eo : eo + n])


class GroupFnBackend(KernelBackend):
    """The reference composition around per-family group functions on [ng, G] fp32 groups: pad,
    run `enc`/`dec` (eager, or compiled by "inductor"), pack; decode-sum-encode term by term."""

    def __init__(self, name: str, fns: dict[str, tuple[Callable, Callable]]) -> None:
        self.name, self.fns = name, fns

    def supports(self, codec, device: torch.device) -> bool:
        return getattr(codec, "family", None) in self.fns

    def encode(self, codec, x: torch.Tensor, out: torch.Tensor) -> None:
        with torch.autocast(x.device.type, enabled=False):  # fp32 group math even inside autocast
            self._encode(codec, x, out)

    def _encode(self, codec, x: torch.Tensor, out: torch.Tensor) -> None:
        g, n = codec.group_size, x.numel()
        ng = codec.groups(n)
        xf = x.float()
        if ng * g != n:
            xf = F.pad(xf, (0, ng * g - n))
        q, *s = self.fns[codec.family][0](xf.view(ng, g), *codec._args(x.device))
        if codec.bits < 8:
            q = pack_bits(q, codec.bits)
        p, sb = ng * g * codec.bits // 8, codec.scale_bytes * ng
        out[:p].view(ng, -1).copy_(q.view(torch.uint8).view(ng, -1))
        for i, si in enumerate(s):  # byte copies: correct whatever out's alignment
            out[p + sb * i : p + sb * (i + 1)].copy_(to_bytes(si, codec.scale_fmt))

    def decode(self, codec, buf: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(buf.device.type, enabled=False):  # fp32 group math even inside autocast
            self._decode(codec, buf, y)

    def _decode(self, codec, buf: torch.Tensor, y: torch.Tensor) -> None:
        payload, scales = codec._split(buf)
        if codec.bits < 8:
            payload = unpack_bits(payload, codec.bits)
        elif codec.family == "int":
            payload = payload.view(torch.int8)
        v = self.fns[codec.family][1](payload, *scales, *codec._dargs(buf.device))
        y.copy_(finite_clamp(v.view(-1)[: y.numel()], y.dtype))

    def decode_sum_encode(self, codec, bufs, stride, nchunks, numel, own, own_index, out, sum_out) -> None:
        size = codec.nbytes(numel)

        def decode_chunk(k: int) -> torch.Tensor:
            t = torch.empty(numel, dtype=torch.float32, device=bufs.device)
            self.decode(codec, bufs[k * stride : k * stride + size], t)
            return t

        def encode(s: torch.Tensor, buf: torch.Tensor) -> None:
            self.encode(codec, s, buf)

        sum_in_order(decode_chunk, nchunks, own, own_index, encode, out, sum_out)


EAGER = GroupFnBackend(
    "eager",
    {
        "taco": (Fn.taco_encode, Fn.taco_decode),
        "fp8": (Fn.fp8_encode, Fn.fp8_decode),
        "int": (Fn.int_encode, Fn.int_decode),
        "int-mse": (search.int_mse_encode, search.int_mse_decode),
    },
)
_REGISTRY: dict[str, KernelBackend] = {"eager": EAGER}
_AUTO: dict[str, list[str]] = {"cpu": [], "cuda": []}
_FELL_BACK: set[tuple[str, str, str]] = set()
_GENERATION = [0]  # bumped on every change, so codecs re-ask after a registration


def generation() -> int:
    return _GENERATION[0]


def canonical(name: str) -> str:
    """A backend name as the registry knows it ("compile" is the old name of "native")."""
    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: use one of {list(BACKENDS)}")
    return name


def register(backend: KernelBackend) -> None:
    """Make `backend` available under `backend.name` (replacing one of the same name)."""
    _REGISTRY[backend.name] = backend
    _GENERATION[0] += 1


def registered() -> list[str]:
    return list(_REGISTRY)


def set_auto_order(device_type: str, order: list[str]) -> None:
    """The backends backend="auto" tries on `device_type`, in order, before "eager"."""
    _AUTO[device_type] = [canonical(b) for b in order]
    _GENERATION[0] += 1


def auto_order(device_type: str) -> list[str]:
    return list(_AUTO.get(device_type, []))


def select(codec, device: torch.device) -> KernelBackend:
    """The backend serving `codec` (its `backend` option) on `device`; "eager" when none does.

    An explicitly named backend that is not registered raises; one that is registered but does not
    serve this codec or device falls back to "eager" (same semantics), logged once."""
    want = codec.backend
    order = auto_order(device.type) if want == "auto" else [want]
    for name in order:
        b = _REGISTRY.get(name)
        if b is not None and b.supports(codec, device):
            return _REGISTRY[name]  # supports() may have replaced a lazy entry by the real backend
    if want not in ("auto", "eager"):
        if want not in _REGISTRY:
            raise ValueError(
                f"{codec.spec}: backend {want!r} is not available (import taco.kernels; triton needs "
                "a GPU or TRITON_INTERPRET=1); use backend='eager' or 'auto'"
            )
        key = (codec.spec, want, device.type)
        if key not in _FELL_BACK:
            _FELL_BACK.add(key)
            log.info("%s: backend %r does not serve %s tensors; using the eager reference", *key)
    return EAGER
