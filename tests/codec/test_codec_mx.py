"""The hardware block formats (MXFP8/6/4, NVFP4) as codecs: bit-identical to torchao's reference,
exact wire bytes, the reliability rules, and the pure-function-of-the-block rule where it holds."""

from __future__ import annotations

import math

import pytest
import torch

import taco
from taco.codec import sqnr_db
from taco.codec.formats import unpack_bits
from taco.codec.minifloat import ELEMENT_FORMATS, from_codes, to_codes
from taco.codec.mx import MX_CODECS
from taco.codec.specs import parse_spec

MX = [n for n in MX_CODECS if n != "nvfp4"]
BYTES = {"mxfp8-e4m3": 33 / 32, "mxfp8-e5m2": 33 / 32, "mxfp6-e2m3": 25 / 32, "mxfp6-e3m2": 25 / 32,
         "mxfp4": 17 / 32}  # fmt: skip
N = 1 << 20  # values per format in the reference comparison


def torchao_mx():
    try:
        from torchao.prototype.mx_formats import constants, mx_tensor
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
    except Exception as e:  # noqa: BLE001 - any import failure means no reference here
        pytest.skip(f"torchao's mx_formats reference is not importable: {e}")
    elem = {"mxfp8-e4m3": torch.float8_e4m3fn, "mxfp8-e5m2": torch.float8_e5m2,
            "mxfp6-e2m3": constants.DTYPE_FP6_E2M3, "mxfp6-e3m2": constants.DTYPE_FP6_E3M2,
            "mxfp4": torch.float4_e2m1fn_x2}  # fmt: skip
    modes = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL}
    return mx_tensor, elem, modes


