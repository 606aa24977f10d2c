"""The one file of the training stack that touches torch's private API, each use with its reason.

Why this file exists: private names change between torch releases without notice. Kept here, an
upgrade that breaks one breaks this file, and every other file of `taco/parallel` and `taco/train`
uses public torch only (tests/test_adaptive_observers.py checks it). What is used, and why there
is no public way:

- DDP's `reducer.prepare_for_backward` (`arm_ddp_reducer`): a pipeline step runs every forward
  under `no_sync` (1F1B interleaves forwards and backwards, so DDP's public recipe "sync on the
  last forward" would arm the reducer for the wrong backward); the reducer is armed by hand with
  the last micro-batch's output just before its backward (`taco.parallel.dp_sync.DDPSync`).
- The autograd engine's `run_backward` (`run_backward`): a pipeline frees an output's storage once
  it is sent (Megatron's trick); `torch.autograd.backward` would compare the gradient's shape with
  the freed output and refuse.
- `DTensor._local_tensor` (`local_tensor`): FSDP2's local shard as a plain tensor sharing its
  storage, without the autograd op that `to_local()` records (gradients, optimizer state).
- FSDP2's `AllGather` / `ReduceScatter` protocols (`fsdp_api`): the base classes of the custom
  collectives `set_custom_all_gather` / `set_custom_reduce_scatter` take (compressed DP).
- `torch._foreach_norm` / `_foreach_mul_` / `_foreach_copy_` (`foreach_*`): one kernel launch per
  group of tensors for the gradient norm, clipping and master-weight copies, as torch's own
  optimizers and `clip_grad_norm_` do.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd import Variable
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor

__all__ = [
    "AllGather", "ReduceScatter", "arm_ddp_reducer", "foreach_copy_", "foreach_mul_", "foreach_norm",
    "local_tensor", "run_backward",
]  # fmt: skip

# whether this torch's _foreach_norm takes an output dtype (bf16 gradients accumulated in fp32)
_NORM_DTYPE = "dtype" in str(torch.ops.aten._foreach_norm.Scalar._schema)


def arm_ddp_reducer(ddp: nn.parallel.DistributedDataParallel, outputs: list[torch.Tensor]) -> None:
    """Make DDP reduce the gradients of the next backward (of `outputs`), as a synchronised forward
    would have."""
    ddp.reducer.prepare_for_backward(outputs)


def run_backward(out: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward of `out` with gradient `grad` through the engine directly (no shape check against
    `out`, whose storage may be freed); gradients accumulate into the leaves."""
    Variable._execution_engine.run_backward((out,), (grad,), False, False, (), True, True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of a DTensor (the tensor itself otherwise); shares its storage."""
    return t._local_tensor if isinstance(t, DTensor) else t


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor, in fp32 (fp32 copies first where this torch cannot)."""
    if _NORM_DTYPE:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return list(torch._foreach_norm([g.float() for g in tensors], 2))


def foreach_mul_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Every tensor multiplied in place by the 0-d (or 1-element) `scale`."""
    torch._foreach_mul_(tensors, scale)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i, cast to dst's dtype."""
    torch._foreach_copy_(dst, src)
