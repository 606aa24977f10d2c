"""Tensor-parallel regions as autograd Functions (Megatron's mappings, arXiv 1909.08053/2205.05198).

Each Function's backward calls its dual, so each pairing is written once. The collectives go
through `taco.comm` with a named site, so the policy chooses a codec per site and the stats are
kept per site: `{site}.fwd` for the forward collective, `{site}.bwd` for the backward one.
Activations are [b, s, h]; sequence parallelism shards dim 1 (s).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .regions import (
    TPContext,
    region_all_gather,
    region_all_reduce,
    region_reduce_scatter,
    region_split,
)


def _op(name: str) -> Callable[..., torch.Tensor] | None:
    """The custom op `name` of `compiled_ops.py` while dynamo traces (one graph per block), else None."""
    if not torch.compiler.is_compiling():
        return None
    from . import compiled_ops

    return getattr(compiled_ops, name)


Map = Callable[[torch.Tensor, TPContext, str], torch.Tensor]
"""one direction of a region: (tensor, context, site name with its .fwd/.bwd suffix) -> tensor"""


def _identity(t: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    return t.view_as(t)  # a view: autograd gives the region's output its own node


def _split(t: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    return region_split(t, ctx)  # a local slice: no collective, so no site


def _region(op_name: str, forward: Map, backward: Map, doc: str) -> Callable[..., torch.Tensor]:
    """A TP region: an autograd Function whose forward is `forward` and backward `backward` (each
    pairing written once), entered eagerly, or as the custom op `op_name` while dynamo traces."""

    class Region(torch.autograd.Function):
        @staticmethod
        def forward(fctx, x, ctx, site):
            fctx.ctx, fctx.site = ctx, site
            return forward(x, ctx, site + ".fwd")

        @staticmethod
        def backward(fctx, g):
            return backward(g, fctx.ctx, fctx.site + ".bwd"), None, None

    def region(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
        if ctx.size == 1:
            return x
        op = _op(op_name)
        return Region.apply(x, ctx, site) if op is None else op(x, ctx.key, site)

    region.__doc__ = doc
    return region


copy_to_tensor_parallel_region = _region(
    "tp_copy_in", _identity, region_all_reduce,
    "forward: identity, backward: all-reduce. Input of column-parallel layers without SP.",
)  # fmt: skip
scatter_to_sequence_parallel_region = _region(
    "sp_scatter_in", _split, region_all_gather,
    "forward: keep this rank's slice along s, backward: all-gather (dim 1). Entry into the SP region.",
)  # fmt: skip
gather_from_sequence_parallel_region = _region(
    "sp_gather_in", region_all_gather, region_reduce_scatter,
    "forward: all-gather (dim 1), backward: reduce-scatter (dim 1). Input of column-parallel with SP.",
)  # fmt: skip
reduce_scatter_to_sequence_parallel_region = _region(
    "sp_reduce_scatter_out", region_reduce_scatter, region_all_gather,
    "forward: reduce-scatter (dim 1), backward: all-gather (dim 1). Output of row-parallel with SP.",
)  # fmt: skip


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce (in x's memory when `donate` and plain); backward: identity."""

    @staticmethod
    def forward(fctx, x, ctx, site, donate):
        out = region_all_reduce(x, ctx, site + ".fwd", donate)
        if out is x:  # summed in place: autograd is told (an earlier use of x saved for backward raises)
            fctx.mark_dirty(x)
        return out

    @staticmethod
    def backward(fctx, g):
        return g, None, None, None


def reduce_from_tensor_parallel_region(
    x: torch.Tensor, ctx: TPContext, site: str, donate: bool = False
) -> torch.Tensor:
    """forward: all-reduce, backward: identity. Output of row-parallel layers without SP.
    `donate`: x is the caller's temporary (a GEMM's fresh output): the plain all-reduce sums it in
    place instead of copying it first."""
    if ctx.size == 1:
        return x
    op = _op("tp_reduce_out")
    return _ReduceFromTP.apply(x, ctx, site, donate) if op is None else op(x, ctx.key, site)


def tp_input(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """Enter a column-parallel block: all-gather with SP, else identity (all-reduce in backward)."""
    if ctx.sp:
        return gather_from_sequence_parallel_region(x, ctx, site)
    return copy_to_tensor_parallel_region(x, ctx, site)


def tp_output(x: torch.Tensor, ctx: TPContext, site: str, donate: bool = False) -> torch.Tensor:
    """Leave a row-parallel block: reduce-scatter with SP, else all-reduce (`donate`: in place, as
    `reduce_from_tensor_parallel_region`)."""
    if ctx.sp:
        return reduce_scatter_to_sequence_parallel_region(x, ctx, site)
    return reduce_from_tensor_parallel_region(x, ctx, site, donate)
