"""The codec contract: `Codec.encode(x) -> Packed`, `Codec.decode(packed) -> x^`, exact byte counts.

A `Packed` is one contiguous uint8 buffer (payload and scales together, docs/design.md 1.1 wire) plus
the host-side facts both ends of a collective already know (shape, dtype, which codec). Only the
buffer travels; `nbytes` is its exact size. Collectives that receive a bare buffer rebuild the
`Packed` with `Codec.wrap`, which checks the size against `Codec.nbytes(numel)`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Packed:
    """An encoded tensor: `data` (1-D uint8, the bytes that travel) and how to read it back."""

    data: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    codec: str

    @property
    def nbytes(self) -> int:
        """Exact bytes that travel: payload + scales + any metadata."""
        return self.data.numel()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def sum_in_order(
    decode_chunk: Callable[[int], torch.Tensor],
    nchunks: int,
    own: torch.Tensor | None,
    own_index: int,
    encode: Callable[[torch.Tensor, torch.Tensor], None],
    out: torch.Tensor | None,
    sum_out: torch.Tensor | None,
) -> None:
    """The reference decode-sum-encode (docs/design.md 1.3), for every codec and the eager backend:
    the fp32 terms `decode_chunk(k)` for k < nchunks, the raw `own` values inserted as term
    `own_index`, summed in that order (s = t_0 + t_1 + ...); `encode(s, out)` if `out` is given and
    s stored into `sum_out` if given."""
    terms = [decode_chunk(k) for k in range(nchunks)]
    if own is not None:
        terms.insert(own_index, own.reshape(-1).to(torch.float32))
    s = terms[0].clone()
    for t in terms[1:]:
        s += t
    if out is not None:
        encode(s, out)
    if sum_out is not None:
        sum_out.copy_(s)


class Codec:
    """Base class. Subclasses implement `nbytes`, `_encode_flat` and `_decode_flat`.

    `_encode_flat(x, out)` gets a contiguous 1-D float tensor (any of FLOAT_DTYPES, numel >= 1)
    and writes exactly `nbytes(numel)` bytes into the uint8 tensor `out`; `_decode_flat(buf,
    numel, dtype)` returns a 1-D tensor of `numel` elements in `dtype`.
    """

    name: str = "?"
    # The grouping axis (data-driven reshaping): groups run along this dim of a tensor of 2+ dims.
    # A 1-D tensor is a flat chunk already in grouping order (how collectives and kernels pass
    # pieces of a tensor whose axis they moved last), grouped in memory order whatever `axis` is.
    axis: int = -1

    def __init__(self) -> None:
        self.spec = self.name

    # -- accounting -------------------------------------------------------------------------
    def nbytes(self, numel: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes on the wire for `numel` elements of `dtype` (computed without encoding)."""
        raise NotImplementedError

    def bytes_per_elem(self, numel: int = 1 << 20, dtype: torch.dtype = torch.bfloat16) -> float:
        return self.nbytes(numel, dtype) / numel

    # -- public API -------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> Packed:
        """Encode `x` (any shape, bf16/fp16/fp32, CPU or CUDA) into one uint8 buffer.

        `out`, if given, is a 1-D uint8 tensor of exactly `nbytes(x.numel(), x.dtype)` bytes
        on x's device that receives the encoding (lets collectives reuse buffers).
        """
        check_input(x)
        check_axis(self, x.shape)
        n = x.numel()
        size = self.nbytes(n, x.dtype)
        if out is None:
            out = torch.empty(size, dtype=torch.uint8, device=x.device)
        elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != size:
            raise ValueError(
                f"{self.spec}: out must be a 1-D uint8 tensor of {size} bytes, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
        if n:
            self._encode_flat(self._prepare(x).reshape(-1), out)
        return Packed(out, x.shape, x.dtype, self.spec)

    def decode(self, packed: Packed, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode to a tensor of the original shape, dtype and device (written into `out` if given)."""
        if not isinstance(packed, Packed):
            raise TypeError(f"decode expects a Packed, got {type(packed).__name__}")
        if packed.codec != self.spec:
            raise ValueError(f"buffer was encoded by {packed.codec!r}, cannot decode with {self.spec!r}")
        check_axis(self, packed.shape)
        if out is not None:
            check_out(self, out, packed)
        n = packed.numel
        size = self.nbytes(n, packed.dtype)
        if packed.data.dtype != torch.uint8 or packed.data.numel() != size:
            raise ValueError(
                f"{self.spec}: buffer holds {packed.data.numel()} bytes of {packed.data.dtype}, "
                f"expected {size} uint8 bytes for {n} elements"
            )
        if n == 0:
            empty = torch.empty(packed.shape, dtype=packed.dtype, device=packed.data.device)
            return out if out is not None else empty
        if out is not None and out.is_contiguous() and self._in_memory_order(packed.shape):
            self._decode_into(packed.data, out.view(-1))  # straight into the caller's tensor
            return out
        y = self._finish(self._decode_flat(packed.data, n, packed.dtype), packed.shape)
        if out is not None:
            out.copy_(y)
            return out
        return y

    def wrap(self, data: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Packed:
        """Rebuild a `Packed` from a received buffer; the size is checked at decode."""
        return Packed(data, torch.Size(shape), dtype, self.spec)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    # -- hooks for grouping layout (data-driven reshaping) ------------------------------------
    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous()

    def _finish(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return y.view(shape)

    def _in_memory_order(self, shape: torch.Size) -> bool:
        """Whether a tensor of `shape` is grouped in memory order (decode may write it in place)."""
        return len(shape) < 2 or self.axis % len(shape) == len(shape) - 1

    # -- wire-level calls of the collectives (flat tensors in grouping order) --------------------
    def encode_chunks(self, x: torch.Tensor, out: torch.Tensor, spans) -> None:
        """Encode the chunks of flat `x` named by `spans` ((element offset, numel, byte offset) each)
        into `out`, chunk by chunk at its byte offset, in one call where the backend can."""
        for eo, n, bo in spans:
            self.encode(x[eo : eo + n], out=out[bo : bo + self.nbytes(n, x.dtype)])

    def decode_chunks(self, buf: torch.Tensor, y: torch.Tensor, spans) -> None:
        """Decode the chunks of `buf` named by `spans` straight into their ranges of flat `y`."""
        for eo, n, bo in spans:
            self.decode(self.wrap(buf[bo : bo + self.nbytes(n, y.dtype)], (n,), y.dtype), out=y[eo : eo + n])

    def decode_sum_encode(
        self,
        bufs: torch.Tensor,
        stride: int,
        nchunks: int,
        numel: int,
        dtype: torch.dtype,
        own: torch.Tensor | None = None,
        own_index: int = 0,
        out: torch.Tensor | None = None,
        sum_out: torch.Tensor | None = None,
    ) -> None:
        """The two-shot middle (docs/design.md 1.3) in one call: chunk k (`numel` elements encoded
        from `dtype`) starts at byte k * stride of `bufs`; each is decoded, the terms are summed in
        fp32 in order with the raw `own` values as term `own_index`; the sum is encoded into `out`
        (if given) and stored into `sum_out` (if given, any float dtype)."""
        size = self.nbytes(numel, dtype)
        if nchunks < 0 or numel < 1 or (nchunks and bufs.numel() < (nchunks - 1) * stride + size):
            raise ValueError(
                f"{self.spec}: decode_sum_encode of {nchunks} chunks of {numel} elements at a stride of "
                f"{stride} bytes needs {(nchunks - 1) * stride + size} bytes; bufs holds {bufs.numel()}"
            )
        if own is not None and own.numel() != numel:
            raise ValueError(f"{self.spec}: own holds {own.numel()} values, expected {numel}")
        self._decode_sum_encode(bufs, stride, nchunks, numel, dtype, own, own_index, out, sum_out)

    # -- implementation -------------------------------------------------------------------------
    def _decode_sum_encode(self, bufs, stride, nchunks, numel, dtype, own, own_index, out, sum_out) -> None:
        """`decode_sum_encode` on checked arguments; this reference decodes, sums and encodes with
        the codec's own calls (the group codecs hand it to their kernel backend)."""
        # codecs whose bytes do not depend on the dtype decode straight to fp32
        wire = torch.float32 if self.nbytes(numel, torch.float32) == self.nbytes(numel, dtype) else dtype
        size = self.nbytes(numel, dtype)
        sum_in_order(
            lambda k: self.decode(self.wrap(bufs[k * stride : k * stride + size], (numel,), wire)).float(),
            nchunks, own, own_index,
            lambda s, buf: self.encode(s if wire == torch.float32 else s.to(dtype), out=buf), out, sum_out,
        )  # fmt: skip

    def _encode_flat(self, x: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _decode_into(self, buf: torch.Tensor, y: torch.Tensor) -> None:
        """Decode `buf` into the flat contiguous `y` (its numel and dtype)."""
        y.copy_(self._decode_flat(buf, y.numel(), y.dtype))

    def __repr__(self) -> str:
        return f"<codec {self.spec}>"


def check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"codecs take float32/bfloat16/float16 tensors, got {x.dtype}: "
            "cast with x.float() (integer tensors should travel uncompressed, codec='none')"
        )


class AxisGrouped:
    """For codecs whose groups run along `Codec.axis`: the axis is moved last for encoding and moved
    back after decoding (data-driven reshaping); with the default axis, -1, nothing moves."""

    axis: int

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


def check_axis(codec: Codec, shape: torch.Size | tuple[int, ...]) -> None:
    """ValueError unless `codec.axis` names a dim of a tensor of `shape` (checked for 2+ dims; a
    1-D tensor is a flat chunk in grouping order, see `Codec.axis`)."""
    n, axis = len(shape), codec.axis
    if n >= 2 and not -n <= axis < n:
        raise ValueError(
            f"{codec.spec}: axis={axis} is out of range for a {n}-d tensor of shape {tuple(shape)}; "
            f"the grouping axis must be in [-{n}, {n - 1}] (rebuild the codec with a valid axis=)"
        )


def check_out(codec: Codec, out: torch.Tensor, packed: Packed) -> None:
    """`decode(out=)` must match the decoded tensor exactly: no broadcasting, casting or copying
    across devices behind the caller's back (host-side facts only: no device sync)."""
    want = f"shape {tuple(packed.shape)}, dtype {packed.dtype}, device {packed.data.device}"
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{codec.spec}: out must be a torch.Tensor of {want}, got {type(out).__name__}")
    if out.shape != packed.shape or out.dtype != packed.dtype or out.device != packed.data.device:
        raise ValueError(
            f"{codec.spec}: out must be a tensor of {want}, got shape {tuple(out.shape)}, dtype "
            f"{out.dtype}, device {out.device}; allocate it with torch.empty(packed.shape, "
            "dtype=packed.dtype, device=packed.data.device) or pass out=None for a new tensor"
        )


def positive_finite(codec: str, option: str, value: object, upper: float | None = None) -> float:
    """A codec's numeric option as a float: TypeError unless a real number (not bool), ValueError
    unless finite, > 0 and <= `upper` (when given)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{codec}: {option} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    bound = f" and <= {upper:g}" if upper is not None else ""
    if not (math.isfinite(v) and v > 0 and (upper is None or v <= upper)):
        raise ValueError(f"{codec}: {option} must be finite, > 0{bound}; got {option}={value!r}")
    return v


def f32_view(buf: torch.Tensor) -> torch.Tensor:
    """View uint8 bytes as fp32 (copying only if the slice is not 4-byte aligned)."""
    if buf.storage_offset() % 4 or buf.data_ptr() % 4:
        buf = buf.clone()
    return buf.view(torch.float32)


def finite_clamp(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast decoded fp32 values to `dtype`, saturating at dtype's largest finite value: a decoded value
    never overflows (fp16; bf16 and fp32 near their max, docs/codecs.md). NaN stays NaN."""
    fmax = torch.finfo(dtype).max
    return y.clamp(-fmax, fmax).to(dtype)  # clamp keeps NaN
