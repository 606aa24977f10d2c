"""Activation recompute per transformer block, and a counter of the bytes kept for backward.

Why this file exists: at real sequence lengths the activations every block keeps for its backward
outgrow the GPU (docs/design.md 1.7). `apply_recompute(blocks, mode, ctx)` wraps each block's
forward in `torch.utils.checkpoint` (non-reentrant), one small step applied after TP and before
data parallelism, so it composes with TP/SP, the pipeline schedules, DDP and FSDP2:

- "full": a block keeps only its inputs; backward re-runs its whole forward, TP collectives included.
- "selective": a block keeps its input and the outputs of its column-parallel matrix multiplies
  (q/k/v, MLP up/gate: `aten.mm`/`aten.addmm` outside the residual projections) and recomputes
  the rest (torch's selective checkpoint contexts): the attention core (RoPE, scaled-dot-product
  attention and its reshapes), the norms, the activation function, the residual adds, and the
  attention output projection with its TP collective (one h x h/tp GEMM per layer). The MLP down
  projection is not re-run: backward needs its input, not its output.
- "none": nothing changes.

A recomputed TP collective is the same call on the same tensor with the same codec (a group's
code is a pure function of the group, docs/design.md 4), so the recomputed activations equal the
first forward's bit for bit. While a block recomputes, the TP policy is `recomputing()`: its calls
count into `CommPolicy.recompute_stats` (the run's `tp_recompute_*` bytes), not into the per-step
statistics, and calibration, telemetry and the auto policy, which observe the policy, see each
site once per step.

`SavedBytes` counts what a forward keeps for backward: every tensor autograd saves
(`torch.autograd.graph.saved_tensors_hooks`, once per storage, parameters excluded), plus what a
checkpointed block holds itself (its inputs and, selective, the matmul outputs it caches).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .regions import TPContext

RECOMPUTE_MODES = ("none", "full", "selective")
_KEPT_OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)  # selective: matmul outputs kept
_RESIDUAL_PROJECTIONS = ("attn.out", "mlp.down")  # ...except these (row-parallel with TP)
_COUNTERS: list[SavedBytes] = []  # the active counters (innermost last); measurement only
_IN_PROJECTION = [0]  # > 0 while a residual projection of a selective block runs


class SavedBytes:
    """`with SavedBytes(model) as c: loss = step()` -> `c.bytes`: bytes kept for backward, each
    storage once, the parameters of `model` (and views of them) excluded. Every micro-batch run
    inside the `with` counts: the counted tensors are held until it ends, so a storage freed by
    one micro-batch's backward cannot hand its address to the next one's and go uncounted."""

    def __init__(self, model: nn.Module | None = None) -> None:
        params = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()] if model else []
        self.exclude = {p.untyped_storage().data_ptr() for p in params}  # FSDP2: the local shards
        self.seen: set[int] = set()
        self.held: list[torch.Tensor] = []
        self.bytes = 0

    def add(self, t: torch.Tensor) -> None:
        """Count `t`'s storage unless seen or a parameter's."""
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.exclude or key in self.seen or t.device.type == "meta":
            return
        self.seen.add(key)
        self.held.append(t)
        self.bytes += st.nbytes()

    def add_bytes(self, n: int) -> None:
        self.bytes += n

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @contextmanager
    def _active(self) -> Iterator[SavedBytes]:
        _COUNTERS.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            _COUNTERS.remove(self)

    def __enter__(self) -> SavedBytes:
        self._cm = self._active()
        return self._cm.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)
        self.held.clear()


def _recomputing(ctx: TPContext) -> Any:
    """The TP policy in recompute mode (its statistics apart, its observer quiet)."""
    policy = ctx.policy
    return policy.recomputing() if policy is not None and hasattr(policy, "recomputing") else nullcontext()


def _matmul_bytes(op: Any, args: tuple) -> int:
    a, b = (args[0], args[1]) if op is torch.ops.aten.mm.default else (args[1], args[2])
    return a.shape[0] * b.shape[1] * a.element_size()  # [m, k] @ [k, n] -> [m, n]


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in _KEPT_OPS and not _IN_PROJECTION[0]:
        if not ctx.is_recompute:
            for c in _COUNTERS:
                c.add_bytes(_matmul_bytes(op, args))
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _projection(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A residual projection's forward, its matmul not kept by a selective block (the flag is
    reset even when checkpoint stops a recompute early, by raising inside)."""
    _IN_PROJECTION[0] += 1
    try:
        return forward(*args, **kwargs)
    finally:
        _IN_PROJECTION[0] -= 1


def _contexts(mode: str, ctx: TPContext) -> tuple[Any, Any]:
    """(forward context, recompute context) for `checkpoint(context_fn=...)`."""
    if mode == "full":
        return nullcontext(), _recomputing(ctx)
    fwd, rec = create_selective_checkpoint_contexts(_selective_policy)

    @contextmanager
    def recompute() -> Iterator[None]:
        with rec, _recomputing(ctx):
            yield

    return fwd, recompute()


def _checkpointed(forward: Callable[..., Any], mode: str, ctx: TPContext, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing is kept anyway
        return forward(*args, **kwargs)
    for c in _COUNTERS:  # what the block holds: its tensor inputs
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                c.add(a)
    return checkpoint(
        forward, *args, use_reentrant=False, context_fn=functools.partial(_contexts, mode, ctx), **kwargs
    )


def apply_recompute(blocks: Iterable[nn.Module], mode: str, ctx: TPContext) -> None:
    """Wrap each block's forward for `mode` ("none", "full" or "selective"), in place.

    The wrapper is an instance attribute, so parameter names, forward pre-hooks (the SP entry of
    the first block) and the hooks FSDP2 registers on a block stay as they are. `ctx`: the model's
    TP context (its policy is switched to recompute mode while a block recomputes).
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
    if mode == "none":
        return
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block.forward, mode, ctx)
        if mode != "selective":
            continue
        for name in _RESIDUAL_PROJECTIONS:
            proj = block.get_submodule(name)
            proj.forward = functools.partial(_projection, proj.forward)
