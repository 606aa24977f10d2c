"""Tensor-parallel regions as autograd Functions (Megatron's mappings, arXiv 1909.08053/2205.05198).

Each Function's backward calls its dual, so each pairing is written once. The collectives go
through `taco.comm` with a named site, so the policy chooses a codec per site and the stats are
kept per site: `{site}.fwd` for the forward collective, `{site}.bwd` for the backward one.
Activations are [b, s, h]; sequence parallelism shards dim 1 (s).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from taco import comm

SEQ_DIM = 1
_KEYS = itertools.count(1)
_CONTEXTS: weakref.WeakValueDictionary[int, TPContext] = weakref.WeakValueDictionary()


@dataclass
class TPContext:
    """What a mapping needs: the TP group, the communication policy and whether SP is on."""

    group: dist.ProcessGroup | None
    policy: Any = None
    sp: bool = False
    capture: Callable[[str, torch.Tensor], None] | None = None
    """Called with (site, tensor) before each collective when set (sampling real TP tensors)."""
    comm_dtype: torch.dtype | None = None
    """Floating inputs of another dtype are cast to this before each collective and the result cast
    back (bf16 training communicates bf16 even where autocast left fp32); None: as they come."""
    overlap_wgrad: bool = True
    """Without SP: a column-parallel block's backward starts the all-reduce of its input gradient,
    computes the weight gradients while it is in flight, then waits (`column_block.py`)."""
    key: int = field(default_factory=lambda: next(_KEYS))
    """How a compiled graph names this context (`compiled_ops.py`: ops take ints, not objects)."""

    def __post_init__(self) -> None:
        _CONTEXTS[self.key] = self

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)


def context_of(key: int) -> TPContext:
    """The live `TPContext` whose `key` this is."""
    return _CONTEXTS[key]


def _op(name: str) -> Callable[..., torch.Tensor] | None:
    """The custom op `name` of `compiled_ops.py` while dynamo traces (one graph per block), else None."""
    if not torch.compiler.is_compiling():
        return None
    from . import compiled_ops

    return getattr(compiled_ops, name)


def _kw(ctx: TPContext, site: str) -> dict:
    # With a policy the policy picks the codec per site; without one, plain collectives.
    kw: dict = {"group": ctx.group, "site": site}
    if ctx.policy is None:
        kw["codec"] = None
    else:
        kw["policy"] = ctx.policy
    return kw


def _to_comm(x: torch.Tensor, ctx: TPContext, site: str) -> tuple[torch.Tensor, bool]:
    """x in the context's communication dtype (captured as it travels), and whether it was cast."""
    dtype = ctx.comm_dtype
    cast = dtype is not None and x.is_floating_point() and x.dtype != dtype
    y = x.to(dtype) if cast else x
    if ctx.capture is not None:
        ctx.capture(site, y)
    return y, cast


def _collective(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, ctx: TPContext, site: str, **kw: Any
) -> torch.Tensor:
    """Run one TP collective on `x` in the context's communication dtype (what travels is captured)."""
    y, cast = _to_comm(x, ctx, site)
    out = fn(y, **kw, **_kw(ctx, site))
    return out.to(x.dtype) if cast else out


