import pytest
import torch
import torch.distributed as dist

from tests.dist import run_distributed


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail(rank, world):
    if rank == 1:
        raise RuntimeError("boom")
    return rank


def test_run_distributed_returns_per_rank_results():
    assert run_distributed(_sum_ranks, 2) == [1.0, 1.0]


def test_run_distributed_reports_rank_errors():
    with pytest.raises(AssertionError, match="rank 1: RuntimeError: boom"):
        run_distributed(_fail, 2)
