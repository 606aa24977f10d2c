"""Chunked sequence-parallel overlap: all-gather+matmul and matmul+reduce-scatter as rings
(docs/design.md 1.3 "Chunked sequence-parallel overlap").

Why this file exists: with SP, a column-parallel block waits for the whole all-gather of its input
before its GEMM, and a row-parallel layer finishes its whole GEMM before the reduce-scatter starts.
Cut the sequence into the TP group's N shards and each becomes a ring of N - 1 hops (send to
rank + 1, receive from rank - 1) whose every hop travels while a shard's GEMM runs:

    all-gather+matmul (rank r, step t = 0..N-1): shard j = r - t is in hand;
        post hop t (forward shard j to r + 1, receive shard j - 1), y[rows j] = x_j W^T, wait
    matmul+reduce-scatter (step t = 0..N-1): chunk j = r - 1 - t;
        p = (rows j of the local GEMM), acc = received + p (t > 0), post acc to r + 1 (t < N - 1)
        -> after N - 1 hops rank r holds the full sum of its own chunk r

With a codec each hop's message is compressed with the site's codec. The gather encodes each shard
once, at its owner, and forwards the same bytes, so every rank decodes every shard (its own too)
to the same values as the plain compressed all-gather. The reduce-scatter re-encodes a partial sum
at each hop: hop k carries the sum of k + 1 partials, so the final chunk carries N - 1 quantization
errors of growing partial sums (error RMS about sqrt(N / 2) times the plain reduce-scatter's, which
encodes each partial once; equal at N = 2). The transfers are `taco.comm.p2p.post` batches (one
send and one receive, async work handles): on gloo the hop runs under the GEMM, on NCCL it runs on
NCCL's stream, ordered after the current stream at posting and before it at `wait()` (no host sync).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from taco.comm.call import Call, tensor_bytes
from taco.comm.p2p import post

from .regions import SEQ_DIM, TPContext, comm_dtype_of


class _Ring:
    """One ring collective's peers, codec and statistics (resolved once per call)."""

    def __init__(self, ctx: TPContext, site: str, op: str, like: torch.Tensor, numel: int) -> None:
        self.ctx, self.n, self.r = ctx, ctx.size, ctx.rank
        g = ctx.group
        self.dst = dist.get_global_rank(g, (self.r + 1) % self.n) if g is not None else (self.r + 1) % self.n
        self.src = dist.get_global_rank(g, (self.r - 1) % self.n) if g is not None else (self.r - 1) % self.n
        policy = ctx.policy
        codec = policy.codec_for(site, numel, like.dtype) if policy is not None else None
        self.call = Call(op, like, g, codec, site, policy)  # statistics, observer, fallbacks
        self.codec = self.call.codec
        self.works: list[dist.Work] = []

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """What travels for x: its code (uint8) or x itself."""
        x = x.contiguous()
        if self.codec is None:
            return x
        with self.call.clock("encode_s"):
            return self.codec.encode(x).data.view(-1)

    def unpack(self, buf: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if self.codec is None:
            return buf
        with self.call.clock("decode_s"):
            return self.codec.decode(self.codec.wrap(buf, shape, dtype))

    def hop(self, buf: torch.Tensor) -> torch.Tensor:
        """Post `buf` to rank + 1 and a receive of the same size from rank - 1; returns the receive
        buffer (valid after `finish()`)."""
        got = torch.empty_like(buf)
        with self.call.clock("comm_s"):
            self.works = post([("send", buf, self.dst), ("recv", got, self.src)], self.ctx.group)
        return got

    def finish(self) -> None:
        with self.call.clock("comm_s"):
            for w in self.works:
                w.wait()
        self.works = []

    def done(self, out: torch.Tensor) -> torch.Tensor:
        """The result; counted by the site's sampled non-finite check when it is due (telemetry)."""
        if self.call.check:
            self.call.site.note_result(out)
        return out

    def account(self, raw: int, wire: int) -> None:
        self.call.account(raw * (self.n - 1), wire * (self.n - 1) if self.codec is not None else None)


def _rows(j: int, m: int) -> slice:
    return slice(j * m, (j + 1) * m)


def ring_gather(
    x: torch.Tensor, ctx: TPContext, site: str, on_shard: Callable[[int, torch.Tensor], None]
) -> torch.Tensor:
    """All-gather of x [b, s/N, ...] along the sequence dim, ring-style: `on_shard(j, x_j)` runs for
    each shard j (its own first) while the next one travels. Returns the gathered [b, s, ...]
    (decoded: equal on every rank)."""
    ring = _Ring(ctx, site, "all_gather", x, x.numel())
    if ctx.capture is not None:
        ctx.capture(site, x)
    m = x.shape[SEQ_DIM]
    shape = list(x.shape)
    shape[SEQ_DIM] *= ring.n
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    buf = ring.pack(x)
    ring.account(tensor_bytes(x), buf.numel() * buf.element_size())
    for t in range(ring.n):
        j = (ring.r - t) % ring.n
        nxt = ring.hop(buf) if t < ring.n - 1 else None  # shard j - 1 arrives while shard j computes
        xj = out.narrow(SEQ_DIM, j * m, m)
        xj.copy_(ring.unpack(buf, x.shape, x.dtype))
        on_shard(j, xj)
        if nxt is not None:
            ring.finish()
            buf = nxt
    return ring.done(out)


def ring_reduce_scatter(
    partial: Callable[[int], torch.Tensor],
    ctx: TPContext,
    site: str,
    full_numel: int,
    under_last: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Reduce-scatter along the sequence dim, ring-style: `partial(j)` is this rank's addend for
    chunk j ([b, s/N, ...]), computed while the previous hop travels; returns the sum of chunk r.
    With a codec the partial sums travel encoded and are summed in fp32 (`full_numel`: the elements
    of the plain reduce-scatter's input, for the policy's size threshold). `under_last` runs while
    the last hop travels (the weight gradients, in backward)."""
    n, r = ctx.size, ctx.rank
    ring: _Ring | None = None
    got = acc = None
    for t in range(n):
        j = (r - 1 - t) % n
        p = partial(j)
        if ring is None:
            ring = _Ring(ctx, site, "reduce_scatter", p, full_numel)
            if ctx.capture is not None:
                ctx.capture(site, p)
        if t == n - 1 and under_last is not None:
            under_last()
        if got is None:
            acc = p
        else:
            ring.finish()
            if ring.codec is None:
                acc = got + p
            else:
                acc = (ring.unpack(got, p.shape, p.dtype).float() + p.float()).to(p.dtype)
        if t < n - 1:
            buf = ring.pack(acc)
            if t == 0:
                ring.account(tensor_bytes(p), buf.numel() * buf.element_size())
            got = ring.hop(buf)
    return ring.done(acc)


def linear_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for rows x [..., in] (a 2-D GEMM of the flattened rows, as F.linear)."""
    y = x.reshape(-1, x.shape[-1]).mm(w.t())
    if b is not None:
        y = y + b
    return y.view(*x.shape[:-1], w.shape[0])


def _gemm_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast's F.linear would compute in (None: autocast off)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


class _ChunkedColumn(torch.autograd.Function):
    """forward: all-gather+matmul ring (y_i = x W_i^T + b_i for each column linear i of the block,
    shard by shard); backward: matmul+reduce-scatter ring of the input gradient, dW_i = g_i^T x
    from the gathered (decoded) input."""

    @staticmethod
    def forward(fctx, x, ctx, site, biases, *params):
        fctx.set_materialize_grads(False)
        fctx.ctx, fctx.site, fctx.biases, fctx.x_dtype = ctx, site, biases, x.dtype
        ws, bs, k = [], [], 0
        for has_bias in biases:
            ws.append(params[k])
            bs.append(params[k + 1] if has_bias else None)
            k += 2 if has_bias else 1
        gd = _gemm_dtype(x)
        m = x.shape[SEQ_DIM]
        ys: list[torch.Tensor] = []

        def on_shard(j: int, xj: torch.Tensor) -> None:  # rows j of every output
            xj = xj.to(gd or x.dtype)
            for i, (w, b) in enumerate(zip(ws, bs)):
                w2, b2 = (w.to(gd), b.to(gd) if b is not None else None) if gd else (w, b)
                yj = linear_rows(xj, w2, b2)  # [b, s/N, out_i/N]
                if not ys or len(ys) <= i:
                    shape = list(yj.shape)
                    shape[SEQ_DIM] *= ctx.size
                    ys.append(yj.new_empty(shape))
                ys[i].narrow(SEQ_DIM, j * m, m).copy_(yj)

        with torch.autocast(x.device.type, enabled=False):
            full = ring_gather(x.to(comm_dtype_of(x, ctx)), ctx, site + ".fwd", on_shard).to(x.dtype)
        fctx.save_for_backward(full, *ws)
        fctx.dtypes = [p.dtype for p in params]
        return (full, *ys)

    @staticmethod
    def backward(fctx, gx, *gys):
        full, *ws = fctx.saved_tensors
        ctx = fctx.ctx
        n = ctx.size
        m = full.shape[SEQ_DIM] // n
        cdt = comm_dtype_of(full, ctx)

        def partial(j: int) -> torch.Tensor:  # this rank's input-gradient addend for chunk j
            acc = None if gx is None else gx.narrow(SEQ_DIM, j * m, m).float()
            for g, w in zip(gys, ws):
                if g is None:
                    continue
                gj = g.narrow(SEQ_DIM, j * m, m)
                dj = gj.reshape(-1, gj.shape[-1]).mm(w.to(g.dtype)).view(*gj.shape[:-1], w.shape[1])
                acc = dj if acc is None else acc + dj
            if acc is None:
                acc = full.new_zeros((*full.shape[:SEQ_DIM], m, *full.shape[SEQ_DIM + 1 :]))
            return acc.to(cdt)

        grads: list[torch.Tensor | None] = []

        def weight_grads() -> None:  # dW_i = g_i^T x, db_i = sum g_i (the plain path's GEMMs)
            x2 = full.reshape(-1, full.shape[-1])  # [b*s, in]
            for g, has_bias in zip(gys, fctx.biases):
                g2 = None if g is None else g.reshape(-1, g.shape[-1])  # [b*s, out_i/N]
                j = len(grads)
                grads.append(None if g2 is None else g2.t().mm(x2.to(g2.dtype)).to(fctx.dtypes[j]))
                if has_bias:
                    grads.append(None if g2 is None else g2.sum(0).to(fctx.dtypes[j + 1]))

        dx = None
        if fctx.needs_input_grad[0]:  # the weight gradients run under the ring's last hop
            dx = ring_reduce_scatter(partial, ctx, fctx.site + ".bwd", full.numel(), weight_grads)
            dx = dx.to(fctx.x_dtype)
        if not grads:
            weight_grads()
        return (dx, None, None, None, *grads)


class _ChunkedRow(torch.autograd.Function):
    """forward: matmul+reduce-scatter ring (x W^T, chunk by chunk of the sequence); backward:
    all-gather+matmul ring of the output gradient (dx rows j = g_j W), dW = g^T x."""

    @staticmethod
    def forward(fctx, x, weight, ctx, site):
        fctx.ctx, fctx.site = ctx, site
        gd = _gemm_dtype(x)
        n = ctx.size
        s = x.shape[SEQ_DIM]
        if s % n:
            raise ValueError(f"sequence parallelism needs the sequence length ({s}) divisible by tp ({n})")
        m = s // n
        w = weight.to(gd) if gd else weight
        cdt = comm_dtype_of(x, ctx)
        out_dtype = gd or x.dtype

        def partial(j: int) -> torch.Tensor:
            xj = x.narrow(SEQ_DIM, j * m, m)
            return linear_rows(xj.to(w.dtype), w).to(cdt)  # [b, s/N, out]

        with torch.autocast(x.device.type, enabled=False):
            y = ring_reduce_scatter(partial, ctx, site + ".fwd", x[..., :1].numel() * weight.shape[0])
        fctx.save_for_backward(x, weight)
        fctx.gd = gd
        return y.to(out_dtype)

    @staticmethod
    def backward(fctx, g):
        x, weight = fctx.saved_tensors
        ctx = fctx.ctx
        m = g.shape[SEQ_DIM]
        w = weight.to(g.dtype)
        dx = torch.empty(x.shape, dtype=g.dtype, device=g.device)

        def on_shard(j: int, gj: torch.Tensor) -> None:  # rows j of the input gradient
            dj = gj.reshape(-1, gj.shape[-1]).mm(w)  # [b*s/N, in/N]
            dx.narrow(SEQ_DIM, j * m, m).copy_(dj.view(*gj.shape[:-1], w.shape[1]))

        full = ring_gather(g.to(comm_dtype_of(g, ctx)), ctx, fctx.site + ".bwd", on_shard).to(g.dtype)
        g2 = full.reshape(-1, full.shape[-1])  # [b*s, out]
        dw = g2.t().mm(x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(weight.dtype)  # [out, in/N]
        return dx.to(x.dtype), dw, None, None


def chunked_column(
    x: torch.Tensor, ctx: TPContext, site: str, layers: list
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Enter a column-parallel block with SP, ring-style: (gathered x [b, s, in], each layer's output
    [b, s, out_i/N]). forward: all-gather+matmul, backward: matmul+reduce-scatter (dim 1)."""
    params: list[torch.Tensor] = []
    biases: list[bool] = []
    for c in layers:
        params += [c.weight] + ([c.bias] if c.bias is not None else [])
        biases.append(c.bias is not None)
    full, *ys = _ChunkedColumn.apply(x, ctx, site, biases, *params)
    return full, ys


def chunked_row(x: torch.Tensor, weight: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """Leave a row-parallel layer with SP, ring-style: x [b, s, in/N] W^T reduce-scattered to
    [b, s/N, out]. forward: matmul+reduce-scatter, backward: all-gather+matmul (dim 1)."""
    return _ChunkedRow.apply(x, weight, ctx, site)
