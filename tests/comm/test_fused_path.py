"""Issue 12: the compressed collectives run the fused operators, at most 3 codec calls per slice.

A counting proxy stands between the codec and its kernel backend; every backend call of a
collective goes through it. The results are compared with the unfused composition (decode each
received chunk, fp32 sum in rank order, re-encode, decode), computed here from the same bytes.
"""

from __future__ import annotations

import pytest
import torch

import taco
import taco.comm as tc
from tests.helpers.collectives import counted, decode32, unfused_all_reduce
from tests.helpers.dist import assert_close, assert_equal, run_distributed


def _calls(rank: int, world: int, slices: int, dtype: torch.dtype) -> dict:
    codec, proxy = counted()
    gen = [torch.Generator().manual_seed(r) for r in range(world)]
    xs = [(torch.randn(48, 96, generator=gen[r]) * (r + 1)).to(dtype) for r in range(world)]
    y = tc.all_reduce(xs[rank], codec=codec, slices=slices, algo="two_shot")
    ops = dict(proxy.calls)
    tol = 0.02 * float(sum(xs).abs().max())
    ref = unfused_all_reduce(taco.get_codec("taco"), xs, world).float()
    assert_close(y.float(), ref, f"fused vs unfused all_reduce ({dtype})", rtol=0, atol=tol)
    if slices == 1:  # same owner, group and order of every element: the unfused composition exactly
        assert_equal(y, unfused_all_reduce(taco.get_codec("taco"), xs, world), f"bit-exact ({dtype})")
    proxy.calls.clear()
    z = tc.reduce_scatter(xs[rank], codec=codec, dim=1)  # an inner dim: pieces laid out first
    rs_ops = dict(proxy.calls)
    m, ref_codec = 96 // world, taco.get_codec("taco")
    pieces = [x[:, rank * m : (rank + 1) * m].contiguous() for x in xs]  # what each rank sends here
    terms = [
        p.float() if r == rank else decode32(ref_codec, ref_codec.encode(p)) for r, p in enumerate(pieces)
    ]
    want = terms[0].clone()
    for t in terms[1:]:
        want += t
    assert_equal(z, want.to(dtype), "reduce_scatter: the unfused composition exactly")
    proxy.calls.clear()
    g = tc.all_gather(xs[rank][:8], codec=codec, dim=1)
    return {"all_reduce": ops, "reduce_scatter": rs_ops, "all_gather": dict(proxy.calls),
            "shapes": (tuple(z.shape), tuple(g.shape))}  # fmt: skip


@pytest.mark.parametrize("world,slices", [(4, 1), (4, 3), (3, 2)])
def test_at_most_three_codec_calls_per_slice(world, slices):
    for res in run_distributed(_calls, world, slices, torch.bfloat16):
        ar = res["all_reduce"]
        assert ar == {"encode_chunks": slices, "decode_sum_encode": slices, "decode_chunks": slices}, ar
        assert res["reduce_scatter"] == {"encode_chunks": 1, "decode_sum_encode": 1}, res["reduce_scatter"]
        assert res["all_gather"] == {"encode_chunks": 1, "decode_chunks": 1}, res["all_gather"]
        assert res["shapes"] == ((48, 96 // world), (8, 96 * world))


def test_fp16_all_reduce_fused_matches_unfused():
    for res in run_distributed(_calls, 2, 1, torch.float16):
        assert sum(res["all_reduce"].values()) == 3


def test_decode_writes_into_out_without_a_temporary():
    """codec.decode(out=) hands the caller's memory to the kernel (no copy of a temporary)."""
    codec, proxy = counted()
    x = torch.randn(4, 256).bfloat16()
    out = torch.empty_like(x)
    seen = []
    real = proxy.real.decode
    proxy.real.decode = lambda c, buf, y: (seen.append(y.data_ptr()), real(c, buf, y))[1]  # type: ignore
    try:
        assert codec.decode(codec.encode(x), out=out) is out
    finally:
        del proxy.real.decode
    assert seen == [out.data_ptr()]
    assert_equal(out, taco.get_codec("taco").roundtrip(x), "decode(out=)")
