"""Apply tensor (and sequence) parallelism to a plain model by its plan (torchtitan-style).

`apply_tensor_parallel(model, plan, dims, policy)` swaps modules in place by style (see
`taco.models.plans`) and adds the region entries as forward pre-hooks:
- each block whose children are column-parallel (attn: the fused qkv; mlp: up or the fused
  gate_up) enters the TP region
  once: site `layers.{i}.attn.qkv` / `layers.{i}.mlp.up` (all-reduce in backward, overlapped with
  the children's weight gradients by a `ColumnBlock`; with SP an all-gather forward and a
  reduce-scatter backward);
- row-parallel outputs leave it: site `layers.{i}.attn.out` / `layers.{i}.mlp.down`;
- with SP, the first layer's input is split along the sequence (site `layers.0.in`) and the
  head's input is gathered back (site `lm_head`).
Parameters whose gradient is partial on each TP rank (norms inside the SP region, row-parallel
biases with SP, per-head q/k norms) are marked; `sync_tp_partial_grads` sums them after backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .column_block import ColumnBlock
from .dims import ParallelDims
from .fully_sharded import local_tensor
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import scatter_to_sequence_parallel_region
from .regions import TPContext
from .tags import is_tp_partial, mark_tp_partial, set_tp_context, tp_context


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


_SITE_OF = {"q": "qkv", "qkv": "qkv", "gate_up": "up"}  # separate q/k/v or fused: one site name


def _input_site(parent: str, children: list[str]) -> str:
    site = next((_SITE_OF[c] for c in children if c in _SITE_OF), children[0])
    return f"{parent}.{site}"


def _enter_block(parent: nn.Module, block: ColumnBlock) -> None:
    """Enter the TP region at `parent`'s input through `block` (tp_input, or the wgrad-overlapped
    entry of column_block.py); the block's column-parallel layers use it in their forward."""
    for child in block.children:
        child.block = block
    parent.register_forward_pre_hook(lambda m, a: (block.enter(a[0]), *a[1:]))


def apply_tensor_parallel(
    model: nn.Module,
    plan: dict[str, str] | None,
    dims: ParallelDims | TPContext,
    policy: Any = None,
    comm_dtype: torch.dtype | None = None,
    overlap_wgrad: bool | None = None,
) -> nn.Module:
    """Shard `model` (built full, identically on every TP rank) in place; returns it.

    `dims`: a built `ParallelDims` (its TP group and `sp` are used) or a ready `TPContext`.
    `policy`: a `taco.comm.CommPolicy` choosing the codec per site (None: plain collectives).
    `comm_dtype`: the dtype the TP collectives' inputs are cast to (None: as they come).
    `overlap_wgrad`: sets `TPContext.overlap_wgrad` (None: keep the context's, on by default).
    """
    from taco.models.plans import check_tp_size, resolve_plan  # models reach parallel only through plans

    ctx = dims if isinstance(dims, TPContext) else TPContext(dims.group("tp"), policy, dims.sp)
    if policy is not None:
        ctx.policy = policy
    if comm_dtype is not None:
        ctx.comm_dtype = comm_dtype
    if overlap_wgrad is not None:
        ctx.overlap_wgrad = overlap_wgrad
    set_tp_context(model, ctx)
    if ctx.size == 1:
        return model
    check_tp_size(model, ctx.size)
    styles = resolve_plan(model, plan)
    tied = {}
    col_children: dict[str, list[str]] = {}
    for name, style in styles.items():
        mod = model.get_submodule(name)
        if style == "vocab_embedding":
            new = VocabParallelEmbedding(mod, ctx, name)
            tied[id(mod.weight)] = new.weight
        elif style == "colwise":
            new = ColumnParallelLinear(mod, ctx, name)
            parent, _, child = name.rpartition(".")
            col_children.setdefault(parent, []).append(child)
        elif style == "colwise_head":
            new = ColumnParallelLinear(mod, ctx, name)
            if id(mod.weight) in tied:  # tied embeddings: share the vocab shard itself
                new.weight = tied[id(mod.weight)]
            _enter_block(new, ColumnBlock(ctx, name, [new]))
        elif style == "rowwise":
            new = RowParallelLinear(mod, ctx, name)
        else:  # replicate
            continue
        _set_module(model, name, new)
    for parent, children in col_children.items():
        mods = [model.get_submodule(f"{parent}.{c}") for c in children]
        _enter_block(model.get_submodule(parent), ColumnBlock(ctx, _input_site(parent, children), mods))
    for name, style in styles.items():
        if style != "replicate":
            continue
        parent = name.rpartition(".")[0]
        in_sp_region = name.startswith("layers.") or name == "norm"
        if parent in col_children or (ctx.sp and in_sp_region):
            for p in model.get_submodule(name).parameters():
                mark_tp_partial(p)
    if ctx.sp:
        first = model.get_submodule("layers.0")
        first.register_forward_pre_hook(
            lambda m, a: (scatter_to_sequence_parallel_region(a[0], ctx, "layers.0.in"), *a[1:])
        )
    return model


def tp_partial_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if is_tp_partial(p)]


def sync_tp_partial_grads(model: nn.Module) -> None:
    """Sum, over the TP group, the gradients that each rank holds only a part of (plain all-reduce)."""
    ctx: TPContext | None = tp_context(model)
    if ctx is None or ctx.size == 1:
        return
    grads = [local_tensor(p.grad) for p in tp_partial_params(model) if p.grad is not None]  # FSDP: shards
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=ctx.group)
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()
