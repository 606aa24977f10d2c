"""Compressed collectives on stock torch.distributed: all_reduce, all_gather, reduce_scatter, send, recv.

Why this file exists: it is the public face of `taco.comm` (docs/design.md 2.1). Each function picks a
codec (the argument when given; else the policy, or "taco" without one), validates, and runs either
the plain torch.distributed collective (codec None/"none": bit-identical, on a copy) or the
compressed algorithm of `compressed.py`. Inputs are never modified; results are new tensors in
the input dtype. The plain path copies no more than the collective needs: all_reduce (in place in
torch.distributed) copies x once into its result; all_gather and reduce_scatter write straight
into a fresh result (one transposing copy when dim is not the leading dim); send/recv copy nothing
for contiguous tensors. A group of one rank returns a copy without communicating or quantizing.
Inputs the compressed path cannot serve (float64, sparse) take the plain collective with one
`taco.comm` log line per (site, reason).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..codec import CodecSpec
from .call import DEFAULT_CODEC, Call, Group, PolicyOrTaco, tensor_bytes
from .compressed import (
    all_gather_into,
    all_gather_steps,
    all_reduce_steps,
    gather_all_reduce_steps,
    reduce_scatter_into,
    reduce_scatter_steps,
)
from .handles import Handle, Steps
from .policy import CommPolicy, default_slices, resolve_all_reduce_algo


def _copy(x: torch.Tensor) -> torch.Tensor:
    if x.layout != torch.strided:  # sparse: no memory format
        return x.clone()
    return x.clone(memory_format=torch.contiguous_format)


def _copy_as(x: torch.Tensor) -> torch.Tensor:
    """A copy laid out in memory exactly as x (same strides, gaps included, zero-filled), so that a
    backend reducing in memory order sums it as it would sum x; contiguous where x is not strided
    or has overlapping (zero-stride) dims."""
    if x.layout != torch.strided or any(st == 0 and n > 1 for n, st in zip(x.shape, x.stride())):
        return _copy(x)
    if x.numel() == 0:
        return _copy(x)
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
    mem = x.new_empty(span) if span == x.numel() else x.new_zeros(span)  # no gaps: all overwritten
    return mem.as_strided(x.shape, x.stride()).copy_(x)


def _then(steps: Steps, fn: Callable[[torch.Tensor], torch.Tensor]) -> Steps:
    return fn((yield from steps))


def _dim(op: str, x: torch.Tensor, dim: int) -> int:
    if x.dim() == 0:
        raise ValueError(f"taco.comm.{op} needs a tensor with at least one dimension; use x.reshape(1)")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"taco.comm.{op}: dim={dim} is out of range for a {x.dim()}-d tensor")
    return dim % x.dim()


def _leading(x: torch.Tensor, dim: int) -> bool:
    """True when every dim before `dim` has size 1: splitting x along dim cuts its memory into
    consecutive blocks, so a plain gather/scatter along dim needs no transposing copy."""
    return math.prod(x.shape[:dim]) == 1


def all_reduce(
    x: torch.Tensor,
    group: Group = None,
    codec: CodecSpec | PolicyOrTaco = DEFAULT_CODEC,
    async_op: bool = False,
    *,
    site: str | None = None,
    policy: CommPolicy | None = None,
    slices: int | None = None,
    algo: str | None = None,
    donate: bool = False,
) -> torch.Tensor | Handle:
    """Sum of x over the group's ranks, the same on every rank (docs/design.md 1.3).

    x: any shape, bf16/fp16/fp32 (others go plain) -> a new tensor of x's shape and dtype.
    `algo`: the compressed algorithm, "two_shot", "gather" or "auto" (default: the policy's
    `all_reduce_algo`, else "auto": "gather" on two ranks, where it sends the two-shot's bytes in
    one collective per slice and quantizes each element once; else "two_shot").
    `slices=k` pipelines exactly k slices (encoding slice i+1 and decoding slice i-1 overlap
    slice i's transfer; k is capped so that no slice splits a codec group). Default: the
    policy's `slices_for(bytes)`, without a policy up to 4 slices of >= 1 MiB each, the measured
    best (numbers under `CommPolicy.slices`); one slice over NVLink-class links (`links.py`).
    Slicing never changes the result or the bytes.
    `donate=True`: the caller gives x up (a temporary nothing else reads): the plain collective sums
    in x's own memory and returns x itself, as Megatron's in-place all-reduce does, instead of a copy;
    the compressed paths leave x as it is.
    """
    call = Call("all_reduce", x, group, codec, site, policy)
    if slices is not None:
        k = slices
    else:
        nb, dev = tensor_bytes(x), x.device
        k = policy.slices_for(nb, dev, group) if policy else default_slices(nb, device=dev, group=group)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"slices must be an int >= 1, got {slices!r}")
    algo = algo if algo is not None else policy.all_reduce_algo if policy is not None else "auto"
    algo = resolve_all_reduce_algo(algo, call.world)
    if call.world == 1:
        return call.run(_copy(x), async_op)
    call.check_same(f" slices={k} algo={algo}" if call.codec is not None else "")
    n = call.world
    call.account(2 * (n - 1) * tensor_bytes(x) // n)
    if call.codec is None:  # x's own memory layout: the backend reduces in memory order, so a
        # transposed view copied contiguous would be summed in another order; a donated x is summed
        # in place
        out = x if donate and x.is_contiguous() else _copy_as(x)
        return call.run(call.issue(lambda: dist.all_reduce(out, group=group, async_op=True), out), async_op)
    if x.numel() == 0:
        return call.run(_copy(x), async_op)
    # Codecs that group along another axis (data-driven reshaping) see that axis last in memory.
    axis = call.codec.axis % max(x.dim(), 1)  # in range: checked by Call
    moved = x.dim() >= 2 and axis != x.dim() - 1
    xm = x.movedim(axis, -1) if moved else x
    src = xm.reshape(-1)
    dst = torch.empty(src.numel(), dtype=x.dtype, device=x.device)

    def shape_back(flat: torch.Tensor) -> torch.Tensor:
        y = flat.view(xm.shape)
        return y.movedim(-1, axis).contiguous() if moved else y

    if algo == "gather":
        steps = gather_all_reduce_steps(call.ctx(tensor_bytes(x)), src, dst, k)
    else:
        steps = all_reduce_steps(call.ctx(tensor_bytes(x)), src, dst, k)
    return call.run(_then(steps, shape_back), async_op)


def start_all_reduce(
    x: torch.Tensor,
    group: Group = None,
    codec: CodecSpec | PolicyOrTaco = DEFAULT_CODEC,
    *,
    site: str | None = None,
    policy: CommPolicy | None = None,
    slices: int | None = None,
    algo: str | None = None,
) -> Handle:
    """Start `all_reduce(x, ...)` and return its handle at once; `handle.wait()` returns the sum.

    The first transfer (the all-to-all or all-gather, or the plain all-reduce) is in flight on return: gloo
    async work; on CUDA the codec side stream, ordered by events (no host sync). Compute enqueued
    before `wait()` overlaps it (the TP backward's weight-gradient GEMMs, `column_block.py`).
    """
    return all_reduce(x, group, codec, async_op=True, site=site, policy=policy, slices=slices, algo=algo)


def all_gather(
    x: torch.Tensor,
    group: Group = None,
    codec: CodecSpec | PolicyOrTaco = DEFAULT_CODEC,
    dim: int = 0,
    *,
    async_op: bool = False,
    site: str | None = None,
    policy: CommPolicy | None = None,
) -> torch.Tensor | Handle:
    """Concatenation along dim of every rank's x (equal shapes), the same on every rank.

    x: [..., s, ...] -> [..., N*s, ...]; rank r's shard at [r*s, (r+1)*s) along dim (decoded,
    own shard included, so every rank holds the same values).
    """
    call = Call("all_gather", x, group, codec, site, policy)
    d = _dim("all_gather", x, dim)
    if call.world == 1:
        return call.run(_copy(x), async_op)
    call.check_same(f" dim={d}")
    n = call.world
    call.account((n - 1) * tensor_bytes(x))
    shape = list(x.shape)
    shape[d] *= n
    if call.codec is None:
        xc = x.contiguous()  # a copy only for a non-contiguous x
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        if _leading(x, d):  # the shards are consecutive blocks of the result: gather straight into it
            steps = call.issue(
                lambda: all_gather_into(out.view(-1), xc.view(-1), group=group, async_op=True), out
            )
            return call.run(steps, async_op)
        # dim d is inner: gather the shards stacked, then one copy puts them in place along d
        stacked = torch.empty((n, *x.shape), dtype=x.dtype, device=x.device)
        steps = call.issue(
            lambda: all_gather_into(stacked.view(-1), xc.view(-1), group=group, async_op=True), stacked
        )

        def place(t: torch.Tensor) -> torch.Tensor:
            out.unflatten(d, (n, x.shape[d])).copy_(t.movedim(0, d))
            return out

        return call.run(_then(steps, place), async_op)
    if x.numel() == 0:
        return call.run(x.new_empty(shape), async_op)
    return call.run(all_gather_steps(call.ctx(n * tensor_bytes(x)), x, d), async_op)


def reduce_scatter(
    x: torch.Tensor,
    group: Group = None,
    codec: CodecSpec | PolicyOrTaco = DEFAULT_CODEC,
    dim: int = 0,
    *,
    async_op: bool = False,
    site: str | None = None,
    policy: CommPolicy | None = None,
) -> torch.Tensor | Handle:
    """Sum over ranks, then this rank's slice along dim (x.shape[dim] divisible by N).

    x: [..., N*m, ...] -> [..., m, ...] = rows [r*m, (r+1)*m) of the sum. The rank's own piece
    enters the fp32 sum exact; the N-1 others are decoded.
    """
    call = Call("reduce_scatter", x, group, codec, site, policy)
    d = _dim("reduce_scatter", x, dim)
    n = call.world
    if x.shape[d] % n:
        raise ValueError(
            f"taco.comm.reduce_scatter: x.shape[{d}] = {x.shape[d]} is not divisible by the group "
            f"size {n}; pad it to a multiple of {n}"
        )
    if n == 1:
        return call.run(_copy(x), async_op)
    call.check_same(f" dim={d}")
    call.account((n - 1) * tensor_bytes(x) // n)
    shape = list(x.shape)
    shape[d] //= n
    if call.codec is None:
        if _leading(x, d):  # rank j's piece is already the j-th block of memory
            xt = x.contiguous()  # a copy only for a non-contiguous x
        else:  # lay the pieces out one after another: the one copy an inner dim needs
            xt = x.unflatten(d, (n, shape[d])).movedim(d, 0).contiguous()
        out = torch.empty(shape, dtype=x.dtype, device=x.device)  # the result, written in place
        steps = call.issue(
            lambda: reduce_scatter_into(out.view(-1), xt.view(-1), group=group, async_op=True), out
        )
        return call.run(steps, async_op)
    if x.numel() == 0:
        return call.run(x.new_empty(shape), async_op)
    return call.run(reduce_scatter_steps(call.ctx(tensor_bytes(x)), x, d), async_op)
