"""The marks that parallelism leaves on parameters and modules, written and read in one place.

Why this file exists: the TP layers, the pipeline stages and the DDP wrapper each learn a fact
about a parameter or a module that code elsewhere needs later (the trainer's global gradient
norm, the TP partial-gradient sum, the capture hook, the evaluation that turns compression off).
Those facts travel as attributes on the objects themselves, so a parameter keeps its mark through
`model.parameters()` and a state-dict round trip of the module; this module names each mark once
and is the only code that sets or reads them.

Parameter marks:
- TP-sharded: each TP rank holds a distinct slice (its squared norm is summed over the TP group);
- TP-partial: each TP rank holds a partial gradient of a replicated parameter (summed after
  backward by `sync_tp_partial_grads`: norms inside the SP region, row-parallel biases with SP);
- PP copy: the last stage's copy of a tied embedding weight (counted once, on the first stage).

Module marks: the `TPContext` of a tensor-parallel model, the DP hook state of a DDP module.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_TP_SHARDED = "_taco_tp_sharded"
_TP_PARTIAL = "_taco_tp_partial"
_PP_COPY = "_taco_pp_copy"
_TP_CONTEXT = "_taco_tp"
_DP_HOOK = "_taco_dp_hook"


def mark_tp_sharded(p: nn.Parameter) -> nn.Parameter:
    """Mark `p` as a TP shard (distinct on each TP rank); returns `p`."""
    setattr(p, _TP_SHARDED, True)
    return p


def is_tp_sharded(p: nn.Parameter) -> bool:
    return getattr(p, _TP_SHARDED, False)


def mark_tp_partial(p: nn.Parameter) -> nn.Parameter:
    """Mark `p` as replicated with a partial gradient on each TP rank; returns `p`."""
    setattr(p, _TP_PARTIAL, True)
    return p


def is_tp_partial(p: nn.Parameter) -> bool:
    return getattr(p, _TP_PARTIAL, False)


def mark_pp_copy(p: nn.Parameter) -> nn.Parameter:
    """Mark `p` as a pipeline stage's copy of a weight another stage owns (tied embeddings)."""
    setattr(p, _PP_COPY, True)
    return p


def is_pp_copy(p: nn.Parameter) -> bool:
    return getattr(p, _PP_COPY, False)


def set_tp_context(model: nn.Module, ctx: Any) -> None:
    """Attach the `TPContext` that `apply_tensor_parallel` built for `model`."""
    setattr(model, _TP_CONTEXT, ctx)


def tp_context(model: nn.Module) -> Any:
    """The `TPContext` of a model passed through `apply_tensor_parallel` (None otherwise)."""
    return getattr(model, _TP_CONTEXT, None)


def set_dp_hook_state(module: nn.Module, state: Any) -> None:
    """Attach the compressed DDP hook's state to the DDP-wrapped `module`."""
    setattr(module, _DP_HOOK, state)


def dp_hook_state(module: nn.Module) -> Any:
    """The compressed DDP hook's state of `module` (None without one)."""
    return getattr(module, _DP_HOOK, None)
