"""The gather all-reduce (docs/design.md 1.3): encode all -> one all-gather -> decode-sum.

Checked against its definition composed from the codec's own calls: the fp32 sum, in rank order, of
every rank's decoded message, cast to the input dtype; the same on every rank and whatever the
slicing; two codec calls per slice and rank; on two ranks the two-shot's wire bytes exactly;
"auto" takes it on two ranks only.
"""

from __future__ import annotations

import pytest
import torch

import taco
import taco.comm as tc
from tests.helpers.collectives import counted, reference
from tests.helpers.dist import assert_equal, run_distributed


def inputs(world: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    gen = [torch.Generator().manual_seed(10 + r) for r in range(world)]
    return [(torch.randn(*shape, generator=gen[r]) * (r + 1)).to(dtype) for r in range(world)]


def _gather(rank: int, world: int, dtype: torch.dtype, shape: tuple[int, ...], algo: str) -> dict:
    codec, proxy = counted()
    xs = inputs(world, shape, dtype)
    y = tc.all_reduce(xs[rank], codec=codec, algo=algo, slices=1)
    ops = dict(proxy.calls)
    assert_equal(y, reference(taco.get_codec("taco"), xs), f"gather all_reduce vs its definition ({dtype})")
    proxy.calls.clear()
    h = tc.start_all_reduce(xs[rank], codec=codec, algo=algo, slices=3)
    assert_equal(h.wait(), y, "start_all_reduce, 3 slices: the same result")
    return {"ops": ops, "sliced_ops": dict(proxy.calls), "y": y}


def _dtypes(rank: int, world: int, shape: tuple[int, ...]) -> list[dict]:
    return [_gather(rank, world, dt, shape, "auto") for dt in (torch.bfloat16, torch.float32, torch.float16)]


def test_two_ranks_match_the_definition_with_two_codec_calls_per_slice():
    res = run_distributed(_dtypes, 2, (37, 100))  # 3700 elements: a ragged last group
    for r0, r1 in zip(*res):
        for r in (r0, r1):
            assert r["ops"] == {"encode_chunks": 1, "decode_sum_encode": 1}, r["ops"]
            assert r["sliced_ops"] == {"encode_chunks": 3, "decode_sum_encode": 3}, r["sliced_ops"]
        assert torch.equal(r0["y"].view(torch.uint8), r1["y"].view(torch.uint8))


def test_three_ranks_when_asked():
    res = run_distributed(_gather, 3, torch.bfloat16, (16, 256), "gather")
    assert all(torch.equal(r["y"], res[0]["y"]) for r in res)


def _bytes_and_choice(rank: int, world: int) -> dict:
    x = inputs(world, (64, 512), torch.bfloat16)[rank]
    out = {}
    for algo in ("two_shot", "gather", "auto"):
        pol = tc.CommPolicy(all_reduce_algo=algo, slices=1)
        y = tc.all_reduce(x, policy=pol, site="s")
        out[algo] = (pol.stats.site("s").wire_bytes, y)
    codec, proxy = counted()
    tc.all_reduce(x, codec=codec, slices=2)  # the default "auto"
    out["auto_ops"] = dict(proxy.calls)
    return out


def test_wire_bytes_and_the_auto_choice():
    for r in run_distributed(_bytes_and_choice, 2):
        (b2, y2), (bg, yg), (ba, ya) = r["two_shot"], r["gather"], r["auto"]
        assert bg == b2 > 0, (bg, b2)  # two ranks: the same bytes on the wire
        assert ba == bg and torch.equal(ya, yg)  # auto: gather
        assert not torch.equal(y2, yg)  # the two-shot quantizes the partial sums again
        assert r["auto_ops"] == {"encode_chunks": 2, "decode_sum_encode": 2}, r["auto_ops"]
    for r in run_distributed(_bytes_and_choice, 4):
        (b2, y2), (ba, ya) = r["two_shot"], r["auto"]
        assert ba == b2 and torch.equal(ya, y2)  # four ranks: auto is the two-shot
        assert r["auto_ops"] == {"encode_chunks": 2, "decode_sum_encode": 2, "decode_chunks": 2}
        assert r["gather"][0] > b2  # (N-1) C(n) against 2 (N-1)/N C(n)


def _edges(rank: int, world: int) -> dict:
    x = torch.full((4, 128), 40000.0, dtype=torch.float16)
    x[0, 0] = float("nan")
    y = tc.all_reduce(x, codec="taco", algo="gather")
    return {"inf": bool(torch.isinf(y[1:]).all()), "nan": bool(torch.isnan(y[0, 0]))}


def test_fp16_sum_overflows_to_inf_and_nan_stays():
    for r in run_distributed(_edges, 2):
        assert r == {"inf": True, "nan": True}, r


def test_unknown_algorithm_is_rejected():
    with pytest.raises(ValueError, match="all_reduce_algo"):
        tc.CommPolicy(all_reduce_algo="ring")
