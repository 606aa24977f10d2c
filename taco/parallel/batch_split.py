"""Batch-split overlap of TP communication with compute (Domino-style; docs/design.md 1.3
"Overlap across pieces").

Why this file exists: a TP collective stalls compute because the layer after it needs its result.
Two independent pieces of one micro-batch (split along the batch) have no such dependence on each
other, so piece i's collective can be on the wire while piece i+1 computes:

    piece 0: attn ... start AR(0) ─┐                 wait AR(0) → mlp ... start AR'(0) ─┐
    piece 1:                        └ attn ... start AR(1) ─┐         (turn to piece 1) ...
                                                             └ wait AR(1) → mlp ...

Each piece runs the stage's blocks on its own worker thread, but only one piece computes at a
time: a piece holds "the turn", and at each TP collective of its forward (`regions._collective`)
it starts the collective (async handle), passes the turn to the next unfinished piece in
round-robin order, takes it back, then waits. The turn order is a pure function of the piece
count and the model, so every rank of the TP group issues the same collectives in the same
order (the collective contract, `taco.comm.handles`). Compute stays serial (one piece at a time,
as on one CUDA stream); only communication runs under it. The pieces' autograd graphs join into
one (their outputs are concatenated), so backward is one call, run by autograd's engine in its
own deterministic order, with the collectives of backward as without the split.

The split adds no math: every op of a block is per sample (norms per token, attention per
sequence, GEMMs per row), so outputs equal the unsplit run's up to GEMM summation order.
Per-thread state (grad mode, autocast, the CUDA device and stream, the intra-op thread count) is
copied into each worker, so a piece runs exactly as the caller's code would.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

MODES = ("none", "batch-split")
_LOCAL = threading.local()  # in a piece's worker: .turns (the shared _Turns) and .index
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


class _Turns:
    """Which piece may run now: round-robin over the pieces that have not finished."""

    def __init__(self, n: int) -> None:
        self._cv = threading.Condition()
        self._turn = 0
        self._live = list(range(n))

    def take(self, i: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._turn == i)

    def pass_on(self, i: int, finished: bool = False) -> None:
        with self._cv:
            pos = self._live.index(i)
            if finished:
                self._live.remove(i)
                self._turn = self._live[pos % len(self._live)] if self._live else -1
            else:
                self._turn = self._live[(pos + 1) % len(self._live)]
            self._cv.notify_all()


def in_piece() -> bool:
    """True on a piece's worker thread (TP collectives there start, yield the turn, then wait)."""
    return getattr(_LOCAL, "turns", None) is not None


def yield_turn() -> None:
    """From a piece: let the other pieces run until the turn comes back (no-op outside pieces)."""
    turns = getattr(_LOCAL, "turns", None)
    if turns is not None:
        turns.pass_on(_LOCAL.index)
        turns.take(_LOCAL.index)


def overlapped(start: Callable[[], Any]) -> torch.Tensor:
    """Run one collective from a piece: `start()` issues it (returns a `taco.comm.Handle`), the
    other pieces compute while it is in flight, then its result. Outside a piece: start and wait."""
    handle = start()
    yield_turn()
    return handle.wait()


def _pool(n: int) -> ThreadPoolExecutor:
    # Persistent workers: a fresh OS thread per step would also start a fresh OpenMP team each step.
    with _POOLS_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = _POOLS[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="taco-piece")
    return pool


