"""Compressed TP inside Megatron-Core: a GPTModel trained with `taco.integrations.megatron` on.

    pip install -e '.[megatron]'                 # megatron-core 0.16.x
    python examples/megatron_gpt.py              # 2 local gloo ranks (CPU), TP=2, 10 Adam steps
    python examples/megatron_gpt.py --steps 50 --codec taco

A tiny Megatron GPTModel (local layer spec: no Transformer Engine; 2 layers, hidden 64, 4 heads,
fp32) is built twice from the same seed and trained on the same batches: once by stock Megatron,
once inside `taco_megatron.compressed(policy, model)`. The script prints both losses per step, the
bytes each TP site sent (`policy.stats.summary()`), and checks that the replicated parameters
(LayerNorms, RowParallelLinear biases) are still equal on the two TP ranks (every rank decodes the
same compressed all-reduce). In a Megatron training script the change is the one `with` line
around the training loop (or `enable(policy, model)` once after building the model).

CPU-only: `_cpu_test_shims()` below lets Megatron's GPTModel run on CPU/gloo. On GPUs (NCCL,
`model_parallel_cuda_manual_seed(...)` as in any Megatron script) neither shim is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import taco.integrations.megatron as taco_megatron
from taco.comm import CommPolicy

VOCAB, SEQ, BATCH, DIM = 128, 32, 4, 64


@contextlib.contextmanager
def _cpu_test_shims() -> Iterator[None]:
    """CPU-ONLY TEST SHIMS (not needed on GPUs), for megatron-core 0.16 on CPU/gloo:
    - `torch.cuda.current_device()` gives "cpu": the attention's scratch buffer (megatron/core/utils.py,
      GlobalMemoryBuffer.get_tensor) is allocated on `torch.cuda.current_device()`;
    - the CUDA RNG tracker's `fork()` is a no-op context: DotProductAttention wraps its dropout in
      `get_cuda_rng_tracker().fork()`, which needs CUDA RNG states (dropout is 0 here)."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    with (
        mock.patch("torch.cuda.current_device", lambda: "cpu"),
        mock.patch.object(CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext()),
    ):
        yield


def build_model() -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=DIM,
        num_attention_heads=4,
        tensor_model_parallel_size=2,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)  # the same full weights on every rank; each keeps its TP shard
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable toy sequences: arithmetic progressions mod VOCAB (random start and stride)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (BATCH, 1), generator=g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def train(model: torch.nn.Module, data: list) -> list[float]:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    positions = torch.arange(SEQ).expand(BATCH, -1)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True: masked out (causal)
    losses = []
    for tokens, labels in data:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens, positions, mask)  # [b, s, VOCAB / tp]: this rank's vocab shard
        loss = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels.t().contiguous())
        loss = loss.mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(rank: int, world: int, port: int, steps: int, codec: str) -> None:
    import megatron.core.parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        data = batches(steps)
        with _cpu_test_shims():
            stock = train(build_model(), data)
            model = build_model()
            policy = CommPolicy(codec=codec)
            with taco_megatron.compressed(policy, model=model):  # the one change to a training loop
                compressed = train(model, data)
        # replicated parameters must stay identical across the TP ranks
        drift = 0.0
        for p in model.parameters():
            if getattr(p, "tensor_model_parallel", False):
                continue
            copies = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(copies, p.detach(), group=ps.get_tensor_model_parallel_group())
            drift = max(drift, max((c - copies[0]).abs().max().item() for c in copies))
        if rank == 0:
            print(f"tiny Megatron GPTModel, TP={world} on gloo, Adam, {steps} steps")
            print(f"step  loss stock  loss {codec}")
            for i, (a, b) in enumerate(zip(stock, compressed)):
                print(f"{i:4d}  {a:10.4f}  {b:9.4f}")
            print(policy.stats.summary())
            print(f"replicated parameters, max difference across TP ranks: {drift:.3g}")
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    from taco.train.procs import free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--codec", default="taco", help="a taco.comm codec name (taco, none, ...)")
    args = ap.parse_args()
    mp.spawn(main, args=(2, free_port(), args.steps, args.codec), nprocs=2)
