"""The AVX-512 paths of taco_cpu.c (issue 12): the same bytes as the portable scalar loops.

The library the backend loads (-march=native: AVX-512 where the CPU has it) is compared with a build
of the same source without AVX-512 (-mno-avx512f: every batch step takes the scalar loops), and
both with the eager reference. Bytes must be identical on every finite input (random, 1e-30 ..
1e30, zeros, -0, subnormals) for every codec, input and output dtype, and size (16-group batches and
ragged single groups); on inputs with NaN/Inf the NaN positions and every other byte must agree (a
NaN's sign is whichever operand x86 propagates, an order compilers may choose). The old-vs-new
revision check with timings is `benchmarks/native_simd_check.py`.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch

import taco
from benchmarks.native_simd_check import CODECS, DTYPES, build_with, decode, dsum, encode, same
from taco.kernels import native
from tests.helpers.kernel_checks import check_pair

pytestmark = [
    pytest.mark.usefixtures("legacy_int_defaults"),  # written against the former intB-hadamard settings
    pytest.mark.skipif(native.library() is None, reason="no C compiler: native kernels not built"),
    pytest.mark.filterwarnings("ignore:(All-NaN|invalid value):RuntimeWarning"),
]


@pytest.fixture(scope="module")
def scalar_lib():
    """The kernels built without AVX-512 (the scalar loops), next to the loaded library."""
    with tempfile.TemporaryDirectory() as d:
        yield build_with("-mno-avx512f", Path(d), "scalar")


def finite_inputs(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Finite in `dtype`: magnitudes 1e-30 .. 1e30 (fp16: 1e-8 .. 1e4), zeros, -0, subnormals."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 4) if dtype == torch.float16 else (-30, 30)
    mag = 10.0 ** (torch.rand(n, generator=gen) * (hi - lo) + lo)
    sub = torch.randint(-50, 50, (n,), generator=gen).float() * 2.0**-149  # fp32 subnormals
    xs = [
        torch.randn(n, generator=gen) * mag,
        torch.zeros(n),
        -torch.zeros(n),
        sub,
        torch.randn(n, generator=gen),
    ]
    return [x.to(dtype) for x in xs]


def special_input(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 100
    edge = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 3e38])
    hit = torch.rand(n, generator=gen) < 0.03
    x[hit] = edge[torch.randint(0, edge.numel(), (int(hit.sum()),), generator=gen)]
    return x.to(dtype)


def same_but_nan_signs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal NaN positions and bit-identical elsewhere (float tensors)."""
    na, nb = a.isnan(), b.isnan()
    return torch.equal(na, nb) and same(a[~na].contiguous(), b[~nb].contiguous())


def wire_equal_but_nan_signs(codec, a: torch.Tensor, b: torch.Tensor, n: int) -> bool:
    """Two encodings: the scales and the decoded values agree up to NaN signs."""
    lib = native.library()
    (_, sa), (_, sb) = codec._split(a), codec._split(b)
    scales = all(same_but_nan_signs(x.view(torch.float32), y.view(torch.float32)) for x, y in zip(sa, sb))
    ya, yb = decode(lib, codec, a, n, torch.float32), decode(lib, codec, b, n, torch.float32)
    return scales and same_but_nan_signs(ya, yb)


@pytest.mark.parametrize("g", [32, 128])
def test_simd_matches_the_reference(g):
    """The eager reference criterion of tests/kernels/test_kernels.py on batches and ragged groups."""
    check_pair("native", g, 40)


@pytest.mark.parametrize("g", [32, 128, 512])
def test_simd_is_the_scalar_build_bytewise(scalar_lib, g):
    simd = native.library()
    for name, opts in CODECS:
        codec = taco.get_codec(name, group_size=g, backend="native", **opts)
        for n in (g + 3, 35 * g + 5):  # a ragged group; 2 batches + 3 single groups
            for dt in DTYPES:
                for i, x in enumerate(finite_inputs(n, dt, seed=n)):
                    a, b = encode(scalar_lib, codec, x), encode(simd, codec, x)
                    assert same(a, b), f"encode {name} {opts} G={g} n={n} {dt} input {i}"
                    for odt in DTYPES:
                        ya, yb = decode(scalar_lib, codec, a, n, odt), decode(simd, codec, a, n, odt)
                        assert same(ya, yb), f"decode {name} {opts} G={g} n={n} {dt} -> {odt}"
                xs = special_input(n, dt, seed=n)
                a, b = encode(scalar_lib, codec, xs), encode(simd, codec, xs)
                assert wire_equal_but_nan_signs(codec, a, b, n), (
                    f"encode {name} {opts} G={g} n={n} {dt} NaN/Inf"
                )
            bufs = torch.cat([encode(simd, codec, x) for x in finite_inputs(n, torch.float32, seed=n)[:3]])
            own = finite_inputs(n, torch.bfloat16, seed=n + 7)[0]
            for own_t, idx, sdt in (
                (None, 0, torch.float32),
                (own, 1, torch.bfloat16),
                (own.float(), 3, None),
            ):
                ra = dsum(scalar_lib, codec, bufs, 3, n, own_t, idx, True, sdt)
                rb = dsum(simd, codec, bufs, 3, n, own_t, idx, True, sdt)
                assert same(ra[0], rb[0]) and same(ra[1], rb[1]), f"dsum {name} {opts} G={g} n={n} own@{idx}"


def test_a_group_codes_alike_in_a_batch_and_alone():
    """Group k of a 17-group tensor (16 in a SIMD batch, one single) is that group encoded alone."""
    lib, g = native.library(), 128
    for name, opts in CODECS:
        codec = taco.get_codec(name, group_size=g, backend="native", **opts)
        x = finite_inputs(17 * g, torch.bfloat16, seed=3)[0]
        whole = encode(lib, codec, x)
        q, scales = codec._split(whole)  # payload [ng, G bits / 8], scales [ng, 1] each
        for k in (0, 7, 15, 16):
            qa, sa = codec._split(encode(lib, codec, x[k * g : (k + 1) * g].contiguous()))
            assert torch.equal(q[k], qa[0]), f"{name} {opts} group {k}"
            for s, s1 in zip(scales, sa):
                assert same(s[k], s1[0]), f"{name} {opts} group {k} scale"
