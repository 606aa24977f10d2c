"""The vocab-parallel loss: equal to the unsharded cross-entropy (loss and gradient) for fp32 and
bf16 logits, with padded vocabularies (a shard of padding only too), far-apart shard maxima, and
one collective per forward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from taco.parallel import vocab_parallel_cross_entropy
from tests.helpers.dist import assert_close, run_distributed


def _parity(rank, world, dtype, vocab, width, spread):
    torch.manual_seed(1)
    full = torch.randn(4, 6, width) * 3
    full[..., : width // world] += spread  # rank 0's shard far above the others: the max moves
    tgt = torch.randint(0, vocab, (4, 6))
    tgt[0, :world] = torch.arange(world) * (width // world)  # a target on every shard
    tgt[0, :world] = tgt[0, :world].clamp(max=vocab - 1)
    full = full.to(dtype)
    ref_in = full[..., :vocab].float().requires_grad_(True)
    weights = torch.rand(4, 6)
    ref = nn.functional.cross_entropy(ref_in.flatten(0, 1), tgt.flatten(), reduction="none").view(4, 6)
    (ref * weights).sum().backward()
    local = full.chunk(world, -1)[rank].clone().requires_grad_(True)
    calls = {"n": 0}
    names = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single"]
    names = [n for n in names if hasattr(dist, n)]
    real = [getattr(dist, n) for n in names]

    def counted(fn):
        def wrapped(*a, **k):
            calls["n"] += 1
            return fn(*a, **k)

        return wrapped

    for n, f in zip(names, real):
        setattr(dist, n, counted(f))
    try:
        loss = vocab_parallel_cross_entropy(local, tgt, dist.group.WORLD, None if vocab == width else vocab)
    finally:
        for n, f in zip(names, real):
            setattr(dist, n, f)
    assert calls["n"] == 1, f"{calls['n']} collectives in the loss's forward, expected 1"
    assert loss.dtype == torch.float32 and loss.shape == (4, 6), (loss.dtype, loss.shape)
    (loss * weights).sum().backward()
    assert local.grad.dtype == dtype, local.grad.dtype
    ref_grad = torch.zeros(4, 6, width)
    ref_grad[..., :vocab] = ref_in.grad
    want = ref_grad.chunk(world, -1)[rank]
    assert_close(loss, ref, f"per-token loss ({dtype})", rtol=1e-5, atol=1e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert_close(local.grad.float(), want, f"logits grad, shard {rank} ({dtype})", rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("dtype", "vocab", "width", "spread"),
    [
        (torch.float32, 40, 40, 0.0),
        (torch.float32, 37, 40, 30.0),  # padding in the last shard, maxima 30 apart
        (torch.float32, 29, 40, 0.0),  # the last shard is padding only
        (torch.bfloat16, 38, 40, 8.0),
    ],
)
def test_matches_unsharded_cross_entropy(dtype, vocab, width, spread):
    run_distributed(_parity, 4, dtype, vocab, width, spread)


def _fp32_input_kept(rank, world):
    x = torch.randn(2, 3, 8, requires_grad=True)
    before = x.detach().clone()
    loss = vocab_parallel_cross_entropy(x, torch.zeros(2, 3, dtype=torch.long), dist.group.WORLD)
    loss.sum().backward()
    assert torch.equal(x.detach(), before), "the fp32 logits were changed in place"
    try:
        loss.sum().backward()
    except RuntimeError as e:
        assert "backward" in str(e), str(e)
    else:
        raise AssertionError("a second backward through the consumed buffer did not raise")


def test_fp32_logits_are_not_modified_and_backward_runs_once():
    run_distributed(_fp32_input_kept, 2)
