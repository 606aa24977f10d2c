"""Collectives spelled out from codec calls, to check the fused paths against: a backend proxy that
counts kernel calls, the unfused two-shot all-reduce and the gather-based reference."""

from __future__ import annotations

import collections

import torch

import taco
from taco.codec.backend import KernelBackend


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


def reference(codec: taco.Codec, xs: list[torch.Tensor]) -> torch.Tensor:
    """sum_r decode_fp32(encode(x_r)) in rank order, cast to x's dtype."""
    total = decode32(codec, codec.encode(xs[0].reshape(-1))).clone()
    for x in xs[1:]:
        total += decode32(codec, codec.encode(x.reshape(-1)))
    return total.to(xs[0].dtype).view_as(xs[0])
