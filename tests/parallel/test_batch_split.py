"""Batch-split TP overlap (taco/parallel/batch_split.py): the split adds no math on every layout it
runs with (FSDP2 included), ranks that disagree on the piece count get the same clear error, and the pieces'
collectives really are in flight while another piece computes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from taco.comm import Handle
from taco.parallel.batch_split import check_piece_counts, overlapped, run_pieces
from tests.helpers.dist import assert_close, run_distributed
from tests.helpers.runs import parallel_step


def _layouts(rank: int, world: int) -> list[dict]:
    if world == 2:
        return [
            parallel_step(rank, world, "gpt", 1, 1, 2, tp_overlap_chunks=2),  # TP
            parallel_step(rank, world, "qwen", 1, 1, 2, sp=True, tp_overlap_chunks=2),  # TP+SP
        ]
    return [
        parallel_step(rank, world, "gpt", 1, 2, 2, n_micro=2, tp_overlap_chunks=2),  # TP+PP (1F1B)
        parallel_step(rank, world, "qwen", 2, 1, 2, sp=True, tp_overlap_chunks=2),  # TP+SP+DP (DDP)
    ]


def test_batch_split_matches_the_unsplit_reference_tp_and_sp():
    for res in run_distributed(_layouts, 2):
        assert all(r["checked"] > 0 for r in res)  # every gradient within 1e-4 of the reference
        assert all(abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]) for r in res)


@pytest.mark.slow  # 4 gloo ranks
def test_batch_split_matches_the_unsplit_reference_with_pp_and_dp():
    for res in run_distributed(_layouts, 4, timeout=240):
        assert len(res) == 2 and all(r["checked"] > 0 for r in res)
        assert all(abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]) for r in res)


def _fsdp_split_and_unsplit(rank: int, world: int) -> list[dict]:
    """FSDP2 over DP=2 with TP=2, then with two 1F1B stages (the second stage's input carries a
    gradient): the unsplit and the split step, each checked against the unsharded reference inside
    `parallel_step`, then against each other (this rank's gradient shards)."""
    out = []
    for kind, pp, tp in (("gpt", 1, 2), ("qwen", 2, 1)):
        plain = parallel_step(rank, world, kind, 2, pp, tp, dp_shard=True)
        split = parallel_step(rank, world, kind, 2, pp, tp, dp_shard=True, tp_overlap_chunks=2)
        assert plain["grads"].keys() == split["grads"].keys()
        for name, g in split["grads"].items():
            assert_close(g, plain["grads"][name], f"split vs unsplit grad {name}", rtol=1e-4, atol=1e-6)
        out.append({k: split[k] for k in ("loss", "ref_loss", "checked")} | {"plain_loss": plain["loss"]})
    return out


@pytest.mark.slow  # 4 gloo ranks, four steps
def test_batch_split_matches_the_unsplit_run_with_fsdp2():
    for res in run_distributed(_fsdp_split_and_unsplit, 4, timeout=240):
        assert len(res) == 2 and all(r["checked"] > 0 for r in res)
        assert all(abs(r["loss"] - r["plain_loss"]) <= 1e-5 * abs(r["plain_loss"]) for r in res)
        assert all(abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]) for r in res)


def _mismatch(rank: int, world: int) -> str:
    try:
        check_piece_counts(2 + rank, dist.group.WORLD, "cpu")
    except ValueError as e:
        return str(e)
    return ""


def test_ranks_with_different_piece_counts_get_a_clear_error_not_a_deadlock():
    msgs = run_distributed(_mismatch, 2, timeout=60)
    assert all("different piece counts [2, 3]" in m and "tp_overlap_chunks" in m for m in msgs)


def _logged_all_reduce(t: torch.Tensor, log: list[str], label: str) -> torch.Tensor:
    """A piece's all-reduce of `t` through `overlapped`, logging when it starts and when it is done."""

    def start() -> Handle:
        y = t.clone()
        work = dist.all_reduce(y, async_op=True)
        log.append(f"start {label}")

        def steps():
            yield
            work.wait()
            return y

        return Handle.start(steps())

    y = overlapped(start)
    log.append(f"done {label}")
    return y


def _order(rank: int, world: int) -> list[str]:
    """Each piece runs two 'layers'; every layer ends in an all-reduce. The log shows the turn
    order: piece 1 computes while piece 0's collective is in flight."""
    log: list[str] = []

    def layer(x: torch.Tensor, name: str) -> torch.Tensor:
        i = int(x[0, 0].item())
        log.append(f"compute {name}{i}")
        return _logged_all_reduce(x, log, f"{name}{i}") / world

    x = torch.arange(2.0).repeat_interleave(3).view(2, 3)  # piece i holds the value i
    out = run_pieces(lambda h: layer(layer(h, "a"), "b"), x, 2)
    assert torch.equal(out, x)
    return log


def test_pieces_take_turns_at_each_collective():
    for log in run_distributed(_order, 2, timeout=60):
        assert log[:6] == ["compute a0", "start a0", "compute a1", "start a1", "done a0", "compute b0"]
        assert log.index("done a0") > log.index("start a1")  # a0 was in flight during piece 1's layer


def test_run_pieces_checks_the_split_and_passes_errors():
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="not divisible by parallel.tp_overlap_chunks=2"):
        run_pieces(lambda h: h, x, 2)

    def boom(h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("piece failed")

    with pytest.raises(RuntimeError, match="piece failed"):
        run_pieces(boom, torch.zeros(4, 2), 2)
    y = run_pieces(lambda h: h * 2, torch.arange(4.0), 2)
    assert torch.equal(y, torch.arange(4.0) * 2)


class _LoggedReduceGrad(torch.autograd.Function):
    """forward: identity; backward: an all-reduce of the gradient from the piece, logged."""

    @staticmethod
    def forward(fctx, x, log):
        fctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(fctx, g):
        i = int(g[0, 0].item())

        return _logged_all_reduce(g, fctx.log, str(i)) / dist.get_world_size(), None


def _backward_order(rank: int, world: int) -> tuple[list[str], list[float], list[float]]:
    log: list[str] = []
    w = torch.nn.Parameter(torch.ones(3))
    x = torch.arange(2.0).repeat_interleave(3).view(2, 3).requires_grad_()
    out = run_pieces(lambda h: _LoggedReduceGrad.apply(h * w, log), x, 2, [w])
    out.backward(x.detach() + 0.0)  # piece i's gradient holds the value i
    return log, w.grad.tolist(), x.grad.flatten().tolist()


def test_backward_pieces_take_turns_and_gradients_come_back_once():
    for log, wgrad, xgrad in run_distributed(_backward_order, 2, timeout=60):
        assert log == ["start 0", "start 1", "done 0", "done 1"]  # 0's all-reduce in flight under 1
        assert wgrad == [1.0, 1.0, 1.0]  # sum over pieces of g_i * x_i: 0*0 + 1*1
        assert xgrad == [0.0] * 3 + [1.0] * 3


def test_pieces_run_under_the_callers_autocast_and_grad_mode():
    w = torch.nn.Parameter(torch.ones(3, 3))
    x = torch.ones(4, 3)
    with torch.autocast("cpu", torch.bfloat16):
        y = run_pieces(lambda h: h @ w, x, 2, [w])
    assert y.dtype == torch.bfloat16 and y.requires_grad
    y.float().sum().backward()
    assert torch.equal(w.grad, torch.full((3, 3), 4.0))  # 4 rows of ones, summed over the pieces
    with torch.no_grad():
        assert not run_pieces(lambda h: h @ w, x, 2, [w]).requires_grad
