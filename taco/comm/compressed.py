"""The compressed algorithms of docs/design.md 1.3 as step generators (see `handles.py`).

Why this file exists: it is the only place that lays encoded chunks into uint8 buffers and moves
them with stock torch.distributed collectives; `collectives.py` only chooses between this and
the plain collective. Every payload travels as uint8 (gloo rejects float8), chunk i of a send
buffer at a 4-byte aligned offset, and FP8 values are never summed: a rank decodes what it
receives, sums in fp32 and, for all-reduce, re-encodes.

Bytes per rank with N ranks and a message of n elements encoding to C(n) bytes:
all-reduce (two-shot) 2 (N-1)/N C(n) against the ring's 2 (N-1)/N of the raw bytes;
reduce-scatter (N-1)/N C(n); all-gather (N-1) C(n_shard); send C(n).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..codec import Codec
from .buffers import BufferCache
from .handles import Steps
from .stats import Clock, SiteStats

# torch >= 2.13 renamed the *_tensor collectives to *_single (the old names warn); same collectives.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Ctx:
    """Everything one compressed call needs besides its tensors."""

    group: dist.ProcessGroup | None
    world: int
    rank: int
    """rank within `group`"""
    codec: Codec
    name: str
    """the site name, or the op name for calls without a site"""
    site: SiteStats | None
    clock: Clock
    buffers: BufferCache

    def take(self, role: str, nbytes: int, device: torch.device) -> torch.Tensor:
        return self.buffers.take(role, nbytes, device)

    def give(self, role: str, buf: torch.Tensor) -> None:
        self.buffers.give(role, buf)

    def sent(self, nbytes: int) -> None:
        if self.site is not None:
            self.site.wire_bytes += nbytes


def aligned(nbytes: int) -> int:
    return (nbytes + 3) & ~3


def group_unit(codec: Codec) -> int:
    """Chunk boundaries fall on multiples of this, so chunking never splits a codec group."""
    g = getattr(codec, "group_size", None)
    return g if isinstance(g, int) and g > 0 else 16


def per_group(codec: Codec) -> bool:
    """Whether each group's code depends on that group only (else one scale spans the message)."""
    g = getattr(codec, "group_size", None)
    return isinstance(g, int) and g > 0


