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


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce."""

    @staticmethod
    def forward(fctx, x, ctx, site):
        fctx.ctx, fctx.site = ctx, site
        return x.view_as(x)

    @staticmethod
    def backward(fctx, g):
        return region_all_reduce(g, fctx.ctx, fctx.site + ".bwd"), None, None


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


class _ScatterToSP(torch.autograd.Function):
    """forward: keep this rank's sequence slice; backward: all-gather (dim 1)."""

    @staticmethod
    def forward(fctx, x, ctx, site):
        fctx.ctx, fctx.site = ctx, site
        return region_split(x, ctx)

    @staticmethod
    def backward(fctx, g):
        return region_all_gather(g, fctx.ctx, fctx.site + ".bwd"), None, None


class _GatherFromSP(torch.autograd.Function):
    """forward: all-gather (dim 1); backward: reduce-scatter (dim 1)."""

    @staticmethod
    def forward(fctx, x, ctx, site):
        fctx.ctx, fctx.site = ctx, site
        return region_all_gather(x, ctx, site + ".fwd")

    @staticmethod
    def backward(fctx, g):
        return region_reduce_scatter(g, fctx.ctx, fctx.site + ".bwd"), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """forward: reduce-scatter (dim 1); backward: all-gather (dim 1)."""

    @staticmethod
    def forward(fctx, x, ctx, site):
        fctx.ctx, fctx.site = ctx, site
        return region_reduce_scatter(x, ctx, site + ".fwd")

    @staticmethod
    def backward(fctx, g):
        return region_all_gather(g, fctx.ctx, fctx.site + ".bwd"), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """forward: identity, backward: all-reduce. Input of column-parallel layers without SP."""
    if ctx.size == 1:
        return x
    op = _op("tp_copy_in")
    return _CopyToTP.apply(x, ctx, site) if op is None else op(x, ctx.key, site)


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


def tp_output(x: torch.Tensor, ctx: TPContext, site: str, donate: bool = False) -> torch.Tensor:
    """Leave a row-parallel block: reduce-scatter with SP, else all-reduce (`donate`: in place, as
    `reduce_from_tensor_parallel_region`)."""
    if ctx.sp:
        return reduce_scatter_to_sequence_parallel_region(x, ctx, site)
    return reduce_from_tensor_parallel_region(x, ctx, site, donate)
