"""Issue 12: the compressed collectives run the fused operators, at most 3 codec calls per slice.

A counting proxy stands between the codec and its kernel backend; every backend call of a
collective goes through it. The results are compared with the unfused composition (decode each
received chunk, fp32 sum in rank order, re-encode, decode), computed here from the same bytes.
"""

from __future__ import annotations

import collections

import pytest
import torch

import taco
import taco.comm as tc
from taco.codec.backend import KernelBackend
from tests.dist import assert_close, assert_equal, run_distributed


class Counting(KernelBackend):
    """Delegates to the codec's real backend and counts the calls by operation."""

    def __init__(self, real: KernelBackend) -> None:
        self.real, self.name, self.calls = real, real.name, collections.Counter()

    def supports(self, codec, device):
        return self.real.supports(codec, device)

    def __getattribute__(self, op: str):
        if op in ("encode", "decode", "decode_sum_encode", "encode_chunks", "decode_chunks"):
            real = object.__getattribute__(self, "real")
            object.__getattribute__(self, "calls")[op] += 1
            return getattr(real, op)
        return object.__getattribute__(self, op)


def counted(name: str = "taco") -> tuple[taco.Codec, Counting]:
    codec = taco.get_codec(name)
    proxy = Counting(codec.kernel(torch.device("cpu")))
    codec.kernel = lambda device: proxy  # type: ignore[method-assign]
    return codec, proxy


def decode32(codec: taco.Codec, packed) -> torch.Tensor:
    return codec.decode(codec.wrap(packed.data, packed.shape, torch.float32))


def unfused_all_reduce(codec: taco.Codec, xs: list[torch.Tensor], world: int) -> torch.Tensor:
    """The two-shot all-reduce composed from encode/decode calls, for one slice (slices=1)."""
    from taco.comm.compressed import group_unit, split_sizes

    flat = [x.reshape(-1) for x in xs]
    sizes = split_sizes(flat[0].numel(), world, group_unit(codec))
    starts = [sum(sizes[:j]) for j in range(world)]
    out = torch.empty_like(flat[0])
    for j in range(world):
        lo, hi = starts[j], starts[j] + sizes[j]
        if not sizes[j]:
            continue
        # received chunks decode in fp32 (not rounded to the input dtype), as the real path does
        terms = [
            flat[r][lo:hi].float() if r == j else decode32(codec, codec.encode(flat[r][lo:hi]))
            for r in range(world)
        ]
        s = terms[0].clone()
        for t in terms[1:]:
            s += t
        out[lo:hi] = codec.decode(codec.encode(s)).to(out.dtype)
    return out.view_as(xs[0])


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
