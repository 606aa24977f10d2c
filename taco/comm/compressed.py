"""The compressed algorithms of docs/design.md 1.3 as step generators (see `handles.py`).

Why this file exists: it is the only place that lays encoded chunks into uint8 buffers and moves
them with stock torch.distributed collectives; `collectives.py` only chooses between this and
the plain collective. Every payload travels as uint8 (gloo rejects float8), chunk i of a send
buffer at a 16-byte aligned offset (what the Triton kernels read and write without a copy, whatever
the group count), and FP8 values are never summed: a rank decodes what it
receives, sums in fp32 and, for all-reduce, re-encodes.

The real path is the fused path: per slice and rank one `encode_chunks` (every destination chunk),
one `decode_sum_encode` (own chunk exact, fp32 sum in rank order) and one `decode_chunks` straight
into the output; codecs run these through their one kernel backend (`taco.codec.backend`).
On CUDA every codec kernel and transfer of a call runs on the codec side stream of its (device,
communicator) (`streams.Lane`), ordered after the caller's stream by an event at the start
and before it at the end; tensors crossing streams are `record_stream`ed. On gloo the same
schedule runs on async work.

Bytes per rank with N ranks and a message of n elements encoding to C(n) bytes:
all-reduce (two-shot) 2 (N-1)/N C(n) against the ring's 2 (N-1)/N of the raw bytes;
reduce-scatter (N-1)/N C(n); all-gather (N-1) C(n_shard); send C(n).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..codec import Codec
from ..codec.backend import Span
from .buffers import BufferCache
from .handles import Steps
from .stats import Clock, SiteStats
from .streams import Lane, communicator

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
        # reused only by calls of this communicator: its side stream orders every use (buffers.py)
        return self.buffers.take(role, nbytes, device, lane=communicator(self.group))

    def give(self, role: str, buf: torch.Tensor) -> None:
        self.buffers.give(role, buf)

    def sent(self, nbytes: int) -> None:
        if self.site is not None:
            self.site.wire_bytes += nbytes


ALIGN = 16
"""byte alignment of every chunk in a send/receive buffer (docs/design.md 1.3)"""


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to `ALIGN`: chunk offsets in a buffer stay 16-byte aligned."""
    return (nbytes + ALIGN - 1) & ~(ALIGN - 1)


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


