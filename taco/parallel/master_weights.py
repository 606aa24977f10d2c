"""bf16 parameters with fp32 master weights in the optimizer (Megatron-Core's mixed precision).

Why this file exists: under `torch.autocast` the weights stay fp32 and every GEMM casts them to
bf16 again, each forward and backward, and the gradients come back fp32. Megatron-Core instead
keeps the model itself in bf16 (parameters, activations and gradients: no casts, half the memory
traffic) and gives the optimizer fp32 copies, the master weights: AdamW updates the masters with
the bf16 gradients widened to fp32, and the bf16 parameters are rounded from the masters after
each step, so small updates accumulate in fp32 instead of vanishing in bf16's 8 bits.

    step:   forward/backward in bf16 -> p.grad (bf16; with micro-batches, summed in fp32 in
            p.main_grad by a post-accumulate hook, rounded to bf16 once at the end)
            reductions, clipping on p.grad (as for any model)
            master.grad = fp32(p.grad); AdamW on the masters; p = bf16(master)

The masters (and the inner optimizer's state) are optimizer state: a checkpoint holds them, so a
resumed run continues from the fp32 values, not from their bf16 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .torch_private import foreach_copy_


class MasterWeightsOptimizer:
    """An optimizer over fp32 masters of low-precision model parameters (Megatron's
    Float16OptimizerWithFloat16Params, in small). `make(param_groups)` builds the inner optimizer
    (AdamW, or ZeRO's) over the masters; `param_groups` are the model's, in the same layout.
    `accumulate_fp32`: sum each micro-batch's gradient in an fp32 `main_grad` (post-accumulate
    hooks); `finish_grads()` then rounds the sum into `p.grad` once. `init`: the fp32 values the
    masters start from, by `id` of the parameter (the model's fp32 init, taken before its cast to
    bf16); a parameter without one starts from its own value."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        accumulate_fp32: bool = False,
        init: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.params: list[nn.Parameter] = [p for g in param_groups for p in g["params"]]
        init = init or {}
        self.masters = [nn.Parameter(init.get(id(p), p).detach().float().clone()) for p in self.params]
        it = iter(self.masters)
        groups = [{**g, "params": [next(it) for _ in g["params"]]} for g in param_groups]
        self.inner = make(groups)
        self.accumulate_fp32 = accumulate_fp32
        if accumulate_fp32:
            for p in self.params:
                p.main_grad = None
                p.register_post_accumulate_grad_hook(_into_main_grad)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Mapping[torch.Tensor, Mapping[str, Any]]:
        """Read-only view of the state this optimizer keeps per model parameter, as
        `torch.optim.Optimizer.state` is keyed: its fp32 master (`"master"`) and the inner
        optimizer's state of that master (AdamW: `"step"`, `"exp_avg"`, `"exp_avg_sq"`; ZeRO: only
        the masters of this rank's shard have them). Built on each access; a parameter's entry
        holds the live tensors, so reading it costs no copy."""
        from .data_parallel import local_optimizer

        inner = local_optimizer(self.inner).state
        return MappingProxyType({
            p: MappingProxyType({"master": m, **inner.get(m, {})}) for p, m in zip(self.params, self.masters)
        })  # fmt: skip

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
            if self.accumulate_fp32:
                p.main_grad = None
        self.inner.zero_grad(set_to_none=True)

    def finish_grads(self) -> None:
        """After the step's last backward: each fp32 gradient sum, rounded once, as `p.grad`."""
        if self.accumulate_fp32:
            for p in self.params:
                if p.main_grad is not None:
                    p.grad, p.main_grad = p.main_grad.to(p.dtype), None

    @torch.no_grad()
    def step(self) -> None:
        have = [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]
        for p, m in have:
            m.grad = p.grad.float()
        self.inner.step()
        foreach_copy_([p for p, _ in have], [m for _, m in have])  # round to the model's dtype
        for _, m in have:
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        from .data_parallel import optimizer_state

        return {"inner": optimizer_state(self.inner), "masters": [m.detach().clone() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        from .data_parallel import load_optimizer_state

        if "masters" not in state:
            raise ValueError(
                "optimizer state without fp32 master weights: written with train.mixed_precision = autocast "
                "(or fp32); resume with the same setting"
            )
        load_optimizer_state(self.inner, state["inner"])
        for p, m, saved in zip(self.params, self.masters, state["masters"]):
            m.copy_(saved)
            p.copy_(saved)


def _into_main_grad(p: torch.Tensor) -> None:
    """Post-accumulate hook: move this micro-batch's gradient into the fp32 sum."""
    g = p.grad
    p.main_grad = g.float() if p.main_grad is None else p.main_grad.add_(g)
    p.grad = None
