"""The TP regions as torch.library custom ops, so that torch.compile keeps a block in one graph.

Why this file exists: the eager regions (`mappings.py`) are autograd Functions whose collectives
run Python (the policy picks a codec, the statistics count bytes): dynamo cannot trace them and
breaks the graph at every TP site. Here each region is one registered op, opaque to the
compiler, with a fake (meta) implementation for shapes and an autograd formula that calls its
dual op, so a compiled transformer block is one graph (torch.compile per block, `train.compile`):

    taco::tp_copy_in(x)          forward: identity (a copy)     backward: all-reduce      (`{site}.bwd`)
    taco::tp_reduce_out(x)       forward: all-reduce (`.fwd`)   backward: identity
    taco::sp_gather_in(x)        forward: all-gather dim 1      backward: reduce-scatter dim 1
    taco::sp_reduce_scatter_out  forward: reduce-scatter dim 1  backward: all-gather dim 1
    taco::sp_scatter_in(x)       forward: this rank's slice     backward: all-gather dim 1

An op cannot take a process group or a policy, so it takes the `TPContext`'s integer `key` and
looks the context up (`context_of`). The collectives are the eager ones (`regions.region_all_reduce`, ...):
same sites, codecs, bytes and statistics as the eager path. `mappings.py` routes to these ops only
while dynamo traces (`torch.compiler.is_compiling()`), so eager runs are unchanged.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from .regions import (
    SEQ_DIM,
    context_of,
    region_all_gather,
    region_all_reduce,
    region_reduce_scatter,
    region_split,
)


def _fake_seq(x: torch.Tensor, key: int, factor: float) -> torch.Tensor:
    shape = list(x.shape)
    shape[SEQ_DIM] = int(shape[SEQ_DIM] * factor)
    return x.new_empty(shape)


@custom_op("taco::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, key: int, site: str) -> torch.Tensor:
    return region_all_reduce(x, context_of(key), site)


@custom_op("taco::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, key: int, site: str) -> torch.Tensor:
    return region_all_gather(x, context_of(key), site)


@custom_op("taco::tp_reduce_scatter", mutates_args=())
def tp_reduce_scatter(x: torch.Tensor, key: int, site: str) -> torch.Tensor:
    return region_reduce_scatter(x, context_of(key), site)


@custom_op("taco::tp_copy_in", mutates_args=())
def tp_copy_in(x: torch.Tensor, key: int, site: str) -> torch.Tensor:
    return x.clone()


@custom_op("taco::tp_reduce_out", mutates_args=())
def tp_reduce_out(x: torch.Tensor, key: int, site: str) -> torch.Tensor:
    return region_all_reduce(x, context_of(key), site + ".fwd")


@custom_op("taco::sp_gather_in", mutates_args=())
def sp_gather_in(x: torch.Tensor, key: int, site: str) -> torch.Tensor:
    return region_all_gather(x, context_of(key), site + ".fwd")


@custom_op("taco::sp_reduce_scatter_out", mutates_args=())
def sp_reduce_scatter_out(x: torch.Tensor, key: int, site: str) -> torch.Tensor:
    return region_reduce_scatter(x, context_of(key), site + ".fwd")


@custom_op("taco::sp_scatter_in", mutates_args=())
def sp_scatter_in(x: torch.Tensor, key: int, site: str) -> torch.Tensor:
    return region_split(x, context_of(key))


def _size(key: int) -> int:
    return context_of(key).size


for _op in (tp_all_reduce, tp_copy_in, tp_reduce_out):
    _op.register_fake(lambda x, key, site: torch.empty_like(x))
for _op in (tp_all_gather, sp_gather_in):
    _op.register_fake(lambda x, key, site: _fake_seq(x, key, _size(key)))
for _op in (tp_reduce_scatter, sp_reduce_scatter_out, sp_scatter_in):
    _op.register_fake(lambda x, key, site: _fake_seq(x, key, 1 / _size(key)))


def _keep(ctx, inputs, output) -> None:
    _, ctx.key, ctx.site = inputs


def _copy_in_bwd(ctx, g):
    return tp_all_reduce(g, ctx.key, ctx.site + ".bwd"), None, None


def _reduce_out_bwd(ctx, g):
    return g, None, None


def _gather_in_bwd(ctx, g):
    return tp_reduce_scatter(g, ctx.key, ctx.site + ".bwd"), None, None


def _to_gather_bwd(ctx, g):
    return tp_all_gather(g, ctx.key, ctx.site + ".bwd"), None, None


tp_copy_in.register_autograd(_copy_in_bwd, setup_context=_keep)
tp_reduce_out.register_autograd(_reduce_out_bwd, setup_context=_keep)
sp_gather_in.register_autograd(_gather_in_bwd, setup_context=_keep)
sp_reduce_scatter_out.register_autograd(_to_gather_bwd, setup_context=_keep)
sp_scatter_in.register_autograd(_to_gather_bwd, setup_context=_keep)