class AllReduceSlice:
    """Two-shot all-reduce of one slice (docs/design.md 1.3): three codec calls per rank.

    The slice is one range of `src`/`dst` per rank: `ranges[j] = (offset, size)` is the part
    of rank j's chunk that rank j reduces.
    encode: ranges j != rank, one `encode_chunks` into the all-to-all send buffer
    reduce:  one `decode_sum_encode` of the N-1 received copies of own range and its raw values
             (fp32 sum in rank order) into the all-gather send buffer
    decode:  one `decode_chunks` of all N ranges, own included, straight into `dst`, so every
             rank returns the same values
    Each element is quantized at most twice whatever N is.
    """

    def __init__(self, ctx: Ctx, src: torch.Tensor, dst: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        self.ctx, self.src, self.dst, self.ranges = ctx, src, dst, ranges
        self.sizes = [size for _, size in ranges]
        self.nb = [ctx.codec.nbytes(s, src.dtype) if s else 0 for s in self.sizes]
        self.pb = [aligned(b) for b in self.nb]
        self.pmax = max(self.pb)
        self.send: torch.Tensor | None = None

    def encode(self) -> None:
        ctx, r, dev = self.ctx, self.ctx.rank, self.src.device
        self.in_splits = [0 if j == r else self.pb[j] for j in range(ctx.world)]
        self.out_splits = [0 if j == r else self.pb[r] for j in range(ctx.world)]
        self.send = ctx.take("a2a.send", sum(self.in_splits), dev)
        spans: list[Span] = []
        off = 0
        for j in range(ctx.world):
            if j != r and self.sizes[j]:
                spans.append((self.ranges[j][0], self.sizes[j], off))
            off += self.in_splits[j]
        with ctx.clock("encode_s"):
            ctx.codec.encode_chunks(self.src, self.send, spans)

    def exchange(self) -> None:
        ctx = self.ctx
        self.recv = ctx.take("a2a.recv", sum(self.out_splits), self.src.device)
        with ctx.clock("comm_s"):
            self.work = dist.all_to_all_single(
                self.recv, self.send, self.out_splits, self.in_splits, group=ctx.group, async_op=True
            )
        ctx.sent(sum(self.in_splits))

    def reduce(self) -> None:
        ctx, r = self.ctx, self.ctx.rank
        with ctx.clock("comm_s"):
            self.work.wait()
        ctx.give("a2a.send", self.send)
        self.ag_send = ctx.take("ag.send", self.pmax, self.src.device)
        self.ag_recv = ctx.take("ag.recv", self.pmax * ctx.world, self.src.device)
        if self.sizes[r]:
            off, size = self.ranges[r]
            with ctx.clock("decode_s"):  # decode N-1, fp32 sum with own, re-encode: one pass
                ctx.codec.decode_sum_encode(
                    self.recv, self.pb[r], ctx.world - 1, size, self.src.dtype,
                    own=self.src[off : off + size], own_index=r, out=self.ag_send[: self.nb[r]],
                )  # fmt: skip
        ctx.give("a2a.recv", self.recv)
        with ctx.clock("comm_s"):
            self.work = all_gather_into(self.ag_recv, self.ag_send, group=ctx.group, async_op=True)
        ctx.sent(self.pmax * (ctx.world - 1))

    def decode(self) -> None:
        ctx = self.ctx
        with ctx.clock("comm_s"):
            self.work.wait()
        spans = [(off, size, j * self.pmax) for j, (off, size) in enumerate(self.ranges) if size]
        with ctx.clock("decode_s"):
            codec, k, f16 = ctx.codec, max(self.sizes), torch.float16
            if self.src.dtype == f16 and codec.nbytes(k, torch.float32) == codec.nbytes(k, f16):
                # the encoded values are fp32 sums: cast like the plain collective's sum (inf beyond
                # 65504), not saturated as a decode of fp16 values would be (`finite_clamp`)
                lo, hi = self.ranges[0][0], self.ranges[-1][0] + self.sizes[-1]
                tmp = torch.empty(hi - lo, dtype=torch.float32, device=self.dst.device)
                codec.decode_chunks(self.ag_recv, tmp, [(o - lo, k, b) for o, k, b in spans])
                place(self.dst, tmp, lo, spans)
            else:
                ctx.codec.decode_chunks(self.ag_recv, self.dst, spans)
        ctx.give("ag.send", self.ag_send)
        ctx.give("ag.recv", self.ag_recv)


def place(dst: torch.Tensor, tmp: torch.Tensor, lo: int, spans: list[Span]) -> None:
    """dst[o : o + k] = tmp[o - lo : o - lo + k] for every span (o, k, _): one strided copy per run of
    equal chunks at one stride (a slice's chunks but a shorter last one: at most two copies)."""
    i = 0
    while i < len(spans):
        o, k, _ = spans[i]
        d = spans[i + 1][0] - o if i + 1 < len(spans) else 0
        j = i + 1
        while j < len(spans) and spans[j][1] == k and spans[j][0] - spans[j - 1][0] == d:
            j += 1
        shape, stride = (j - i, k), (d, 1)
        dst.as_strided(shape, stride, dst.storage_offset() + o).copy_(
            tmp.as_strided(shape, stride, tmp.storage_offset() + o - lo)
        )
        i = j


def slice_ranges(numel: int, world: int, slices: int, unit: int) -> list[list[tuple[int, int]]]:
    """Per slice, one (offset, size) range per rank: rank j's chunk cut into `slices` parts.

    Chunks (one per rank) and their parts start on multiples of `unit`, so every element keeps
    its owner and its codec group whatever `slices` is; empty slices are dropped. Every chunk is
    cut at the same offsets (those of a full chunk; a shorter last chunk has shorter or empty
    parts), so a slice's ranges lie at one stride: one kernel launch serves them all.
    """
    chunks = split_sizes(numel, world, unit)
    starts = [sum(chunks[:j]) for j in range(world)]
    step = split_sizes(chunks[0], slices, unit)[0] if chunks[0] else 0
    out = []
    for s in range(slices):
        cut = s * step
        ranges = [(start + min(cut, c), max(0, min(step, c - cut))) for start, c in zip(starts, chunks)]
        if any(size for _, size in ranges):
            out.append(ranges)
    return out


def all_reduce_steps(ctx: Ctx, src: torch.Tensor, dst: torch.Tensor, slices: int) -> Steps:
    """Pipelined two-shot all-reduce of the 1-D `src` into the 1-D `dst` (both contiguous).

    Issue order, identical on every rank: encode 0, all-to-all 0, encode 1 (while 0 is on the
    wire); then per slice i: reduce i + its all-gather, the all-to-all of i+1 (so slice i's
    all-gather is not queued behind every later all-to-all), encode i+2, decode i-1 (while
    the all-gather of i is in flight). Every element has the same owner, codec group and
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
    lane = Lane(src.device, ctx.group)
    lane.used_here(src, dst)
    with lane.run():
        parts[0].encode()
        parts[0].exchange()
        if len(parts) > 1:
            parts[1].encode()
    yield
    with lane.run():
        for i, p in enumerate(parts):
            p.reduce()
            if i + 1 < len(parts):
                parts[i + 1].exchange()
            if i + 2 < len(parts):
                parts[i + 2].encode()
            if i:
                parts[i - 1].decode()
        parts[-1].decode()
    lane.join()
    return dst


def gather_all_reduce_steps(ctx: Ctx, src: torch.Tensor, dst: torch.Tensor, slices: int) -> Steps:
    """All-reduce as all-gathers of every rank's whole encoded message (docs/design.md 1.3):
    encode -> all-gather -> fp32 sum of the N decoded messages in rank order, per slice.

    Two codec calls per slice and rank: one `encode_chunks` into the all-gather buffer and, after
    the all-gather, one `decode_sum_encode` of the N gathered parts (own included, as received)
    straight into `dst`. Every rank decodes the same bytes and sums them in the same order, so
    every rank returns the same values; each element is quantized once. Bytes per rank
    (N-1) C(n): for N = 2 what the two-shot sends, in one collective per slice instead of two,
    hence `algo="auto"` takes it on two ranks. Issue order: every slice's encode and all-gather;
    in `wait()`, per slice: wait, decode-sum (while later slices are on the wire). Slices start
    on codec group boundaries, so the result does not depend on them (codecs with one scale per
    message are never sliced). fp16: the fp32 sum is cast as the plain collective's (inf beyond
    65504).
    """
    codec, n, w, dev = ctx.codec, src.numel(), ctx.world, src.device
    sizes = [k for k in split_sizes(n, slices if per_group(codec) else 1, group_unit(codec)) if k]
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    pbs = [aligned(codec.nbytes(k, src.dtype)) for k in sizes]
    bos = [sum(pbs[:i]) for i in range(len(sizes))]
    lane = Lane(dev, ctx.group)
    lane.used_here(src, dst)
    with lane.run():
        send = ctx.take("ag.send", sum(pbs), dev)
        recv = ctx.take("ag.recv", sum(pbs) * w, dev)  # slice i: rank j's part at w bos[i] + j pbs[i]
        works = []
        for off, k, pb, bo in zip(offs, sizes, pbs, bos):
            with ctx.clock("encode_s"):
                codec.encode_chunks(src, send, [(off, k, bo)])
            with ctx.clock("comm_s"):
                mine, theirs = send[bo : bo + pb], recv[w * bo : w * (bo + pb)]
                works.append(all_gather_into(theirs, mine, group=ctx.group, async_op=True))
            ctx.sent(pb * (w - 1))
    yield
    with lane.run():
        total = dst if src.dtype != torch.float16 else torch.empty(n, dtype=torch.float32, device=dev)
        for i, (off, k, pb, bo) in enumerate(zip(offs, sizes, pbs, bos)):
            with ctx.clock("comm_s"):
                works[i].wait()
            with ctx.clock("decode_s"):  # the N parts of slice i lie pb apart, in rank order
                codec.decode_sum_encode(recv[w * bo :], pb, w, k, src.dtype, sum_out=total[off : off + k])
        if total is not dst:
            dst.copy_(total)
        ctx.give("ag.send", send)
        ctx.give("ag.recv", recv)
    lane.join()
    return dst


def grouping_layout(codec: Codec, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int, int | None]:
    """(x with the codec's grouping axis last, where `dim` went, the axis to move back or None)."""
    axis = codec.axis % max(x.dim(), 1)
    if x.dim() < 2 or axis == x.dim() - 1:
        return x, dim, None
    moved_dim = x.dim() - 1 if dim == axis else dim - (dim > axis)
    return x.movedim(axis, -1), moved_dim, axis


def stacked(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """x's N pieces along dim laid out one after another: a view when every dim before `dim` has
    size 1, else the one copy an inner dim needs. Returns [N, piece...] contiguous."""
    m = x.shape[dim] // n
    return x.unflatten(dim, (n, m)).movedim(dim, 0).contiguous()


def reduce_scatter_steps(ctx: Ctx, x: torch.Tensor, dim: int) -> Steps:
    """One encode of the N-1 pieces of x along dim -> all-to-all -> one decode-sum (own piece
    exact, fp32 sum in rank order) straight into the result (fp16: through fp32, inf on overflow)."""
    n, r, dev = ctx.world, ctx.rank, x.device
    lane = Lane(dev, ctx.group)
    lane.used_here(x)
    with lane.run():
        xm, d, axis = grouping_layout(ctx.codec, x, dim)
        pieces = stacked(xm, d, n)
        m = pieces[0].numel()
        flat = pieces.view(-1)
        nb = ctx.codec.nbytes(m, x.dtype)
        pb = aligned(nb)
        splits = [0 if j == r else pb for j in range(n)]
        send = ctx.take("a2a.send", pb * (n - 1), dev)
        recv = ctx.take("a2a.recv", pb * (n - 1), dev)
        spans = [(j * m, m, (j - (j > r)) * pb) for j in range(n) if j != r]
        with ctx.clock("encode_s"):
            ctx.codec.encode_chunks(flat, send, spans)
        with ctx.clock("comm_s"):
            work = dist.all_to_all_single(recv, send, splits, splits, group=ctx.group, async_op=True)
        ctx.sent(pb * (n - 1))
    yield
    with lane.run():
        with ctx.clock("comm_s"):
            work.wait()
        ctx.give("a2a.send", send)
        out = torch.empty(pieces.shape[1:], dtype=x.dtype, device=dev)
        total = out if x.dtype != torch.float16 else torch.empty(out.shape, dtype=torch.float32, device=dev)
        with ctx.clock("decode_s"):
            own = flat[r * m : (r + 1) * m]
            sums = total.view(-1)
            ctx.codec.decode_sum_encode(recv, pb, n - 1, m, x.dtype, own=own, own_index=r, sum_out=sums)
            if total is not out:
                out.copy_(total)
        ctx.give("a2a.recv", recv)
        if axis is not None:
            out = out.movedim(-1, axis).contiguous()
    lane.join(out)
    return out


def all_gather_steps(ctx: Ctx, x: torch.Tensor, dim: int) -> Steps:
    """One encode of own shard -> all-gather the buffers -> one decode of every shard (own too)
    straight into the result when dim is outermost (else into the stacked shards, then placed)."""
    n, dev = ctx.world, x.device
    lane = Lane(dev, ctx.group)
    lane.used_here(x)
    with lane.run():
        xm, d, axis = grouping_layout(ctx.codec, x, dim)
        xc = xm.contiguous()
        m = xc.numel()
        nb = ctx.codec.nbytes(m, x.dtype)
        pb = aligned(nb)
        send = ctx.take("ag.send", pb, dev)
        recv = ctx.take("ag.recv", pb * n, dev)
        with ctx.clock("encode_s"):
            ctx.codec.encode_chunks(xc.view(-1), send, [(0, m, 0)])
        with ctx.clock("comm_s"):
            work = all_gather_into(recv, send, group=ctx.group, async_op=True)
        ctx.sent(pb * (n - 1))
    yield
    with lane.run():
        with ctx.clock("comm_s"):
            work.wait()
        shape = list(xm.shape)
        shape[d] *= n
        out = torch.empty(shape, dtype=x.dtype, device=dev)
        leading = xm.shape[:d].numel() == 1
        dst = out if leading else torch.empty((n, *xm.shape), dtype=x.dtype, device=dev)
        with ctx.clock("decode_s"):
            ctx.codec.decode_chunks(recv, dst.view(-1), [(j * m, m, j * pb) for j in range(n)])
            if not leading:
                out.unflatten(d, (n, xm.shape[d])).copy_(dst.movedim(0, d))
        ctx.give("ag.send", send)
        ctx.give("ag.recv", recv)
        if axis is not None:
            out = out.movedim(-1, axis).contiguous()
    lane.join(out)
    return out
