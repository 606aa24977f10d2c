"""TP backward overlap (column_block.py): the input-gradient all-reduce of a column-parallel block
in flight while its weight gradients are computed gives exactly the gradients of the plain path."""

from __future__ import annotations

import torch

from taco.parallel import ParallelDims, apply_tensor_parallel
from taco.parallel.column_block import ColumnBlock
from taco.parallel.layers import ColumnParallelLinear
from taco.parallel.tags import tp_context
from tests.helpers.dist import run_distributed
from tests.helpers.runs import parallel_step, tiny_model


def _on_off(rank: int, world: int) -> list[tuple[dict, dict]]:
    runs = []
    cases = (("gpt", None, False), ("qwen", None, False), ("gpt", "taco", False), ("qwen", None, True))
    for kind, codec, sp in cases:  # the last with SP: the plain path either way
        tol = 1e-4 if codec is None else None
        kw = dict(sp=sp, n_layer=2, codecs={"tp": codec} if codec else None, tol=tol)
        on = parallel_step(rank, world, kind, 1, 1, 2, overlap_wgrad=True, **kw)
        off = parallel_step(rank, world, kind, 1, 1, 2, overlap_wgrad=False, **kw)
        runs.append((on, off))
    return runs


def test_tp2_overlapped_wgrad_is_bit_identical_to_the_plain_backward():
    for runs in run_distributed(_on_off, 2):
        for on, off in runs:
            assert on["loss"] == off["loss"], (on["loss"], off["loss"])
            assert on["grad_sha"] == off["grad_sha"]  # every gradient bit-identical
            assert on["tp_wire"] == off["tp_wire"] and on["tp_raw"] == off["tp_raw"]
        assert runs[0][0]["checked"] > 0  # codec none also matched the unsharded reference
        assert runs[2][0]["tp_wire"] < runs[2][0]["tp_raw"]  # the codec run compressed


def _order(rank: int, world: int) -> list[str]:
    """The all-reduce starts before the block's weight gradients exist and they exist before it
    is waited on: the capture hook marks the start, tensor hooks mark the gradients' arrival."""
    torch.manual_seed(0)
    dims = ParallelDims(tp=2).build()
    model = apply_tensor_parallel(tiny_model("gpt", 1), None, dims)
    ctx = tp_context(model)
    events: list[str] = []
    ctx.capture = lambda site, t: events.append(f"start {site}") if site.endswith("mlp.up.bwd") else None
    up = model.layers[0].mlp.up
    assert isinstance(up, ColumnParallelLinear) and isinstance(up.block, ColumnBlock)
    up.weight.register_hook(lambda g: events.append("dW up"))
    blk = up.block
    orig = blk.linear

    def linear(child: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        y = orig(child, x)
        y.register_hook(lambda g: events.append("dgrad up"))
        return y

    blk.linear = linear
    idx = torch.randint(0, 64, (2, 8))
    model(idx).square().sum().backward()  # logits [b, s, V/tp]
    return events


def test_overlap_order_dgrad_then_start_then_wgrad():
    for events in run_distributed(_order, 2):
        dgrad, start, wgrad = (events.index(e) for e in ("dgrad up", "start layers.0.mlp.up.bwd", "dW up"))
        assert dgrad < start < wgrad, events