def _all_reduce(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    return _collective(comm.all_reduce, x, ctx, site)


def start_tp_all_reduce(x: torch.Tensor, ctx: TPContext, site: str) -> Callable[[], torch.Tensor]:
    """Start the all-reduce `_all_reduce` would run (same dtype, capture, codec and bytes); the
    returned function waits for it and returns the sum in x's dtype."""
    y, cast = _to_comm(x, ctx, site)
    handle = comm.start_all_reduce(y, **_kw(ctx, site))
    return lambda: handle.wait().to(x.dtype) if cast else handle.wait()


def _all_gather(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    return _collective(comm.all_gather, x, ctx, site, dim=SEQ_DIM)


def _reduce_scatter(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    return _collective(comm.reduce_scatter, x, ctx, site, dim=SEQ_DIM)


def _split(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    s = x.shape[SEQ_DIM]
    if s % ctx.size:
        raise ValueError(f"sequence parallelism needs the sequence length ({s}) divisible by tp ({ctx.size})")
    return x.chunk(ctx.size, dim=SEQ_DIM)[ctx.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce."""

    @staticmethod
    def forward(fctx, x, ctx, site):
        fctx.ctx, fctx.site = ctx, site
        return x.view_as(x)

    @staticmethod
    def backward(fctx, g):
        return _all_reduce(g, fctx.ctx, fctx.site + ".bwd"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce; backward: identity."""

    @staticmethod
    def forward(fctx, x, ctx, site):
        return _all_reduce(x, ctx, site + ".fwd")

    @staticmethod
    def backward(fctx, g):
        return g, None, None


class _ScatterToSP(torch.autograd.Function):
    """forward: keep this rank's sequence slice; backward: all-gather (dim 1)."""

    @staticmethod
    def forward(fctx, x, ctx, site):
        fctx.ctx, fctx.site = ctx, site
        return _split(x, ctx)

    @staticmethod
    def backward(fctx, g):
        return _all_gather(g, fctx.ctx, fctx.site + ".bwd"), None, None


class _GatherFromSP(torch.autograd.Function):
    """forward: all-gather (dim 1); backward: reduce-scatter (dim 1)."""

    @staticmethod
    def forward(fctx, x, ctx, site):
        fctx.ctx, fctx.site = ctx, site
        return _all_gather(x, ctx, site + ".fwd")

    @staticmethod
    def backward(fctx, g):
        return _reduce_scatter(g, fctx.ctx, fctx.site + ".bwd"), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """forward: reduce-scatter (dim 1); backward: all-gather (dim 1)."""

    @staticmethod
    def forward(fctx, x, ctx, site):
        fctx.ctx, fctx.site = ctx, site
        return _reduce_scatter(x, ctx, site + ".fwd")

    @staticmethod
    def backward(fctx, g):
        return _all_gather(g, fctx.ctx, fctx.site + ".bwd"), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """forward: identity, backward: all-reduce. Input of column-parallel layers without SP."""
    if ctx.size == 1:
        return x
    op = _op("tp_copy_in")
    return _CopyToTP.apply(x, ctx, site) if op is None else op(x, ctx.key, site)


def reduce_from_tensor_parallel_region(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """forward: all-reduce, backward: identity. Output of row-parallel layers without SP."""
    if ctx.size == 1:
        return x
    op = _op("tp_reduce_out")
    return _ReduceFromTP.apply(x, ctx, site) if op is None else op(x, ctx.key, site)


def scatter_to_sequence_parallel_region(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """forward: split along s, backward: all-gather (dim 1). Entry into the SP region."""
    if ctx.size == 1:
        return x
    op = _op("sp_scatter_in")
    return _ScatterToSP.apply(x, ctx, site) if op is None else op(x, ctx.key, site)


def gather_from_sequence_parallel_region(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """forward: all-gather (dim 1), backward: reduce-scatter (dim 1). Input of column-parallel with SP."""
    if ctx.size == 1:
        return x
    op = _op("sp_gather_in")
    return _GatherFromSP.apply(x, ctx, site) if op is None else op(x, ctx.key, site)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """forward: reduce-scatter (dim 1), backward: all-gather (dim 1). Output of row-parallel with SP."""
    if ctx.size == 1:
        return x
    op = _op("sp_reduce_scatter_out")
    return _ReduceScatterToSP.apply(x, ctx, site) if op is None else op(x, ctx.key, site)


def tp_input(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """Enter a column-parallel block: all-gather with SP, else identity (all-reduce in backward)."""
    if ctx.sp:
        return gather_from_sequence_parallel_region(x, ctx, site)
    return copy_to_tensor_parallel_region(x, ctx, site)


def tp_output(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """Leave a row-parallel block: reduce-scatter with SP, else all-reduce."""
    if ctx.sp:
        return reduce_scatter_to_sequence_parallel_region(x, ctx, site)
    return reduce_from_tensor_parallel_region(x, ctx, site)