def split_sizes(numel: int, parts: int, unit: int) -> list[int]:
    """`parts` contiguous sizes summing to numel: equal multiples of `unit`, the rest ragged/empty."""
    per = -(-numel // parts)
    per = -(-per // unit) * unit
    sizes = []
    for _ in range(parts):
        sizes.append(min(per, numel))
        numel -= sizes[-1]
    return sizes


def acc_dtype(codec: Codec, numel: int, dtype: torch.dtype) -> torch.dtype:
    """fp32 when the codec's bytes do not depend on the dtype (decode straight to fp32 for sums)."""
    return torch.float32 if codec.nbytes(numel, torch.float32) == codec.nbytes(numel, dtype) else dtype


def _decode(codec: Codec, buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return codec.decode(codec.wrap(buf, shape, dtype))


class AllReduceSlice:
    """Two-shot all-reduce of one slice (docs/design.md 1.3), in three steps.

    The slice is one range of `src`/`dst` per rank: `ranges[j] = (offset, size)` is the part
    of rank j's chunk that rank j reduces.
    start:  encode ranges j != rank -> all-to-all (range j to rank j)
    middle: decode the N-1 received copies of own range, fp32 sum in rank order (own values
            exact), re-encode -> all-gather (padded to the largest range)
    finish: decode all N ranges, own included, so every rank returns the same values
    Each element is quantized at most twice whatever N is.
    """

    def __init__(self, ctx: Ctx, src: torch.Tensor, dst: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        self.ctx, self.src, self.dst, self.ranges = ctx, src, dst, ranges
        self.sizes = [size for _, size in ranges]
        self.nb = [ctx.codec.nbytes(s, src.dtype) if s else 0 for s in self.sizes]
        self.pb = [aligned(b) for b in self.nb]
        self.pmax = max(self.pb)
        self.sum_dtype = acc_dtype(ctx.codec, max(self.sizes), src.dtype)

    def chunk(self, t: torch.Tensor, j: int) -> torch.Tensor:
        off, size = self.ranges[j]
        return t[off : off + size]

    def start(self) -> None:
        ctx, r, dev = self.ctx, self.ctx.rank, self.src.device
        self.in_splits = [0 if j == r else self.pb[j] for j in range(ctx.world)]
        self.out_splits = [0 if j == r else self.pb[r] for j in range(ctx.world)]
        self.send = ctx.take("a2a.send", sum(self.in_splits), dev)
        self.recv = ctx.take("a2a.recv", sum(self.out_splits), dev)
        with ctx.clock("encode_s"):
            off = 0
            for j in range(ctx.world):
                if j != r and self.sizes[j]:
                    ctx.codec.encode(self.chunk(self.src, j), out=self.send[off : off + self.nb[j]])
                off += self.in_splits[j]
        with ctx.clock("comm_s"):
            self.work = dist.all_to_all_single(
                self.recv, self.send, self.out_splits, self.in_splits, group=ctx.group, async_op=True
            )
        ctx.sent(sum(self.in_splits))

    def middle(self) -> None:
        ctx, r, dev = self.ctx, self.ctx.rank, self.src.device
        with ctx.clock("comm_s"):
            self.work.wait()
        ctx.give("a2a.send", self.send)
        with ctx.clock("decode_s"):
            acc = None
            for j in range(ctx.world):  # rank order: the same sum whatever the slicing
                if j == r:
                    term = self.chunk(self.src, r).to(torch.float32, copy=True)
                else:
                    o = (j - (j > r)) * self.pb[r]
                    buf = self.recv[o : o + self.nb[r]]
                    term = _decode(ctx.codec, buf, (self.sizes[r],), self.sum_dtype).to(torch.float32)
                acc = term if acc is None else acc.add_(term)
        ctx.give("a2a.recv", self.recv)
        self.ag_send = ctx.take("ag.send", self.pmax, dev)
        self.ag_recv = ctx.take("ag.recv", self.pmax * ctx.world, dev)
        with ctx.clock("encode_s"):
            if self.sizes[r]:
                if self.sum_dtype != torch.float32:
                    acc = acc.to(self.src.dtype)
                ctx.codec.encode(acc, out=self.ag_send[: self.nb[r]])
        with ctx.clock("comm_s"):
            self.work = all_gather_into(self.ag_recv, self.ag_send, group=ctx.group, async_op=True)
        ctx.sent(self.pmax * (ctx.world - 1))

    def finish(self) -> None:
        ctx = self.ctx
        # fp16: the encoded values are fp32 sums, cast like the plain collective's sum (inf beyond
        # 65504), not saturated as a decode of fp16 values would be (`finite_clamp`)
        via_fp32 = self.src.dtype == torch.float16 and self.sum_dtype == torch.float32
        with ctx.clock("comm_s"):
            self.work.wait()
        with ctx.clock("decode_s"):
            for j in range(ctx.world):
                if self.sizes[j]:
                    buf = self.ag_recv[j * self.pmax : j * self.pmax + self.nb[j]]
                    dst = self.chunk(self.dst, j)
                    if via_fp32:
                        dst.copy_(_decode(ctx.codec, buf, (self.sizes[j],), torch.float32))
                    else:
                        ctx.codec.decode(ctx.codec.wrap(buf, (self.sizes[j],), self.src.dtype), out=dst)
        ctx.give("ag.send", self.ag_send)
        ctx.give("ag.recv", self.ag_recv)


def slice_ranges(numel: int, world: int, slices: int, unit: int) -> list[list[tuple[int, int]]]:
    """Per slice, one (offset, size) range per rank: rank j's chunk cut into `slices` parts.

    Chunks (one per rank) and their parts start on multiples of `unit`, so every element keeps
    its owner and its codec group whatever `slices` is; empty slices are dropped.
    """
    chunks = split_sizes(numel, world, unit)
    starts = [sum(chunks[:j]) for j in range(world)]
    parts = [split_sizes(c, slices, unit) for c in chunks]
    out = []
    for s in range(slices):
        ranges = [(starts[j] + sum(parts[j][:s]), parts[j][s]) for j in range(world)]
        if any(size for _, size in ranges):
            out.append(ranges)
    return out


def all_reduce_steps(ctx: Ctx, src: torch.Tensor, dst: torch.Tensor, slices: int) -> Steps:
    """Pipelined two-shot all-reduce of the 1-D `src` into the 1-D `dst` (both contiguous).

    Issue order, identical on every rank: the all-to-all of every slice (encoding slice i+1
    while slice i is in flight), then per slice i: reduce + all-gather of i, decode of i-1
    (while the all-gather of i is in flight). Every element has the same owner, codec group and
    summation order as unsliced, so the result is bit-identical to `slices=1`. Codecs with one
    scale per message (fp8-tensor) are never sliced: a scale per slice would make an element's
    code depend on the slicing, so they run as `slices=1` (one scale per rank's chunk).
    fp16: the result is the fp32 sum cast to fp16, inf where it exceeds fp16's range, as the
    plain collective's sum; bf16 and fp32 sums beyond fp32's range make their group NaN.
    """
    if not per_group(ctx.codec):
        slices = 1
    unit = group_unit(ctx.codec)
    parts = [AllReduceSlice(ctx, src, dst, r) for r in slice_ranges(src.numel(), ctx.world, slices, unit)]
    for p in parts:
        p.start()
    yield
    for i, p in enumerate(parts):
        p.middle()
        if i:
            parts[i - 1].finish()
    parts[-1].finish()
    return dst


def reduce_scatter_steps(ctx: Ctx, x: torch.Tensor, dim: int) -> Steps:
    """Encode the N pieces of x along dim (own piece stays exact) -> all-to-all -> fp32 sum."""
    n, r, dev = ctx.world, ctx.rank, x.device
    m = x.shape[dim] // n
    pieces = [x.narrow(dim, j * m, m) for j in range(n)]
    nb = ctx.codec.nbytes(pieces[0].numel(), x.dtype)
    pb = aligned(nb)
    splits = [0 if j == r else pb for j in range(n)]
    send = ctx.take("a2a.send", pb * (n - 1), dev)
    recv = ctx.take("a2a.recv", pb * (n - 1), dev)
    with ctx.clock("encode_s"):
        for j in range(n):
            if j != r:
                o = (j - (j > r)) * pb
                ctx.codec.encode(pieces[j], out=send[o : o + nb])
    with ctx.clock("comm_s"):
        work = dist.all_to_all_single(recv, send, splits, splits, group=ctx.group, async_op=True)
    ctx.sent(pb * (n - 1))
    yield
    with ctx.clock("comm_s"):
        work.wait()
    ctx.give("a2a.send", send)
    shape = tuple(pieces[0].shape)
    acc = acc_dtype(ctx.codec, pieces[0].numel(), x.dtype)
    with ctx.clock("decode_s"):
        total = None
        for j in range(n):
            if j == r:
                term = pieces[r].to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            else:
                o = (j - (j > r)) * pb
                term = _decode(ctx.codec, recv[o : o + nb], shape, acc).to(torch.float32)
            total = term if total is None else total.add_(term)
        out = total if x.dtype == torch.float32 else total.to(x.dtype)
    ctx.give("a2a.recv", recv)
    return out


def all_gather_steps(ctx: Ctx, x: torch.Tensor, dim: int) -> Steps:
    """Encode own shard -> all-gather the buffers -> decode every shard (own too) along dim."""
    n, dev = ctx.world, x.device
    nb = ctx.codec.nbytes(x.numel(), x.dtype)
    pb = aligned(nb)
    send = ctx.take("ag.send", pb, dev)
    recv = ctx.take("ag.recv", pb * n, dev)
    with ctx.clock("encode_s"):
        ctx.codec.encode(x, out=send[:nb])
    with ctx.clock("comm_s"):
        work = all_gather_into(recv, send, group=ctx.group, async_op=True)
    ctx.sent(pb * (n - 1))
    yield
    with ctx.clock("comm_s"):
        work.wait()
    shape = list(x.shape)
    s = shape[dim]
    shape[dim] = s * n
    out = torch.empty(shape, dtype=x.dtype, device=dev)
    with ctx.clock("decode_s"):
        for j in range(n):
            packed = ctx.codec.wrap(recv[j * pb : j * pb + nb], x.shape, x.dtype)
            ctx.codec.decode(packed, out=out.narrow(dim, j * s, s))
    ctx.give("ag.send", send)
    ctx.give("ag.recv", recv)
    return out
