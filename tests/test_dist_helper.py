import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import assert_equal, format_failures, run_distributed


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


def _assert_on_rank_1(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    if rank == 1:
        assert t.item() == 7.0, f"sum of ranks: got {t.item()}, expected 7.0"
    dist.all_reduce(t)  # rank 0 waits for rank 1, which is gone: a gloo error second
    return t.item()


def test_failing_assert_names_its_rank_and_message_on_the_first_line():
    with pytest.raises(AssertionError) as info:
        run_distributed(_assert_on_rank_1, 2)
    lines = str(info.value).splitlines()
    assert lines[0] == "rank 1: AssertionError: sum of ranks: got 1.0, expected 7.0"
    assert any(line.startswith("rank 0: ") for line in lines[1:])  # the knock-on failure, after it
    assert "---- rank 1: AssertionError ----" in lines and "Traceback (most recent call last):" in lines


def _assert_tensor_on_ranks_0_and_2(rank, world):
    x = torch.arange(4.0)
    if rank != 1:
        assert_equal(x + rank + 1, x, f"x + {rank + 1} on rank {rank}")
    return rank


def test_every_failed_rank_is_listed_with_its_values():
    with pytest.raises(AssertionError) as info:
        run_distributed(_assert_tensor_on_ranks_0_and_2, 3)
    msg = str(info.value)
    head = [line for line in msg.splitlines() if line.startswith("rank ")]
    assert head == [
        "rank 0: AssertionError: x + 1 on rank 0: Tensor-likes are not equal!",
        "rank 2: AssertionError: x + 3 on rank 2: Tensor-likes are not equal!",
    ], msg
    assert "Greatest absolute difference: 3.0" in msg and "(2 of 3 ranks failed: 0, 2)" in msg


def test_format_failures_puts_assertions_first_and_indents_the_rest_of_the_message():
    errors = {
        0: ("RuntimeError", "Connection closed by peer", "Traceback 0"),
        3: ("AssertionError", "a: Tensor-likes are not equal!\n\nMismatched elements: 1 / 2", "Traceback 3"),
    }
    assert format_failures(errors, 4).splitlines()[:5] == [
        "rank 3: AssertionError: a: Tensor-likes are not equal!",
        "    Mismatched elements: 1 / 2",
        "rank 0: RuntimeError: Connection closed by peer",
        "(2 of 4 ranks failed: 0, 3)",
        "",
    ]


def test_assert_equal_is_exact_and_says_what_differs():
    assert_equal(torch.ones(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16), "same")
    with pytest.raises(AssertionError, match=r"(?s)^tiny: Tensor-likes are not equal.*difference: 0.0078125"):
        assert_equal(torch.ones(2), torch.ones(2) + 2**-7, "tiny")
    with pytest.raises(AssertionError, match="^dtype: .*dtype"):
        assert_equal(torch.ones(2), torch.ones(2, dtype=torch.float64), "dtype")
    with pytest.raises(AssertionError, match="^shape: .*shape"):
        assert_equal(torch.ones(2), torch.ones(3), "shape")
