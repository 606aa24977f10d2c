"""Data parallelism: PyTorch DDP over the DP group, gradient buckets compressed by a comm hook.

Why this file exists: the DP axis of the 3D mesh (docs/design.md 1.5) reuses existing engines, with
our codecs. `wrap_data_parallel` wraps a module (a pipeline stage) in stock
`DistributedDataParallel` over the DP group; with a codec it registers a communication hook that
reduces each gradient bucket SDP4Bit-style (arXiv 2410.15526: Hadamard rotation + 8-bit, or
4-bit, codes): `taco.comm.all_reduce` encodes N chunks -> all-to-all -> fp32 sum -> re-encode ->
all-gather -> decode, so each value is quantized twice whatever N is, and every replica decodes
the same bytes (the replicas stay identical). The mean is taken after the fp32 sum.
Codec "none" keeps DDP's own all-reduce (no hook).
`build_optimizer` optionally shards AdamW's state over the DP group with
`ZeroRedundancyOptimizer` (ZeRO-1); gradients are still all-reduced in full by DDP.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from taco import comm
from taco.codec import Codec
from taco.comm.policy import CodecSpec

from .tags import set_dp_hook_state

DP_SITE = "dp.grad"


@dataclass
class DPHookState:
    """What the hook needs: the DP group, its codec, and where statistics go."""

    group: dist.ProcessGroup
    codec: Codec
    policy: comm.CommPolicy | None = None
    site: str = DP_SITE
    world: int = field(init=False)
    calls: int = 0
    """buckets reduced so far (one call per bucket per synchronised backward)"""

    def __post_init__(self) -> None:
        self.world = dist.get_world_size(self.group)


def compressed_allreduce_hook(
    state: DPHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: mean of a flat gradient bucket over the DP group, compressed (two-shot)."""
    state.calls += 1
    buf = bucket.buffer()  # [numel] flat gradients of this bucket (param dtype)
    out = comm.all_reduce(buf, state.group, codec=state.codec, site=state.site, policy=state.policy)
    out.div_(state.world)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(out)  # synchronous on gloo; DDP copies the result back into the bucket
    return fut


def wrap_data_parallel(
    module: nn.Module,
    group: dist.ProcessGroup | None,
    codec: CodecSpec = None,
    codec_options: dict[str, Any] | None = None,
    *,
    policy: comm.CommPolicy | None = None,
    bucket_cap_mb: float = 25.0,
) -> nn.Module:
    """DDP(module) over `group` (the module itself when the group is None: dp == 1).

    codec: a name ("int8-hadamard", "int4-hadamard", ...), spec or Codec; None/"none" = DDP's
    plain all-reduce. `policy` receives the hook's statistics (site `dp.grad`).
    """
    if group is None or dist.get_world_size(group) == 1:
        return module
    # find_unused_parameters=True for its side effect: DDP then keeps its construction-time
    # bucket layout instead of rebuilding the buckets in gradient-ready order after the first
    # synchronised backward. The rounding of a compressed bucket (and the summation order of a
    # ring all-reduce over > 2 ranks) depends on where each gradient sits in the flat bucket, so
    # a rebuild at a different step would keep a resumed run from reproducing the uninterrupted
    # one (tests/test_3d.py). Cost: one autograd-graph walk per step and a pass-through node on
    # the outputs. Every parameter must be used by every micro-batch (true of whole stages).
    ddp = DistributedDataParallel(
        module, process_group=group, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True
    )
    c = comm.make_codec(codec, codec_options)
    if c is not None:
        state = DPHookState(group, c, policy)
        set_dp_hook_state(ddp, state)
        ddp.register_comm_hook(state, compressed_allreduce_hook)
    return ddp


def plain_allreduce_bytes(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Bytes one rank sends per synchronised step with DDP's plain ring all-reduce of every
    gradient: 2 (N-1)/N of the gradient bytes (the same accounting as `taco.comm.all_reduce`)."""
    if group is None:
        return 0
    n = dist.get_world_size(group)
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return 2 * (n - 1) * grad_bytes // n


def build_optimizer(
    param_groups: list[dict[str, Any]],
    group: dist.ProcessGroup | None,
    zero: bool = False,
    **adamw: Any,
) -> torch.optim.Optimizer:
    """AdamW, or with `zero=True` and a DP group a ZeroRedundancyOptimizer sharding its state."""
    if zero and group is not None:
        # Imported here: torch.distributed.optim scripts its functional optimizers on import (~1 s).
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            param_groups, optimizer_class=torch.optim.AdamW, process_group=group, **adamw
        )
    return torch.optim.AdamW(param_groups, **adamw)


def _is_zero(opt: torch.optim.Optimizer) -> bool:
    mod = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return mod is not None and isinstance(opt, mod.ZeroRedundancyOptimizer)


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state for a per-rank checkpoint (ZeRO: its own shard only)."""
    return opt.optim.state_dict() if _is_zero(opt) else opt.state_dict()


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Inverse of `optimizer_state` (the same mesh, so ZeRO's partition is the same)."""
    (opt.optim if _is_zero(opt) else opt).load_state_dict(state)
