"""DTensor styles (taco.integrations.dtensor) against torch's stock styles on a Llama-style block.

2 gloo ranks. codec none: output, input gradient and every weight gradient bit-identical to the
stock plan. taco: every TP collective of the block compressed (policy.stats), and the output SQNR
vs the stock plan within 1 dB of the same block whose row-parallel outputs are all-reduced by
`taco.comm.all_reduce` alone. DCP save/load of the parallelized block restores its weights.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers.dist import assert_equal, run_distributed

DIM, HEADS, FFN, BATCH, SEQ = 64, 4, 128, 2, 16
COLWISE = ["attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"]
ROWWISE = ["attention.wo", "feed_forward.w2"]


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))  # -1: the local heads under TP


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def _block(seed: int) -> Block:
    torch.manual_seed(seed)
    return Block()


def _parallel(block: Block, plan_kind: str, policy=None) -> Block:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from taco.integrations.dtensor import taco_plan

    plan = {k: ColwiseParallel() for k in COLWISE} | {k: RowwiseParallel() for k in ROWWISE}
    if plan_kind == "taco":
        plan = taco_plan(plan, policy, prefix="layers.0.")
    mesh = init_device_mesh("cpu", (2,))
    return parallelize_module(copy.deepcopy(block), mesh, plan)


def _run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    from torch.distributed.tensor import DTensor

    x = x.clone().requires_grad_(True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    params = model.named_parameters()
    grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for n, p in params}
    return y.detach(), x.grad, grads


def _local_with_comm(block: Block, rank: int, codec: str) -> Block:
    """The block sharded by hand, row-parallel outputs summed by `taco.comm.all_reduce` alone."""
    from taco import comm

    local = copy.deepcopy(block)
    with torch.no_grad():
        for name in COLWISE + ROWWISE:
            lin = local.get_submodule(name)
            dim = 0 if name in COLWISE else 1
            lin.weight = nn.Parameter(lin.weight.chunk(2, dim=dim)[rank].clone())
    for name in ROWWISE:
        local.get_submodule(name).register_forward_hook(lambda m, i, out: comm.all_reduce(out, codec=codec))
    return local


def _equal_body(rank: int, world: int) -> dict:
    from taco.codec import sqnr_db
    from taco.comm import CommPolicy

    block = _block(0)
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM)
    ref = _run(_parallel(block, "stock"), x)
    for label, policy in [("policy=None", None), ("codec none", CommPolicy(codec=None))]:
        got = _run(_parallel(block, "taco", policy), x)
        assert_equal(got[0], ref[0], f"{label}: output")
        assert_equal(got[1], ref[1], f"{label}: input grad")
        assert got[2].keys() == ref[2].keys(), f"{label}: parameters {sorted(got[2])} vs {sorted(ref[2])}"
        for n in ref[2]:
            assert_equal(got[2][n], ref[2][n], f"{label}: grad of {n}")

    policy = CommPolicy(codec="taco")
    got = _run(_parallel(block, "taco", policy), x)
    sites = {f"layers.0.{k}.bwd" for k in COLWISE} | {f"layers.0.{k}.fwd" for k in ROWWISE}
    for s in sorted(sites):
        st = policy.stats.site(s)
        assert st.calls == 1 and 0 < st.wire_bytes < st.raw_bytes, f"site {s}: {st}"
    measured = sqnr_db(ref[0], got[0])
    with torch.no_grad():
        alone = _local_with_comm(block, rank, "taco")(x)
        plain = _local_with_comm(block, rank, "none")(x)
    assert_equal(plain, ref[0], "hand-sharded block with plain all-reduce vs stock plan")
    reference = sqnr_db(ref[0], alone)
    assert math.isfinite(measured) and abs(measured - reference) < 1.0, (
        f"output SQNR {measured:.2f} dB vs taco.comm alone {reference:.2f} dB"
    )
    grad_sqnr = sqnr_db(ref[1], got[1])
    assert grad_sqnr > 20, f"input grad SQNR {grad_sqnr:.2f} dB"
    return {"sqnr": measured, "reference": reference, "grad_sqnr": grad_sqnr}


def _dcp_body(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from taco.comm import CommPolicy

    model = _parallel(_block(0), "taco", CommPolicy(codec="taco"))
    dcp.save(model.state_dict(), checkpoint_id=path)
    other = _parallel(_block(7), "taco", CommPolicy(codec="taco"))
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=path)
    other.load_state_dict(sd)
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        sharded = n.removesuffix(".weight") in COLWISE + ROWWISE
        assert isinstance(p, DTensor) == sharded, f"{n}: DTensor {isinstance(p, DTensor)}, sharded {sharded}"
        a, b = (t.to_local() if isinstance(t, DTensor) else t for t in (p, q))
        assert_equal(b.detach(), a.detach(), f"DCP round trip: {n}")


def test_dtensor_styles_match_stock_and_compress():
    res = run_distributed(_equal_body, 2)
    for r in res:
        print(f"output SQNR {r['sqnr']:.2f} dB, taco.comm alone {r['reference']:.2f} dB, "
              f"input grad SQNR {r['grad_sqnr']:.2f} dB")


def test_dtensor_dcp_round_trip(tmp_path):
    run_distributed(_dcp_body, 2, str(tmp_path / "ckpt"))


def _sp_body(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from taco.comm import CommPolicy
    from taco.integrations.dtensor import taco_plan

    torch.manual_seed(0)
    mlp = FeedForward()
    plan = {"w1": ColwiseParallel(input_layouts=Shard(1)), "w2": RowwiseParallel(output_layouts=Shard(1))}
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM).chunk(2, dim=1)[rank].contiguous()  # this rank's sequence shard

    class OneBranch(nn.Module):  # w2(silu(w1(x))): w3 would gather the same input a second time
        def __init__(self, ff: FeedForward) -> None:
            super().__init__()
            self.w1, self.w2 = copy.deepcopy(ff.w1), copy.deepcopy(ff.w2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(F.silu(self.w1(x)))

    ref = _run(parallelize_module(OneBranch(mlp), mesh, plan), x)
    got = _run(parallelize_module(OneBranch(mlp), mesh, taco_plan(plan, None)), x)
    assert ref[0].shape == (BATCH, SEQ // 2, DIM), f"SP output shape {tuple(ref[0].shape)}"
    assert_equal(got[0], ref[0], "SP codec none: output")
    assert_equal(got[1], ref[1], "SP codec none: input grad")
    for n in ref[2]:
        assert_equal(got[2][n], ref[2][n], f"SP codec none: grad of {n}")
    policy = CommPolicy(codec="taco")
    _run(parallelize_module(OneBranch(mlp), mesh, taco_plan(plan, policy)), x)
    for s in ("w1.fwd", "w1.bwd", "w2.fwd", "w2.bwd"):
        st = policy.stats.site(s)
        assert st.calls == 1 and 0 < st.wire_bytes < st.raw_bytes, f"SP site {s}: {st}"


    # torchtitan's token embedding: rowwise with a masked partial sum, left to torch (stock, exact)
    torch.manual_seed(2)
    emb, ids = nn.Embedding(32, DIM), torch.randint(0, 32, (BATCH, SEQ))
    eplan = {"": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))}
    a = parallelize_module(copy.deepcopy(emb), mesh, eplan[""])(ids)
    b = parallelize_module(copy.deepcopy(emb), mesh, taco_plan(eplan, CommPolicy(codec="taco"))[""])(ids)
    assert_equal(b, a, "rowwise Embedding (MaskPartial): stock path")


def test_dtensor_sequence_parallel_layouts():
    run_distributed(_sp_body, 2)


def _sp_block_body(rank: int, world: int) -> None:
    """torchtitan's sequence-parallel layer plan (norms SequenceParallel, PrepareModuleInput into
    attention and MLP, rowwise outputs Shard(1)) through taco_plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from taco.comm import CommPolicy
    from taco.integrations.dtensor import taco_plan

    plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    }
    plan |= {k: ColwiseParallel() for k in COLWISE}
    plan |= {k: RowwiseParallel(output_layouts=Shard(1)) for k in ROWWISE}
    mesh = init_device_mesh("cpu", (2,))
    block = _block(0)
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM).chunk(2, dim=1)[rank].contiguous()
    ref = _run(parallelize_module(copy.deepcopy(block), mesh, plan), x)
    got = _run(parallelize_module(copy.deepcopy(block), mesh, taco_plan(plan, None)), x)
    assert_equal(got[0], ref[0], "SP block codec none: output")
    assert_equal(got[1], ref[1], "SP block codec none: input grad")
    for n in ref[2]:
        assert_equal(got[2][n], ref[2][n], f"SP block codec none: grad of {n}")
    policy = CommPolicy(codec="taco")
    _run(parallelize_module(copy.deepcopy(block), mesh, taco_plan(plan, policy)), x)
    for s in ["attention", "feed_forward", *ROWWISE]:
        for d in ("fwd", "bwd"):
            st = policy.stats.site(f"{s}.{d}")
            assert st.calls == 1 and 0 < st.wire_bytes < st.raw_bytes, f"SP block site {s}.{d}: {st}"


def test_dtensor_sequence_parallel_block():
    run_distributed(_sp_block_body, 2)
