"""The TP context and the raw collectives of a tensor-parallel region.

Why this file exists: the eager regions (`mappings.py`, autograd Functions) and the compiled ones
(`compiled_ops.py`, custom ops) run the same collectives on the same context; both import them from
here, so neither imports the other's internals. Each call goes through `taco.comm` with a named
site (the policy picks the codec, the statistics count the bytes), in the context's communication
dtype. Activations are [b, s, h]; sequence parallelism shards dim 1 (s).
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

from .batch_split import in_piece, overlapped

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
    chunked: bool = False
    """With SP: all-gather+matmul and matmul+reduce-scatter run as rings of the TP size, each hop
    under a shard's GEMM (`chunked.py`; docs/design.md 1.3 "Chunked sequence-parallel overlap")."""
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

    @property
    def rings(self) -> bool:
        """Whether the SP all-gather+matmul and matmul+reduce-scatter run as rings here (`chunked`
        on, with SP, on more than one rank)."""
        return self.chunked and self.sp and self.size > 1


def context_of(key: int) -> TPContext:
    """The live `TPContext` whose `key` this is."""
    return _CONTEXTS[key]


def _kw(ctx: TPContext, site: str) -> dict:
    # With a policy the policy picks the codec per site; without one, plain collectives.
    kw: dict = {"group": ctx.group, "site": site}
    if ctx.policy is None:
        kw["codec"] = None
    else:
        kw["policy"] = ctx.policy
    return kw


def comm_dtype_of(x: torch.Tensor, ctx: TPContext) -> torch.dtype:
    """The dtype x travels in: the context's `comm_dtype` for floating x, else x's own."""
    dt = ctx.comm_dtype
    return dt if dt is not None and x.is_floating_point() else x.dtype


def _to_comm(x: torch.Tensor, ctx: TPContext, site: str) -> tuple[torch.Tensor, bool]:
    """x in the context's communication dtype (captured as it travels), and whether it was cast."""
    dtype = comm_dtype_of(x, ctx)
    cast = x.dtype != dtype
    y = x.to(dtype) if cast else x
    if ctx.capture is not None:
        ctx.capture(site, y)
    return y, cast


def _collective(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, ctx: TPContext, site: str, **kw: Any
) -> torch.Tensor:
    """Run one TP collective on `x` in the context's communication dtype (what travels is captured)."""
    y, cast = _to_comm(x, ctx, site)
    if in_piece():  # batch-split: the other pieces compute while this one is in flight
        out = overlapped(lambda: fn(y, **kw, **_kw(ctx, site), async_op=True))
    else:
        out = fn(y, **kw, **_kw(ctx, site))
    return out.to(x.dtype) if cast else out


def region_all_reduce(x: torch.Tensor, ctx: TPContext, site: str, donate: bool = False) -> torch.Tensor:
    """Sum over the TP group (site `site`); `donate`: x is a temporary the plain collective may sum
    in place (`taco.comm.all_reduce`), unless a capture hook sees it."""
    return _collective(comm.all_reduce, x, ctx, site, donate=donate and ctx.capture is None)


def start_tp_all_reduce(x: torch.Tensor, ctx: TPContext, site: str) -> Callable[[], torch.Tensor]:
    """Start the all-reduce `region_all_reduce` would run (same dtype, capture, codec and bytes); the
    returned function waits for it and returns the sum in x's dtype."""
    y, cast = _to_comm(x, ctx, site)
    handle = comm.start_all_reduce(y, **_kw(ctx, site))
    return lambda: handle.wait().to(x.dtype) if cast else handle.wait()


def region_all_gather(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """Concatenation of the ranks' shards along the sequence dim."""
    return _collective(comm.all_gather, x, ctx, site, dim=SEQ_DIM)


def region_reduce_scatter(x: torch.Tensor, ctx: TPContext, site: str) -> torch.Tensor:
    """Sum over the TP group, then this rank's slice of the sequence dim."""
    return _collective(comm.reduce_scatter, x, ctx, site, dim=SEQ_DIM)


def region_split(x: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """This rank's slice of the sequence dim (no communication)."""
    s = x.shape[SEQ_DIM]
    if s % ctx.size:
        raise ValueError(f"sequence parallelism needs the sequence length ({s}) divisible by tp ({ctx.size})")
    return x.chunk(ctx.size, dim=SEQ_DIM)[ctx.rank].contiguous()
