"""Gradient sums over the mesh: the global norm, its clipping, and any per-parameter sum.

Why this file exists: a parameter's gradient is split three ways (TP shards, FSDP's DP shards,
PP stages, with a tied embedding held twice), so "the norm of the model's gradient" needs one
rule for what is summed where. `MeshGrads` holds that rule; the run's step (clipping) and
gradient fidelity (`Run.grad_sums`) both use it. Collective over the mesh, no host sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from taco.parallel import fully_sharded
from taco.parallel.dims import ParallelDims
from taco.parallel.tags import is_pp_copy, is_tp_sharded
from taco.parallel.torch_private import foreach_mul_, foreach_norm

_Grads = list[tuple[nn.Parameter, torch.Tensor]]
"""(parameter, its local gradient) pairs"""


def sum_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[1] fp32 on `device`: the sum of the squares of every element of `grads`, from one
    `foreach_norm` in fp32 (a few kernels for all parameters, no float64 copies, no host sync)."""
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    return torch.stack(foreach_norm(grads)).square().sum().reshape(1)


class MeshGrads:
    """The gradients of one rank's stage, summed over the mesh by one rule (module docstring)."""

    def __init__(self, stage: nn.Module, dims: ParallelDims, sharded: bool, device: torch.device) -> None:
        self.stage, self.dims, self.sharded, self.device = stage, dims, sharded, device
        self.tp_group, self.dp_group = dims.group("tp"), dims.group("dp")

    def local(self) -> tuple[_Grads, _Grads]:
        """(TP-sharded, replicated) parameters with a gradient, each with its local gradient (FSDP:
        this rank's shard); the last stage's tied-embedding copy is left out (counted on the first)."""
        sharded: _Grads = []
        replicated: _Grads = []
        for p in self.stage.parameters():
            if p.grad is not None and not is_pp_copy(p):
                (sharded if is_tp_sharded(p) else replicated).append((p, fully_sharded.local_tensor(p.grad)))
        return sharded, replicated

    def over_mesh(self, sharded: torch.Tensor, replicated: torch.Tensor) -> torch.Tensor:
        """Sums of TP-sharded slices (summed over TP) plus sums of replicas (once), then summed over
        FSDP's DP shards and over the PP stages. Collective over the mesh; no host sync."""
        if self.tp_group is not None:
            dist.all_reduce(sharded, group=self.tp_group)
        total = sharded + replicated
        if self.sharded:  # each DP rank holds 1/dp of every gradient
            dist.all_reduce(total, group=self.dp_group)
        if self.dims.pp > 1:
            dist.all_reduce(total, group=self.dims.group("pp"))
        return total

    def sums(self, terms: Callable[[nn.Parameter, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Sums over the whole model of `terms(param, local grad)` (a float64 vector, the same length
        for every parameter): TP-sharded slices summed over TP, replicas once, stages summed over PP
        (the last stage's tied-embedding copy skipped); DP replicas hold the same gradients, FSDP
        shards are summed over DP. Collective over the mesh; the result stays on the device."""
        sums: list[torch.Tensor | float] = []
        for part in self.local():
            acc: torch.Tensor | float = 0.0
            for p, g in part:
                acc = acc + terms(p, g)
            sums.append(acc)
        like = next((t for t in sums if isinstance(t, torch.Tensor)), None)
        n = 1 if like is None else like.numel()
        z = torch.zeros(n, dtype=torch.float64, device=self.device)
        return self.over_mesh(z + sums[0], z + sums[1])  # a stage without gradients: zeros

    def clip(self, max_norm: float, vote: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Global grad norm (fp32: `sum_squares` of each part, `over_mesh`); clips to `max_norm`
        (0 = off) without reading the norm on the host. Also returns `vote` (this rank's stop
        request) summed over the same reductions (TP, FSDP's DP, PP), riding in the same all-reduces."""
        sharded, replicated = (sum_squares([g for _, g in part], self.device) for part in self.local())
        v = torch.full((1,), vote, device=self.device)
        sums = self.over_mesh(torch.cat((sharded, v)), torch.cat((replicated, torch.zeros_like(v))))
        norm, votes = sums[0].sqrt(), sums[1]
        if max_norm > 0:  # scale by max_norm / norm when above the bound, else by exactly 1
            scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in self.stage.parameters():  # the tied copy too: every gradient the optimizer sees
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(fully_sharded.local_tensor(p.grad))
            for dtype, grads in by_dtype.items():
                foreach_mul_(grads, scale.to(dtype))
        return norm, votes
