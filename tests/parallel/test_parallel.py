"""Tensor/sequence parallelism with codec none matches the unsharded single-process reference."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from taco.models import GPT, GPTConfig
from taco.parallel import (
    ColumnParallelLinear,
    ParallelDims,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    gather_logits,
    sync_tp_partial_grads,
    vocab_parallel_cross_entropy,
)
from tests.helpers.dist import assert_close, run_distributed
from tests.helpers.models import tiny_gpt, tiny_qwen


def _ref_slice(ref_param: torch.Tensor, mod: nn.Module, pname: str, tp: int, r: int) -> torch.Tensor:
    parts = getattr(mod, "fused_parts", None)
    if parts is not None:  # fused q/k/v or gate/up: this rank's slice of every block, stacked
        return torch.cat([b.chunk(tp, 0)[r] for b in ref_param.split([n * tp for n in parts], 0)])
    if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
        return ref_param.chunk(tp, 0)[r]
    if isinstance(mod, RowParallelLinear) and pname == "weight":
        return ref_param.chunk(tp, 1)[r]
    return ref_param


def _model_parity(rank, world, kind, sp):
    torch.manual_seed(0)
    model = {"gpt": tiny_gpt, "qwen": tiny_qwen, "qwen3": lambda: tiny_qwen(True)}[kind]().float()
    ref = copy.deepcopy(model)
    idx = torch.randint(0, 64, (2, 8))
    tgt = torch.randint(0, 64, (2, 8))
    dims = ParallelDims(tp=world, sp=sp).build()
    apply_tensor_parallel(model, None, dims, policy=None)
    logits = model(idx)  # [b, s, V/tp]
    loss = vocab_parallel_cross_entropy(logits, tgt, dims.group("tp")).mean()
    loss.backward()
    sync_tp_partial_grads(model)
    ref_logits = ref(idx)
    ref_loss = nn.functional.cross_entropy(ref_logits.flatten(0, 1), tgt.flatten())
    ref_loss.backward()
    assert_close(loss, ref_loss, "loss", rtol=1e-5, atol=1e-6)
    assert_close(
        gather_logits(logits.detach(), dims.group("tp")), ref_logits.detach(), "logits", rtol=1e-5, atol=1e-5
    )
    ref_params = dict(ref.named_parameters())
    checked = 0
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if full == "lm_head.weight" and full not in ref_params:
                continue
            exp = _ref_slice(ref_params[full].grad, mod, pname, world, rank)
            assert_close(p.grad, exp, f"grad {full}", rtol=1e-4, atol=1e-6)
            checked += 1
    assert checked > 10, f"only {checked} gradients compared with the reference, expected more than 10"


# tp=4 runs gpt and qwen3 by default; qwen (Qwen2: q/k/v biases, which shard like their weights and
# are checked at tp=2) at tp=4 runs with `-m slow`
@pytest.mark.parametrize(
    ("tp", "sp", "kind"),
    [
        pytest.param(tp, sp, kind, marks=pytest.mark.slow if (tp, kind) == (4, "qwen") else ())
        for tp in (2, 4)
        for sp in (False, True)
        for kind in ("gpt", "qwen", "qwen3")
    ],
)
def test_model_matches_unsharded_reference(tp, sp, kind):
    run_distributed(_model_parity, tp, kind, sp)


def test_tp1_is_the_plain_model():
    torch.manual_seed(0)
    m = tiny_gpt()
    ref = copy.deepcopy(m)
    apply_tensor_parallel(m, None, TPContext(None))
    idx = torch.randint(0, 64, (2, 8))
    assert torch.equal(m(idx), ref(idx))


def _layer_parity(rank, world, sp):
    torch.manual_seed(0)
    up, down = nn.Linear(16, 32), nn.Linear(32, 16)
    x = torch.randn(2, 8, 16, requires_grad=True)
    ref_y = down(torch.relu(up(x)))
    ref_y.square().sum().backward()
    ctx = TPContext(dist.group.WORLD, None, sp)
    col, row = ColumnParallelLinear(up, ctx, "up"), RowParallelLinear(down, ctx, "down")
    from taco.parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
    from taco.parallel.mappings import tp_input

    xs = x.detach().clone().requires_grad_(True)
    h = scatter_to_sequence_parallel_region(xs, ctx, "in") if sp else xs
    y = row(torch.relu(col(tp_input(h, ctx, "up"))))  # SP: this rank's sequence slice only
    y.square().sum().backward()  # with SP the total loss is the sum of the per-rank slices
    if sp:
        dist.all_reduce(row.bias.grad)  # partial with SP
        full = gather_from_sequence_parallel_region(y.detach(), ctx, "out")
        assert_close(y, ref_y.chunk(world, 1)[rank], "output, this rank's sequence slice")
    else:
        full = y
    assert_close(full, ref_y, "output")
    assert_close(xs.grad, x.grad, "input grad")
    assert_close(col.weight.grad, up.weight.grad.chunk(world, 0)[rank], "column weight grad")
    assert_close(col.bias.grad, up.bias.grad.chunk(world, 0)[rank], "column bias grad")
    assert_close(row.weight.grad, down.weight.grad.chunk(world, 1)[rank], "row weight grad")
    assert_close(row.bias.grad, down.bias.grad, "row bias grad")


@pytest.mark.parametrize("sp", [False, True])
def test_column_row_pair_matches_reference(sp):
    run_distributed(_layer_parity, 2, sp)


def _ce_parity(rank, world):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 40, requires_grad=True)
    tgt = torch.randint(0, 40, (3, 5))
    ref = nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="none").view(3, 5)
    (ref * torch.arange(15.0).view(3, 5)).sum().backward()
    local = logits.detach().chunk(world, -1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, tgt, dist.group.WORLD)
    (loss * torch.arange(15.0).view(3, 5)).sum().backward()
    assert_close(loss, ref, "per-token loss")
    assert_close(local.grad, logits.grad.chunk(world, -1)[rank], "logits grad, this rank's vocab shard")


def test_vocab_parallel_cross_entropy():
    run_distributed(_ce_parity, 4)


def _bad_heads(rank, world):
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=3, n_embd=48, block_size=16))
    want = "n_head = 3 must be divisible by tp = 2"
    try:
        apply_tensor_parallel(model, None, ParallelDims(tp=world).build())
    except ValueError as e:
        assert want in str(e), f"ValueError {str(e)!r} does not say {want!r}"
    else:
        raise AssertionError(f"n_head=3 with tp={world}: no ValueError (expected one saying {want!r})")


def test_heads_not_divisible_by_tp_is_a_clear_error():
    run_distributed(_bad_heads, 2)


def test_parallel_dims_validation_and_coords():
    d = ParallelDims(dp=2, pp=2, tp=2)
    assert str(d) == "DP2-PP2-TP2" and d.world_size == 8
    assert d.coords(5) == (1, 0, 1) and d.rank_of(1, 0, 1) == 5
    with pytest.raises(ValueError, match="parallel.tp"):
        ParallelDims(tp=0)


def _comm_dtype(rank, world, comm_dtype, want_seen, want_raw, want_grad_dtype):
    from taco.comm import CommPolicy

    torch.manual_seed(0)
    up, down = nn.Linear(16, 32), nn.Linear(32, 16)
    x = torch.randn(2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_y = down(torch.relu(up(x)))
    policy = CommPolicy(None)
    seen = []
    ctx = TPContext(dist.group.WORLD, policy, False, capture=lambda s, t: seen.append((s, t.dtype)),
                    comm_dtype=comm_dtype)  # fmt: skip
    from taco.parallel.mappings import tp_input

    col, row = ColumnParallelLinear(up, ctx, "up"), RowParallelLinear(down, ctx, "down")
    xs = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = row(torch.relu(col(tp_input(xs, ctx, "up"))))
    y.float().square().sum().backward()
    assert_close(y.float(), ref_y.float(), "output", atol=0.05, rtol=0.05)
    raw = {n: s.raw_bytes / s.calls for n, s in policy.stats.sites.items()}
    assert dict(seen) == want_seen, f"dtype sent per site {dict(seen)}, expected {want_seen}"
    assert raw == want_raw, f"raw bytes per call per site {raw}, expected {want_raw}"
    if want_grad_dtype is not None:
        assert xs.grad.dtype == want_grad_dtype, (
            f"input grad dtype {xs.grad.dtype}, expected {want_grad_dtype}"
        )


def test_tp_comm_dtype_casts_what_travels():
    """Under bf16 autocast the backward all-reduce gets an fp32 gradient: comm_dtype bf16 sends it
    as bf16 (half the bytes) and hands back fp32; None sends it as it comes."""
    numel = 2 * 8 * 16
    bf16, f32 = torch.bfloat16, torch.float32
    seen = {"down.fwd": bf16, "up.bwd": bf16}
    raw = {"down.fwd": numel * 2, "up.bwd": numel * 2}  # 2 (N-1)/N x numel x 2 bytes, N = 2
    run_distributed(_comm_dtype, 2, bf16, seen, raw, f32)
    seen = {"down.fwd": bf16, "up.bwd": f32}
    raw = {"down.fwd": numel * 2, "up.bwd": numel * 4}
    run_distributed(_comm_dtype, 2, None, seen, raw, None)
