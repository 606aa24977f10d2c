"""Compressed TP in a torchtitan-style (DTensor) model: swap the plan's styles, nothing else.

    python examples/dtensor_llama_block.py            # 2 local gloo ranks (CPU), prints per-site stats

A Llama block (attention wq/wk/wv colwise + wo rowwise, MLP w1/w3 colwise + w2 rowwise) is
parallelized twice, with torch's stock styles and with `taco_plan(plan, policy)`; the script prints
the output SQNR of the compressed block against the stock one and the bytes each TP site sent.
In torchtitan, the same one-line change goes where the layer plan is built (`parallelize_llama`):
`parallelize_module(block, tp_mesh, taco_plan(layer_plan, policy, prefix=f"layers.{i}."))`.
Weights stay DTensors, so optimizers, gradient clipping and DCP checkpoints work unchanged.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from taco.codec import sqnr_db
from taco.comm import CommPolicy
from taco.integrations.dtensor import taco_plan

DIM, HEADS, FFN = 256, 8, 512


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = DIM // HEADS
        a = self.attention_norm(x)
        q, k, v = (w(a).view(b, s, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        h = x + self.wo(o)  # -1 above: this rank's heads
        m = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(m)) * self.w3(m))


PLAN = {
    **{k: ColwiseParallel() for k in ("wq", "wk", "wv", "w1", "w3")},
    **{k: RowwiseParallel() for k in ("wo", "w2")},
}


def main(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(2, 64, DIM)
    stock = parallelize_module(copy.deepcopy(block), mesh, PLAN)
    policy = CommPolicy(codec="taco")  # per-site overrides: CommPolicy(overrides={"*.w2.fwd": "none"})
    taco = parallelize_module(copy.deepcopy(block), mesh, taco_plan(PLAN, policy, prefix="layers.0."))
    ref, out = stock(x), taco(x)
    out.sum().backward()  # the colwise layers' input gradients are all-reduced compressed
    if rank == 0:
        print(f"output SQNR vs the stock plan: {sqnr_db(ref, out):.1f} dB")
        print(policy.stats.summary())
    dist.destroy_process_group()


if __name__ == "__main__":
    from taco.train.procs import free_port

    mp.spawn(main, args=(2, free_port()), nprocs=2)
