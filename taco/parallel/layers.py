"""Tensor-parallel layers: column/row-parallel linears and the vocab-parallel embedding.

Built from a full (unsharded) module by slicing its weights, so a sharded model starts exactly
where its single-process reference does (and HF checkpoints load full, then shard).
Column-parallel layers do no communication themselves: their shared input enters the TP region
once, in a pre-hook on the parent block (`tensor_parallel.py`), so q/k/v (or up/gate) cost one
collective; without SP that block's backward overlaps it with the weight gradients (`column_block.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .chunked import chunked_row
from .column_block import ColumnBlock
from .mappings import reduce_from_tensor_parallel_region, tp_output
from .regions import TPContext
from .tags import mark_tp_partial, mark_tp_sharded


def _shard(t: torch.Tensor, dim: int, ctx: TPContext, what: str) -> nn.Parameter:
    """This rank's slice of `t` along `dim` as a new parameter marked TP-sharded."""
    from taco.models.plans import check_tp_divisible

    check_tp_divisible({f"{what} (size along dim {dim})": t.shape[dim]}, ctx.size)
    return mark_tp_sharded(nn.Parameter(t.chunk(ctx.size, dim=dim)[ctx.rank].detach().clone()))


def _shard_fused(t: torch.Tensor, parts: tuple[int, ...] | None, ctx: TPContext, what: str) -> nn.Parameter:
    """Column shard of `t` [out, ...]; a fused projection (`parts`: its blocks' widths, summing
    to out) is sharded block by block: rank r holds [block_1 slice r; block_2 slice r; ...]."""
    if parts is None:
        return _shard(t, 0, ctx, what)
    blocks = [_shard(b, 0, ctx, f"{what} block {i}") for i, b in enumerate(t.split(list(parts), dim=0))]
    return mark_tp_sharded(nn.Parameter(torch.cat([b.detach() for b in blocks], dim=0)))


class ColumnParallelLinear(nn.Module):
    """y_local = x W_r^T + b_r with W sharded on output features: W_r [out/tp, in].

    A fused projection (`fused_parts` on the full linear: q/k/v, gate/up) is sharded per block,
    so its local output is [block_1 slice r, block_2 slice r, ...] and keeps `fused_parts`
    divided by tp.

    Without SP (and `TPContext.overlap_wgrad`, the default) its backward leaves the weight
    gradient to its `ColumnBlock`, which computes it while the input-gradient all-reduce is in
    flight; with SP, without gradients or with the flag off, the plain `F.linear`.
    """

    def __init__(self, full: nn.Linear, ctx: TPContext, name: str = "") -> None:
        super().__init__()
        self.in_features = full.in_features
        self.out_features = full.out_features // ctx.size
        self.name = name
        parts = getattr(full, "fused_parts", None)
        self.weight = _shard_fused(full.weight, parts, ctx, name)  # [out/tp, in]
        self.bias = _shard_fused(full.bias, parts, ctx, name) if full.bias is not None else None
        if parts is not None:
            self.fused_parts = tuple(n // ctx.size for n in parts)
        self.block: ColumnBlock | None = None
        """the block sharing this layer's input (set by `apply_tensor_parallel`; column_block.py)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block is not None:  # wgrad overlapped with the block's input-gradient all-reduce
            return self.block.linear(self, x)  # [b, s, out/tp]
        return F.linear(x, self.weight, self.bias)  # [b, s, out/tp]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out_local={self.out_features}, site={self.name}"


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b, W sharded on input features: W_r [out, in/tp].

    forward: all-reduce (reduce-scatter with SP) at site `{name}.fwd`; the bias is added once,
    after the reduction (with SP its gradient is partial and summed by `sync_tp_partial_grads`).
    With SP and `TPContext.chunked`, GEMM and reduce-scatter run as one ring (`chunked.py`).
    """

    def __init__(self, full: nn.Linear, ctx: TPContext, name: str = "") -> None:
        super().__init__()
        self.ctx = ctx
        self.name = name
        self.in_features = full.in_features // ctx.size
        self.out_features = full.out_features
        self.weight = _shard(full.weight, 1, ctx, name)  # [out, in/tp]
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None
        if self.bias is not None and ctx.sp:
            mark_tp_partial(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.rings:  # ring matmul+reduce-scatter
            y = chunked_row(x, self.weight, self.ctx, self.name)  # [b, s/tp, out]
        else:  # the GEMM's output is ours alone: the plain all-reduce sums it in place
            y = tp_output(F.linear(x, self.weight), self.ctx, self.name, donate=True)  # [b, s(/tp), out]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_local={self.in_features}, out={self.out_features}, site={self.name}"


class VocabParallelEmbedding(nn.Module):
    """Embedding with vocabulary rows sharded: rank r holds rows [r V/tp, (r+1) V/tp).

    forward: masked local lookup, then all-reduce at site `{name}.fwd` (ids of other ranks give 0).
    """

    def __init__(self, full: nn.Embedding, ctx: TPContext, name: str = "tok_emb") -> None:
        super().__init__()
        self.ctx = ctx
        self.name = name
        self.num_embeddings = full.num_embeddings
        self.weight = _shard(full.weight, 0, ctx, f"{name} (vocab size)")  # [V/tp, h]
        self.start = ctx.rank * self.weight.shape[0]
        self.end = self.start + self.weight.shape[0]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.ctx.size == 1:
            return F.embedding(idx, self.weight)
        outside = (idx < self.start) | (idx >= self.end)  # [b, s]
        local = (idx - self.start).masked_fill(outside, 0)  # [b, s]
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [b, s, h]
        return reduce_from_tensor_parallel_region(out, self.ctx, self.name, donate=True)
