"""Shared pieces of the kernel tests: the Triton skip, the native decode-sum-encode comparison and
the structured inputs of the signs=auto tests."""

from __future__ import annotations

import pytest
import torch

import taco.kernels as K
from taco.codec.hadamard import hadamard_matrix, sign_flips


def triton_or_skip() -> None:
    if not K.triton_available():
        pytest.skip("triton not installed")
    from taco.kernels import triton_taco

    if not triton_taco.INTERPRET:
        pytest.skip("triton kernels on CPU need TRITON_INTERPRET=1 before triton is imported")


def dsum_outputs(codecs, bufs: torch.Tensor, k: int, numel: int, own: torch.Tensor, own_index: int,
                 dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each codec's decode-sum-encode of the `k` chunks in `bufs` (encoded by the first codec) and the
    raw `own` term at `own_index`: [(re-encoded bytes, fp32 sums)] in the order of `codecs`."""
    size = codecs[0].nbytes(numel)
    got = []
    for c in codecs:
        out, s = torch.empty(size, dtype=torch.uint8), torch.empty(numel)
        c.decode_sum_encode(bufs, size, k, numel, dtype, own=own, own_index=own_index, out=out, sum_out=s)
        got.append((out, s))
    return got


def assert_dsum_identical(e, n, numel: int, gen, own_indices, what: str) -> None:
    """`n`'s decode-sum-encode of two received chunks + a raw own term (bf16, at each of
    `own_indices`) gives the sums and re-encoded bytes of the reference `e`, on small integers."""
    xs = [torch.randint(-20, 21, (numel,), generator=gen).float() for _ in range(3)]
    bufs = torch.cat([e.encode(xs[0]).data, e.encode(xs[1]).data])
    for own_index in own_indices:
        (oe, se), (on, sn) = dsum_outputs((e, n), bufs, 2, numel, xs[2].bfloat16(), own_index)
        assert torch.equal(sn, se), f"{what} own@{own_index}: sums"
        assert torch.equal(on, oe), f"{what} own@{own_index}: re-encoded bytes"


def structured(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, G] groups: Gaussian plus a Walsh function (the plain rotation concentrates it: signs win) in
    even rows, plus D times a Walsh function (the signed rotation concentrates it: plain wins) in odd
    rows; and the rows' expected choice (True: signs)."""
    gen = torch.Generator().manual_seed(seed)
    w = hadamard_matrix(G)[torch.randint(0, G, (n,), generator=gen)]
    want = torch.arange(n) % 2 == 0
    base = torch.where(want[:, None], w, w * sign_flips(G))
    return 1.5 * base + torch.randn(n, G, generator=gen), want


G = 64