def reference_values(seed: int) -> torch.Tensor:
    """1M values over 12 decades of block magnitude (each block of 32 one magnitude)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N // 32, 32, generator=gen)
    return (x * torch.logspace(-6, 6, N // 32)[torch.randperm(N // 32, generator=gen)].view(-1, 1)).view(-1)


def payload_codes(codec, data: torch.Tensor, nb: int, offset: int = 0) -> torch.Tensor:
    """The element codes (uint8, one per value) of a wire buffer holding nb blocks."""
    p = nb * codec.block * codec.bits // 8
    raw = data[offset : offset + p]
    if codec.bits == 8:
        return raw.clone()
    return unpack_bits(raw.view(nb, -1), codec.bits).view(torch.uint8).reshape(-1) & ((1 << codec.bits) - 1)


@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("name", MX)
def test_mx_is_bit_identical_to_torchao(name, rule):
    mx_tensor, elem, modes = torchao_mx()
    x = reference_values(2 * MX.index(name) + (rule == "rceil"))
    c = taco.get_codec(name, scale_rule=rule)
    p = c.encode(x)
    nb = N // 32
    assert p.nbytes == round(N * BYTES[name]) == c.nbytes(N)
    scale, data = mx_tensor.to_mx(x.view(-1, 32), elem[name], 32, modes[rule])
    assert torch.equal(p.data[-nb:], scale.view(torch.uint8).view(-1)), "E8M0 scales"
    if name == "mxfp4":
        ref_codes = torch.stack((data & 0xF, data >> 4), -1).view(-1)  # torchao packs low nibble first
        assert torch.equal(p.data[:-nb], data.view(-1)), "packed FP4 bytes"
    elif c.bits == 6:
        ref_codes = data.view(-1)
    else:
        ref_codes = data.view(torch.uint8).view(-1)
    assert torch.equal(payload_codes(c, p.data, nb), ref_codes), "element codes"
    ref = mx_tensor.to_dtype(data, scale, elem[name], 32, torch.float32).view(-1)
    assert torch.equal(c.decode(p), ref), "decoded values"


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("per_tensor", [True, False])
def test_nvfp4_is_bit_identical_to_torchao(per_tensor, hadamard):
    try:
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            NVFP4Tensor,
            nvfp4_quantize,
            per_tensor_amax_to_scale,
        )
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torchao's NVFP4 reference is not importable: {e}")
    x = reference_values(7).view(-1, 16)
    if not per_tensor:  # one level: E4M3 alone spans 2^-9..448, keep the blocks inside it
        x = x / x.abs().amax(1, keepdim=True).clamp_min(1e-30) * torch.rand(x.shape[0], 1) * 2000
    c = taco.get_codec("nvfp4", per_tensor=per_tensor, hadamard=hadamard)
    p = c.encode(x.view(-1))
    nb = x.shape[0]
    assert p.nbytes == N * 9 // 16 + 4 * per_tensor == c.nbytes(N)
    xr = c._rotate(x)  # the 16-point Hadamard, the reference quantizes the rotated blocks
    s = per_tensor_amax_to_scale(xr.abs().amax()) if per_tensor else None
    scales, data = nvfp4_quantize(xr.contiguous(), 16, s)
    h = 4 if per_tensor else 0
    if per_tensor:
        assert torch.equal(p.data[:4], s.view(1).view(torch.uint8)), "per-tensor fp32 scale"
    assert torch.equal(p.data[h : h + nb * 8], data.view(-1)), "packed FP4 bytes"
    assert torch.equal(p.data[h + nb * 8 :], scales.view(torch.uint8).view(-1)), "E4M3 block scales"
    ref = NVFP4Tensor(data, scales, 16, torch.float32, per_tensor_scale=s).dequantize(torch.float32)
    assert torch.equal(c.decode(p), c._rotate(ref.view(-1, 16)).view(-1)), "decoded values"


def test_element_formats_round_to_nearest_even_and_saturate():
    """Every sub-byte code decodes to its value and back; midpoints round to the even code; values
    beyond the largest magnitude saturate with their sign."""
    for name in ("e2m3", "e3m2", "e2m1"):
        f = ELEMENT_FORMATS[name]
        codes = torch.arange(1 << f.bits, dtype=torch.uint8)
        v = from_codes(codes, f)
        assert torch.equal(to_codes(v, f), codes), name
        mags = v[: 1 << (f.bits - 1)]
        mid = (mags[1:] + mags[:-1]) / 2
        got = to_codes(mid, f).long()
        lo = torch.arange(len(mid))
        assert torch.equal(got, torch.where(lo % 2 == 0, lo, lo + 1)), name
        big = torch.tensor([f.fmax * 1.01, -1e30, math.inf])
        assert from_codes(to_codes(big, f), f).tolist() == [f.fmax, -f.fmax, f.fmax], name


@pytest.mark.parametrize("name", list(MX_CODECS))
def test_wire_bytes_are_exact(name):
    c = taco.get_codec(name)
    for n in (1, 15, 16, 17, 32, 33, 1000, 4096):
        x = torch.randn(n)
        nb = -(-n // c.block)
        want = nb * (c.block * c.bits // 8 + 1) + (4 if name == "nvfp4" else 0)
        assert c.encode(x).nbytes == c.nbytes(n) == want, (name, n)
    assert c.nbytes(0) == 0


@pytest.mark.parametrize("name", list(MX_CODECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_shapes_dtypes_and_axis(name, dtype):
    floor = {"mxfp4": 16, "nvfp4": 17, "mxfp8-e5m2": 22, "mxfp6-e3m2": 22}.get(name, 26)
    for shape in ((0,), (1,), (7, 33), (2, 3, 257)):
        x = torch.randn(shape).to(dtype)
        y = taco.get_codec(name).roundtrip(x)
        assert y.shape == x.shape and y.dtype == dtype
        if x.numel() > 64:
            assert sqnr_db(x.float(), y.float()) > floor, (name, shape)
    x = torch.randn(256, 64)
    x[:, 3] *= 1000  # a channel outlier: blocks along the token axis isolate it
    y = taco.get_codec(name, axis=0).roundtrip(x)
    assert y.is_contiguous() and torch.equal(y, taco.get_codec(name).roundtrip(x.t().contiguous()).t())
    if name in ("mxfp4", "nvfp4"):  # 4-bit elements: the outlier flattens its row's blocks
        assert sqnr_db(x[:, :3], y[:, :3]) > sqnr_db(x[:, :3], taco.get_codec(name).roundtrip(x)[:, :3]) + 10


@pytest.mark.parametrize("name", list(MX_CODECS))
def test_reliability_rules(name):
    """Non-finite blocks decode non-finite (others untouched), zero blocks to exact zeros, fp16
    never overflows, and the relative error holds from 1e-30 to 1e30."""
    c = taco.get_codec(name)
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(256)
        x[40] = bad
        y = c.roundtrip(x)
        blk = slice(32, 64) if c.block == 32 else slice(32, 48)
        assert not torch.isfinite(y[blk]).any(), (name, bad)
        assert torch.isfinite(y[:32]).all() and torch.isfinite(y[64:]).all(), (name, bad)
    x = torch.randn(4, 64)
    x[1] = 0
    assert torch.equal(c.roundtrip(x)[1], torch.zeros(64))
    h = torch.full((256,), 65504.0, dtype=torch.float16)
    h[::2] = -65504.0
    assert torch.isfinite(c.roundtrip(h)).all()
    x = torch.randn(32, 128)
    base = sqnr_db(x, c.roundtrip(x))
    for s in (1e-30, 1e-10, 1e10, 1e30):
        # FLOOR scales: the mantissa of a block's absmax moves the error
        assert sqnr_db(x * s, c.roundtrip(x * s)) == pytest.approx(base, abs=1.5), (name, s)
    for k in (-90, 90):  # a power of two: the same codes, exactly scaled values
        assert torch.equal(c.roundtrip(x * 2.0**k), c.roundtrip(x) * 2.0**k), (name, k)


@pytest.mark.parametrize("name", MX)
def test_mx_block_code_is_a_function_of_the_block(name):
    """A block encodes to the same bytes whatever its neighbours (a pool of very different
    magnitudes, a zero and a NaN block), whole or as the ragged tail."""
    c = taco.get_codec(name, scale_rule="rceil")
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(24, 32, generator=gen) * torch.logspace(-8, 8, 24).view(-1, 1)
    pool[5], pool[11, 3] = 0.0, math.nan
    alone = [c.encode(pool[k]).data for k in range(24)]
    pb = 32 * c.bits // 8
    for n in (1, 7, 24):
        d = c.encode(pool[:n].reshape(-1)).data
        for k in range(n):
            got = torch.cat([d[k * pb : (k + 1) * pb], d[n * pb + k : n * pb + k + 1]])
            assert torch.equal(got, alone[k]), (name, n, k)


def test_nvfp4_code_is_a_function_of_the_message():
    """NVFP4's per-tensor scale: a message encodes to the same bytes every time (recompute), its
    header carries the scale, and the same block in another message may code differently."""
    c = taco.get_codec("nvfp4")
    x = torch.randn(4096)
    a, b = c.encode(x).data, c.encode(x.clone()).data
    assert torch.equal(a, b)
    s = a[:4].clone().view(torch.float32).item()
    assert s == pytest.approx(x.abs().max().item() / (6 * 448), rel=1e-6)
    y = torch.cat([x, torch.full((16,), 50.0)])  # a louder block raises the message scale
    assert not torch.equal(c.encode(y).data[4 : 4 + 2048], a[4 : 4 + 2048])
    assert torch.equal(c.decode(c.wrap(a, (4096,), torch.float32)), c.roundtrip(x))


def _collectives_body(rank: int, world: int) -> None:
    import taco.comm as tc
    from tests.helpers.dist import assert_equal

    xs = [torch.randn(8, 96, generator=torch.Generator().manual_seed(r)) * (1 + 9 * r) for r in range(world)]
    x = xs[rank]
    for spec in ("mxfp6-e2m3", "mxfp4(scale_rule=rceil)", "nvfp4", "nvfp4(hadamard=True)"):
        name, opts = parse_spec(spec)
        c = taco.get_codec(name, **opts)
        rt = c.roundtrip
        assert_equal(tc.all_gather(x, codec=c), torch.cat([rt(v) for v in xs]), f"{spec} all_gather")
        # reduce-scatter: each chunk of 4 rows encoded on its own, decoded and summed in rank order
        # (the own piece exact)
        mine = slice(4 * rank, 4 * rank + 4)
        want = sum(v[mine] if j == rank else rt(v[mine].reshape(-1)).view(4, 96) for j, v in enumerate(xs))
        assert_equal(tc.reduce_scatter(x, codec=c), want, f"{spec} reduce_scatter")
        # all-reduce, two-shot: own chunk exact in the sum, the sum quantized again
        parts = []
        for r in range(world):
            s = sum(v[4 * r : 4 * r + 4].reshape(-1) if j == r else rt(v[4 * r : 4 * r + 4].reshape(-1))
                    for j, v in enumerate(xs))  # fmt: skip
            parts.append(rt(s))
        want = torch.cat(parts).view(8, 96)
        assert_equal(tc.all_reduce(x, codec=c, algo="two_shot"), want, f"{spec} two-shot all_reduce")
        # all-reduce as an all-gather of whole messages: each decoded as sent, summed in rank order
        want = sum(rt(v.reshape(-1)) for v in xs).view(8, 96)
        assert_equal(tc.all_reduce(x, codec=c, algo="gather"), want, f"{spec} gather all_reduce")
        if rank == 0:
            tc.send(x, 1, codec=c)
        else:
            assert_equal(tc.recv(torch.empty_like(x), 0, codec=c), rt(xs[0]), f"{spec} send/recv")


def test_hardware_formats_in_every_collective():
    """all-gather, reduce-scatter, two-shot all-reduce and send/recv with MX and NVFP4 codecs give
    exactly the composition of the codec's own round trips (docs/design.md 1.3)."""
    from tests.helpers.dist import run_distributed

    run_distributed(_collectives_body, 2)
