"""Codec none is the plain collective bit for bit (docs/design.md 2.1), for every memory layout: a
backend reduces a dense tensor in memory order, so a copy made contiguous would be summed in another
order and, from three ranks on, round differently."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import taco.comm as tc
from tests.helpers.dist import run_distributed

VIEWS = {  # fresh views of the same [6, 40, 50] values
    "transposed 3-d": lambda t: t.transpose(0, 2),
    "permuted 3-d": lambda t: t.permute(1, 2, 0),
    "contiguous": lambda t: t,
    "strided slice": lambda t: t[:, ::2],
}


def _body(rank: int, world: int) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(100 + rank)
        # values of very different magnitudes: the order of a 3- or 4-term sum changes its rounding
        base = (torch.randn(6, 40, 50, generator=gen) * torch.logspace(-3, 3, 50)).to(dtype)
        for what, view in VIEWS.items():
            want = view(base.clone())
            dist.all_reduce(want)  # in place, on a tensor of exactly this layout
            for codec in (None, "none"):
                x = view(base.clone())
                got = tc.all_reduce(x, codec=codec)
                assert got.shape == x.shape and got.dtype == dtype
                assert torch.equal(got, want), f"{what} {dtype} codec={codec!r}: differs from dist.all_reduce"
                assert torch.equal(x, view(base)), "the input is left as it was"


@pytest.mark.parametrize("world", [3, 4])
def test_codec_none_all_reduce_is_dist_all_reduce_for_any_layout(world):
    run_distributed(_body, world)


def _donate_body(rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(7 + rank)
    base = torch.randn(4, 8, 64, generator=gen).to(torch.bfloat16)
    want = base.clone()
    dist.all_reduce(want)
    x = base.clone()
    got = tc.all_reduce(x, codec=None, donate=True)
    assert got is x and torch.equal(got, want), "plain + donate: summed in x's own memory"
    t = base.transpose(0, 2).contiguous().transpose(0, 2)  # not contiguous: copied, as without donate
    got = tc.all_reduce(t, codec=None, donate=True)
    assert got is not t and torch.equal(got, want) and torch.equal(t, base)
    x = base.clone()
    got = tc.all_reduce(x, codec="int8-hadamard", donate=True)
    assert got is not x and torch.equal(x, base), "a compressed all-reduce leaves a donated x as it was"


def test_a_donated_input_is_summed_in_place_by_the_plain_all_reduce_only():
    run_distributed(_donate_body, 2)
