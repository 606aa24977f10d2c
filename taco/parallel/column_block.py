"""Column-parallel block whose backward overlaps the input-gradient all-reduce with the wgrad GEMMs.

Why this file exists: without sequence parallelism, the input of a column-parallel block (q/k/v,
or up/gate: several ColumnParallelLinear sharing one input) gets its gradient summed over the TP
group in backward (docs/design.md 1.4). Stock autograd computes each linear's weight gradient in
the same node as its input gradient, so the all-reduce can only start after every weight
gradient of the block. Megatron-LM overlaps the two (its async grad-input all-reduce); here:

    forward:  x_in = entry(x, W_1, b_1, ..., W_n, b_n)         # identity on x
              y_i  = column_linear(x_in, W_i, b_i)             # x_in W_i^T + b_i, [b, s, out_i/tp]
    backward: column_linear: dx_i = g_i W_i only (the input gradient), (x, g_i) kept for later
              entry: dx = sum_i dx_i (summed by autograd, as without overlap)
                     start the all-reduce of dx (site `{site}.bwd`)
                     dW_i = g_i^T x, db_i = sum g_i   while the all-reduce is in flight
                     wait, return (all-reduced dx, dW_1, db_1, ...)

The parameters are inputs of the entry, so their gradients arrive through autograd (DDP's hooks
see them as usual). Each product is the one stock autograd computes for `F.linear` (2-D GEMMs of
the flattened tensors), so the gradients are bit-identical to the non-overlapped path; the
all-reduce is the same call on the same tensor (same codec, same bytes).
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .batch_split import yield_turn
from .chunked import chunked_column
from .mappings import tp_input
from .regions import TPContext, start_tp_all_reduce


class _Pending:
    """One forward's saved (x, grad_output) per column linear of the block, filled in backward."""

    def __init__(self, n: int) -> None:
        self.saved: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]


class _ColumnEntry(torch.autograd.Function):
    """forward: identity; backward: all-reduce of the input gradient, overlapped with the block's
    weight-gradient GEMMs."""

    @staticmethod
    def forward(fctx, x, ctx, site, pending, biases, *params):
        fctx.ctx, fctx.site, fctx.pending, fctx.biases = ctx, site, pending, biases
        fctx.dtypes = [p.dtype for p in params]
        return x.view_as(x)

    @staticmethod
    def backward(fctx, g):
        needed = g is not None and fctx.needs_input_grad[0]  # as stock: no x grad, no all-reduce
        wait = start_tp_all_reduce(g, fctx.ctx, fctx.site + ".bwd") if needed else None
        grads: list[torch.Tensor | None] = []
        for i, saved in enumerate(fctx.pending.saved):
            dw = db = None
            for x2, g2 in saved:  # [m, in], [m, out/tp]
                w = g2.t().mm(x2)  # [out/tp, in], as autograd's mm for F.linear
                dw = w if dw is None else dw + w
                if fctx.biases[i]:
                    b = g2.sum(0)
                    db = b if db is None else db + b
            j = len(grads)
            grads.append(dw.to(fctx.dtypes[j]) if dw is not None else None)
            if fctx.biases[i]:
                grads.append(db.to(fctx.dtypes[j + 1]) if db is not None else None)
        fctx.pending.saved = [[] for _ in fctx.pending.saved]  # free them (retain_graph: refilled)
        if wait is not None:
            yield_turn()  # batch-split: the other pieces run while the all-reduce is in flight
        dx = wait() if wait is not None else None
        return (dx, None, None, None, None, *grads)


class _ColumnLinear(torch.autograd.Function):
    """forward: x W^T + b; backward: the input gradient only (the entry computes dW, db)."""

    @staticmethod
    def forward(fctx, x, weight, bias, pending, index):
        fctx.pending, fctx.index, fctx.x_dtype = pending, index, x.dtype
        dev = x.device.type
        if torch.is_autocast_enabled(dev):  # compute as autocast's F.linear would, outside it
            dt = torch.get_autocast_dtype(dev)
            x, weight = x.to(dt), weight.to(dt)
            bias = bias.to(dt) if bias is not None else None
        with torch.autocast(dev, enabled=False):
            y = F.linear(x, weight, bias)  # [b, s, out/tp]
        fctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(fctx, g):
        x, weight = fctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])  # [m, out/tp]
        fctx.pending.saved[fctx.index].append((x.reshape(-1, x.shape[-1]), g2))
        dx = g2.mm(weight).view(x.shape)  # [b, s, in]
        return dx.to(fctx.x_dtype), None, None, None, None


class ColumnBlock:
    """The column-parallel linears that share one input, and the entry that joins them.

    `enter(x)` runs in the parent's forward pre-hook: with gradients on (and TP without SP) it
    applies the entry and remembers its output, so each child's `forward` (`linear`) given that
    very tensor takes the overlapped path. Anything else (no grad, SP, another input) takes the
    plain path (`tp_input` and `F.linear`), so the result is always correct. With SP and
    `TPContext.chunked`, `enter` runs the all-gather+matmul ring for every child at once
    (`chunked.py`) and `linear` hands each child its output.
    """

    def __init__(self, ctx: TPContext, site: str, children: list[nn.Module]) -> None:
        self.ctx, self.site, self.children = ctx, site, children
        # the entry's last output (weakly: a finished step keeps no activation alive) and its
        # pending, per thread (batch-split pieces enter the block on their own threads)
        self._local = threading.local()

    def active(self) -> bool:
        return self.ctx.overlap_wgrad and not self.ctx.sp and self.ctx.size > 1 and torch.is_grad_enabled()

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        self._local.current = None
        if self.ctx.rings:  # SP ring: the children's outputs are computed shard by shard here
            full, ys = chunked_column(x, self.ctx, self.site, self.children)
            self._local.current = (weakref.ref(full), ys)
            return full
        if not self.active():
            return tp_input(x, self.ctx, self.site)
        params: list[nn.Parameter] = []
        biases: list[bool] = []
        for c in self.children:
            params += [c.weight] + ([c.bias] if c.bias is not None else [])
            biases.append(c.bias is not None)
        pending = _Pending(len(self.children))
        out = _ColumnEntry.apply(x, self.ctx, self.site, pending, biases, *params)
        self._local.current = (weakref.ref(out), pending)
        return out

    def linear(self, child: nn.Module, x: torch.Tensor) -> torch.Tensor:
        cur = getattr(self._local, "current", None)
        if cur is None or cur[0]() is not x:
            return F.linear(x, child.weight, child.bias)
        index = next(i for i, c in enumerate(self.children) if c is child)
        if isinstance(cur[1], list):  # chunked: computed by the ring at the block's entry
            return cur[1][index]
        return _ColumnLinear.apply(x, child.weight, child.bias, cur[1], index)
