"""The data-parallel gradient sync as the pipeline sees it: one callback object, two moments.

Why this file exists: a pipeline step runs several micro-batches, and the DP wrapper must reduce
gradients once, after the step's last backward (Megatron-Core hands its schedules a
`no_sync_func` for the same reason). The schedule (`taco.parallel.pipeline`) calls a `DPSync`
and never asks which wrapper it has; `dp_sync_for` is the one place that asks, once, when the run
is built. DDP: every forward runs under `no_sync` (a 1F1B schedule interleaves forwards and
backwards, so "sync on the last forward", DDP's public recipe, would arm the reducer for the wrong
backward), and the reducer is armed by hand with the last micro-batch's output just before that
micro-batch's backward: DDP's private `reducer.prepare_for_backward`, called through
`taco.parallel.torch_private`, the one file that touches torch's private API (why, there).
Megatron's DDP owns its buckets and needs no such call; torch's DDP offers no public one.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
from torch import nn

from .fully_sharded import is_fully_sharded, set_gradient_sync
from .torch_private import arm_ddp_reducer


class DPSync(Protocol):
    """What a pipeline schedule calls around its micro-batches."""

    def forward(self) -> AbstractContextManager[object]:
        """The context one micro-batch's forward runs in."""
        ...

    def before_backward(self, output: torch.Tensor, last: bool) -> None:
        """Just before the backward of `output`; `last`: the step's last micro-batch (reduce now)."""
        ...


class NoDPSync:
    """No DP wrapper (dp = 1, or evaluation): nothing to hold back, nothing to arm."""

    def forward(self) -> AbstractContextManager[object]:
        return nullcontext()

    def before_backward(self, output: torch.Tensor, last: bool) -> None:
        pass


class DDPSync:
    """torch DDP: every forward under `no_sync`; the reducer armed before the last backward."""

    def __init__(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self.ddp = ddp

    def forward(self) -> AbstractContextManager[object]:
        return self.ddp.no_sync()

    def before_backward(self, output: torch.Tensor, last: bool) -> None:
        if last:  # the private call this file exists for (module docstring)
            arm_ddp_reducer(self.ddp, [output])


class FSDPSync:
    """FSDP2: gathered once per step; reduce-scatter and reshard only after the last backward."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def forward(self) -> AbstractContextManager[object]:
        return nullcontext()

    def before_backward(self, output: torch.Tensor, last: bool) -> None:
        set_gradient_sync(self.module, last)


def dp_sync_for(module: nn.Module) -> DPSync:
    """The `DPSync` of what `wrap_data_parallel` or `fully_shard_stage` returned (or a bare stage)."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return DDPSync(module)
    if is_fully_sharded(module):
        return FSDPSync(module)
    return NoDPSync()
