"""torch.compile per transformer block: the TP regions are custom ops (`taco.parallel.compiled_ops`),
so a sharded block traces as ONE graph (no break at its TP sites), and the compiled model's loss
and gradients equal eager at codec none."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from taco.comm import CommPolicy
from taco.kernels.inductor import fit_cpu_codegen_to_aten
from taco.parallel import (
    ParallelDims,
    apply_tensor_parallel,
    sync_tp_partial_grads,
    vocab_parallel_cross_entropy,
)
from taco.parallel.tags import tp_context
from tests.helpers.dist import assert_close, run_distributed
from tests.helpers.models import tiny_gpt, tiny_qwen


def _model(kind: str, sp: bool, world: int, policy=None):
    torch.manual_seed(0)
    model = {"gpt": tiny_gpt, "qwen": tiny_qwen}[kind]()
    apply_tensor_parallel(model, None, ParallelDims(tp=world, sp=sp).build(), policy=policy)
    tp_context(model).overlap_wgrad = False  # compiled blocks use the plain column entry
    return model


def _breaks(rank, world, kind, sp):
    torch._dynamo.reset()
    model = _model(kind, sp, world)
    x = model.embed(torch.randint(0, 64, (2, 8)))  # [b, s, h]
    if sp:  # inside the SP region a block sees [b, s/tp, h]
        x = x.chunk(world, 1)[rank].contiguous()
    args = (x,) if kind == "gpt" else (x, *_rope(model, 8))
    block = model.layers[1]
    report = torch._dynamo.explain(block)(*args)
    assert report.graph_break_count == 0 and report.graph_count == 1, (
        f"{kind} sp={sp}: {report.graph_count} graphs, {report.graph_break_count} breaks: "
        f"{report.break_reasons}"
    )
    names = {n.target.name() for g in report.graphs for n in g.graph.nodes if n.op == "call_function"
             and hasattr(n.target, "name") and "taco" in str(n.target)}  # fmt: skip
    want = (
        {"taco::sp_gather_in", "taco::sp_reduce_scatter_out"}
        if sp
        else {"taco::tp_copy_in", "taco::tp_reduce_out"}
    )
    assert want <= names, f"TP ops in the graph: {names}, expected {want}"


def _rope(model, s):
    from taco.models.qwen import rope_cos_sin

    return rope_cos_sin(torch.arange(s), model.config.head_dim, model.config.rope_theta, torch.float32)


@pytest.mark.parametrize(("kind", "sp"), [("gpt", False), ("gpt", True), ("qwen", False)])
def test_a_sharded_block_compiles_without_graph_breaks(kind, sp):
    run_distributed(_breaks, 2, kind, sp, timeout=300)


def _parity(rank, world, sp):
    eager, compiled = _model("gpt", sp, world, CommPolicy(None)), _model("gpt", sp, world, CommPolicy(None))
    torch._dynamo.reset()
    fit_cpu_codegen_to_aten()  # as train.compile does (parallelize): ATEN_CPU_CAPABILITY=default too
    for layer in compiled.layers:
        layer.compile()  # inductor, as train.compile does
    torch.manual_seed(1)
    idx, tgt = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    group = dist.group.WORLD
    losses = []
    for m in (eager, compiled):
        for _ in range(2):  # a second call reuses the compiled graph
            m.zero_grad(set_to_none=True)
            loss = vocab_parallel_cross_entropy(m(idx), tgt, group).mean()
            loss.backward()
        sync_tp_partial_grads(m)
        losses.append(loss.detach())
    rel = ((losses[1] - losses[0]).abs() / losses[0].abs()).item()
    assert rel <= 1e-5, f"compiled loss {losses[1].item()} vs eager {losses[0].item()}: rel {rel:.2e} > 1e-5"
    for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert_close(b.grad, a.grad, f"grad {n}", rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sp", [False, True])
def test_compiled_blocks_equal_eager_at_codec_none(sp):
    run_distributed(_parity, 2, sp, timeout=600)  # inductor compiles on a loaded CPU