def _caller_state() -> Callable[[], contextlib.ExitStack]:
    """The caller's thread-local state, as a function that enters it on another thread."""
    grad = torch.is_grad_enabled()
    threads = torch.get_num_threads()
    amp = [(dev, torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda") if torch.is_autocast_enabled(dev)]
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.current_stream()

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        stack.enter_context(torch.set_grad_enabled(grad))
        for dev, dtype in amp:
            stack.enter_context(torch.autocast(dev, dtype))
        if cuda is not None:
            stack.enter_context(torch.cuda.device(cuda.device))
            stack.enter_context(torch.cuda.stream(cuda))
        return stack

    return enter


def _in_turns(work: Callable[[int], Any], chunks: int) -> list[Any]:
    """[work(0), ..., work(chunks-1)], each on its own worker, taking turns (module docstring)."""
    turns = _Turns(chunks)
    enter = _caller_state()

    def run(i: int) -> Any:
        _LOCAL.turns, _LOCAL.index = turns, i
        try:
            turns.take(i)
            with enter():
                return work(i)
        finally:
            _LOCAL.turns = None
            turns.pass_on(i, finished=True)  # a failed piece lets the others finish

    futures = [_pool(chunks).submit(run, i) for i in range(chunks)]
    outs, error = [], None
    for f in futures:
        try:
            outs.append(f.result())
        except BaseException as e:  # wait for every piece before raising the first error
            error = error or e
    if error is not None:
        raise error
    return outs


class _Pieces(torch.autograd.Function):
    """forward: the pieces' forwards, taking turns; backward: the pieces' backwards, taking turns.

    Each piece's graph is built in forward (on detached inputs) and kept; backward runs
    `torch.autograd.grad` of each piece on its worker, so piece i's backward collectives are in
    flight while piece i+1's backward computes, and returns the input gradient (the pieces'
    concatenated) and each parameter's gradient summed over the pieces, so every parameter's
    gradient arrives once, through this node (DDP's hooks see one gradient per step, as without
    the split).
    """

    @staticmethod
    def forward(fctx, x, fn, chunks, *params):
        xs = [p.detach().requires_grad_(x.requires_grad) for p in x.chunk(chunks, dim=0)]

        def piece(i: int) -> torch.Tensor:
            with torch.enable_grad():
                return fn(xs[i])

        ys = _in_turns(piece, chunks)
        fctx.xs, fctx.ys, fctx.params, fctx.chunks = xs, ys, params, chunks
        return torch.cat([y.detach() for y in ys], dim=0)

    @staticmethod
    def backward(fctx, g):
        gs = g.chunk(fctx.chunks, dim=0)
        wants = [p for p, need in zip(fctx.params, fctx.needs_input_grad[3:], strict=True) if need]
        with_x = fctx.needs_input_grad[0]

        def piece(i: int) -> tuple[torch.Tensor | None, ...]:
            inputs = ([fctx.xs[i]] if with_x else []) + wants
            return torch.autograd.grad(fctx.ys[i], inputs, gs[i], allow_unused=True)

        per_piece = _in_turns(piece, fctx.chunks)
        fctx.xs = fctx.ys = None  # the pieces' graphs are freed with them
        dx = None
        if with_x:  # [b, ...]: the pieces' input gradients, in order
            dxs = [parts[0] for parts in per_piece]
            dx = torch.cat([torch.zeros_like(gi) if d is None else d for d, gi in zip(dxs, gs, strict=True)])
            per_piece = [parts[1:] for parts in per_piece]
        sums = []  # each wanted parameter's gradient, summed over the pieces in piece order
        for parts in zip(*per_piece, strict=True):
            got = [t for t in parts if t is not None]
            if len(got) > 1 and got[0].dtype != torch.float32:  # bf16 weights: summed in fp32
                got = [sum((t.float() for t in got[1:]), got[0].float()).to(got[0].dtype)]
            sums.append(None if not got else sum(got[1:], got[0]))
        grads = iter(sums)
        param_grads = [next(grads) if need else None for need in fctx.needs_input_grad[3:]]
        return (dx, None, None, *param_grads)


def run_pieces(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    chunks: int,
    params: list[torch.nn.Parameter] | tuple = (),
) -> torch.Tensor:
    """`fn(x)` computed as `cat([fn(x_0), ..., fn(x_{k-1})])` with x split along dim 0 into `chunks`
    equal pieces whose TP collectives, forward and backward, overlap the other pieces' compute
    (module docstring). `params`: every parameter `fn` uses (their gradients come back through
    one autograd node; with grad off they are not needed).

    x: [b, ...] with b divisible by `chunks`; fn maps [b_i, ...] -> [b_i, ...]. chunks = 1 (or
    called from inside a piece): plain `fn(x)`."""
    if chunks < 1:
        raise ValueError(f"parallel.tp_overlap_chunks must be >= 1, got {chunks}")
    if chunks == 1 or in_piece():
        return fn(x)
    if x.shape[0] % chunks:
        raise ValueError(
            f"batch-split overlap: the micro-batch of {x.shape[0]} sequences is not divisible by "
            f"parallel.tp_overlap_chunks={chunks}; pick a micro-batch size that is a multiple of it"
        )
    if torch.is_grad_enabled():
        return _Pieces.apply(x, fn, chunks, *[p for p in params if p.requires_grad])
    pieces = x.chunk(chunks, dim=0)
    return torch.cat(_in_turns(lambda i: fn(pieces[i]), chunks), dim=0)


def check_piece_counts(chunks: int, group: dist.ProcessGroup | None, device: torch.device | str) -> None:
    """Raise the same ValueError on every rank of `group` when their piece counts differ (a rank
    splitting into another number of pieces would issue a different sequence of collectives: a
    deadlock or wrong sums). Collective over `group`; called once, when the run is built."""
    if group is None or dist.get_world_size(group) == 1:
        return
    mine = torch.tensor([chunks], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    counts = [int(t.item()) for t in every]
    if len(set(counts)) > 1:
        raise ValueError(
            f"batch-split overlap: the TP ranks split micro-batches into different piece counts "
            f"{counts} (parallel.tp_overlap_chunks); every rank needs the same value"
        )
