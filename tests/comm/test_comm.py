"""taco.comm: compressed collectives against torch.distributed and against the codec itself.

Every multi-rank body runs in gloo ranks spawned by tests/helpers/dist.py and asserts there, with the
values in the message (pytest does not rewrite asserts in the ranks); `run_distributed` raises
with the failing rank and its message first. Inputs are generated from a seed, so every rank can
rebuild every other rank's tensor and the exact (fp64) reference.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

import taco
import taco.comm as tc
from taco.codec import build_codec, sqnr_db
from taco.comm.compressed import aligned
from tests.helpers.dist import assert_equal, run_distributed

TACO = taco.get_codec("taco")


def _inputs(world: int, shape: tuple[int, ...], dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]


def _exact_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in xs]).sum(0)


def _same_on_every_rank(y: torch.Tensor, what: str) -> None:
    """Every rank holds the same `y`, bit for bit (they decode the same bytes)."""
    ys = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(ys, y.contiguous())
    for r, other in enumerate(ys):
        assert_equal(other, y, f"{what}: rank {r}'s result vs this rank's")


def _assert_shape(t: torch.Tensor, want: tuple[int, ...], what: str) -> None:
    assert tuple(t.shape) == want, f"{what}: shape {tuple(t.shape)}, expected {want}"


def _assert_sqnr(sqnr: float, floor: float, what: str) -> None:
    assert sqnr >= floor, f"{what}: SQNR {sqnr:.3f} dB < {floor:.3f} dB"


# -- codec none is the plain collective, bit for bit ------------------------------------------------
def _none_body(rank: int, world: int) -> None:
    xs = _inputs(world, (8, 12))
    x = xs[rank]
    for codec in (None, "none"):
        ref = x.clone()
        dist.all_reduce(ref)
        assert_equal(tc.all_reduce(x, codec=codec), ref, f"all_reduce codec={codec!r}")
    # dist.all_reduce of the transposed layout itself (tests/comm/test_comm_none_layout.py)
    ref = x.t().clone()
    dist.all_reduce(ref)
    assert_equal(tc.all_reduce(x.t(), codec=None), ref, "all_reduce non-contiguous")
    h = tc.all_reduce(x, codec=None, async_op=True)
    ref = x.clone()
    dist.all_reduce(ref)
    assert_equal(h.wait(), ref, "all_reduce async")
    for d in (0, 1):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        assert_equal(tc.all_gather(x, codec=None, dim=d), torch.cat(parts, d), f"all_gather dim {d}")
    ref = torch.empty(8 // world, 12, dtype=x.dtype)
    dist.reduce_scatter_tensor(ref, x)
    assert_equal(tc.reduce_scatter(x, codec=None), ref, "reduce_scatter dim 0")
    xi = (x * 8).round().float()  # integer values: exact sums in any order
    ref = torch.empty(8, 12 // world)
    dist.reduce_scatter(ref, [p.contiguous() for p in xi.chunk(world, 1)])
    assert_equal(tc.reduce_scatter(xi, codec="none", dim=1), ref, "reduce_scatter dim 1")
    n = torch.arange(6) * (rank + 1)
    ref = n.clone()
    dist.all_reduce(ref)
    assert_equal(tc.all_reduce(n, codec=None), ref, "all_reduce int64")
    if rank == 0:
        tc.send(x, 1, codec=None)
    elif rank == 1:
        assert_equal(tc.recv(x, 0, codec=None), xs[0], "send/recv")
    assert_equal(x, _inputs(world, (8, 12))[rank], "input untouched")


@pytest.mark.parametrize("world", [2, 4])
def test_codec_none_is_bit_identical_to_torch_distributed(world):
    run_distributed(_none_body, world)


# -- taco all-reduce: error bound, identical results ------------------------------------------------
def _sqnr_body(rank: int, world: int, numel: int, dtype: torch.dtype) -> None:
    xs = _inputs(world, (numel,), dtype)
    ref = _exact_sum(xs)
    y = tc.all_reduce(xs[rank])
    got, sent = (y.dtype, tuple(y.shape)), (dtype, tuple(xs[rank].shape))
    assert got == sent, f"all_reduce taco: returned (dtype, shape) {got}, sent {sent}"
    single = sqnr_db(ref, TACO.roundtrip(ref.float()))
    _assert_sqnr(sqnr_db(ref, y), single - 3.5, "all_reduce taco vs exact sum (floor: single pass - 3.5 dB)")
    _same_on_every_rank(y, "all_reduce taco")


@pytest.mark.parametrize(
    "world,numel",
    [(2, 64 * 128 + 77), (4, 32 * 128 + 5), pytest.param(8, 16 * 128 + 3, marks=pytest.mark.slow)],
)
def test_taco_all_reduce_sqnr_within_3_5_db_of_single_pass(world, numel):
    run_distributed(_sqnr_body, world, numel, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_taco_all_reduce_other_dtypes(dtype):
    run_distributed(_sqnr_body, 2, 3000, dtype)


# -- all-gather and reduce-scatter: within the codec's own error ------------------------------------
def _ag_rs_body(rank: int, world: int) -> None:
    xs = _inputs(world, (4 * world, 96))
    x = xs[rank]
    for d in (0, 1):
        y = tc.all_gather(x, dim=d)
        assert_equal(
            y, torch.cat([TACO.roundtrip(t) for t in xs], d), f"all_gather dim {d} vs codec round trips"
        )
        _same_on_every_rank(y, f"all_gather dim {d}")
    ref = _exact_sum(xs)
    for d in (0, 1):
        piece = ref.chunk(world, d)[rank]
        y = tc.reduce_scatter(x, dim=d)
        got, want = (tuple(y.shape), y.dtype), (tuple(piece.shape), x.dtype)
        assert got == want, f"reduce_scatter dim {d}: (shape, dtype) {got}, expected {want}"
        single = sqnr_db(piece, TACO.roundtrip(piece.float()))
        _assert_sqnr(sqnr_db(piece, y), single - 0.5, f"reduce_scatter dim {d} (floor: single pass - 0.5 dB)")


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_and_reduce_scatter_within_codec_error(world):
    run_distributed(_ag_rs_body, world)


# -- odd shapes, empty tensors, layouts, fallbacks ---------------------------------------------------
def _shapes_body(rank: int, world: int) -> None:
    for numel in (1, 3, 127, 129, 4 * 128 + 5, 1000):
        xs = _inputs(world, (numel,), seed=numel)
        y = tc.all_reduce(xs[rank])
        _same_on_every_rank(y, f"ragged {numel}")
        sqnr = sqnr_db(_exact_sum(xs), y)
        assert sqnr > 25, f"ragged {numel}: SQNR {sqnr:.3f} dB <= 25 dB"
    e = torch.empty(0, 5, dtype=torch.bfloat16)
    _assert_shape(tc.all_reduce(e), (0, 5), "empty all_reduce")
    _assert_shape(tc.all_gather(e, dim=1), (0, 5 * world), "empty all_gather")
    _assert_shape(tc.reduce_scatter(e), (0, 5), "empty reduce_scatter")
    _assert_shape(tc.all_reduce(e, async_op=True).wait(), (0, 5), "empty async")
    base = _inputs(world, (16 * world, 64 * world), seed=7)[rank]
    for name, x in (("transposed", base.t()), ("strided", base[:, ::2]), ("narrowed", base[1:5])):
        c = x.contiguous()
        assert_equal(tc.all_reduce(x), tc.all_reduce(c), f"{name} all_reduce vs contiguous")
        assert_equal(tc.all_gather(x, dim=1), tc.all_gather(c, dim=1), f"{name} all_gather vs contiguous")
        if x.shape[0] % world == 0:
            assert_equal(tc.reduce_scatter(x), tc.reduce_scatter(c), f"{name} reduce_scatter vs contiguous")
    scalar = torch.tensor(float(rank + 1))
    total = world * (world + 1) / 2
    got = tc.all_reduce(scalar).item()
    assert abs(got - total) < 0.05 * total, f"0-d all_reduce: {got}, expected {total} within 5%"
    # float64 cannot be encoded: plain collective, one log line per (site, reason), a counter
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("taco.comm").addHandler(handler)
    policy = tc.CommPolicy()
    x64 = torch.randn(10, dtype=torch.float64) + rank
    ref = x64.clone()
    dist.all_reduce(ref)
    for i in range(3):
        assert_equal(tc.all_reduce(x64, site="f64", policy=policy), ref, f"float64 plain, call {i}")
    fallbacks = policy.stats["f64"].fallbacks
    assert fallbacks == 3, f"float64 plain: {fallbacks} fallbacks counted, expected 3"
    assert len(seen) == 1 and "float64" in seen[0], f"expected one log line about float64, got {seen}"
    sparse = torch.sparse_coo_tensor([[rank, 3]], [1.0, 2.0], (5,))
    ref = sparse.clone()
    dist.all_reduce(ref)
    y = tc.all_reduce(sparse, site="sparse", policy=policy)
    assert_equal(y.to_dense(), ref.to_dense(), "sparse plain")
    assert "sparse" in seen[-1], f"sparse plain: last log line {seen[-1]!r} does not say 'sparse'"


@pytest.mark.parametrize("world", [2, 4])
def test_ragged_empty_noncontiguous_and_fallback(world):
    run_distributed(_shapes_body, world)


def _nan_body(rank: int, world: int) -> None:
    x = _inputs(world, (1024,))[rank]
    if rank == 1:
        x[300] = float("nan")
    policy = tc.CommPolicy()
    y = tc.all_reduce(x, site="ar", policy=policy)
    g = tc.all_gather(x, site="ag", policy=policy)
    s = tc.reduce_scatter(x, site="rs", policy=policy)
    finite = [i != 2 for i in range(8)]  # element 300 lies in group 2 of 128
    for what, t, want in (
        ("all_reduce", y, finite),
        ("all_gather", g, [True] * 8 + finite),
        ("reduce_scatter", s, finite[4:] if rank else finite[:4]),  # only rank 0 owns group 2
    ):
        got = torch.isfinite(t).view(-1, 128).all(1).tolist()
        assert got == want, f"{what}: finite groups of 128 {got}, expected {want}"
    counts = [policy.stats[k].nonfinite for k in ("ar", "ag", "rs")]
    want = [1, 1, 1] if rank == 0 else [1, 1, 0]
    assert counts == want, f"non-finite counts (ar, ag, rs) {counts}, expected {want}"


def test_nan_on_one_rank_is_non_finite_on_all_ranks():
    run_distributed(_nan_body, 2)


# -- async handles and slicing ----------------------------------------------------------------------
def _async_slices_body(rank: int, world: int) -> None:
    xs = _inputs(world, (24, 200), seed=3)
    x = xs[rank]
    sync = tc.all_reduce(x)
    h1 = tc.all_reduce(x, async_op=True)
    h2 = tc.all_gather(x, async_op=True)
    h3 = tc.reduce_scatter(x, async_op=True)
    assert not h1.is_completed(), "handle pending: is_completed() before wait()"
    assert_equal(h1.wait(), sync, "async all_reduce vs sync")
    assert h1.is_completed(), "async all_reduce: not is_completed() after wait()"
    assert_equal(h2.wait(), tc.all_gather(x), "async all_gather vs sync")
    assert_equal(h3.wait(), tc.reduce_scatter(x), "async reduce_scatter vs sync")
    assert h1.wait() is h1.wait(), "wait twice: two different tensors"
    for k in (2, 3, 7, 1000):
        policy = tc.CommPolicy()
        a = tc.all_reduce(x, site="a", policy=policy)
        b = tc.all_reduce(x, site="b", policy=policy, slices=k)
        assert_equal(a, b, f"slices={k} vs unsliced")
        wire = (policy.stats["a"].wire_bytes, policy.stats["b"].wire_bytes)
        # the same encoded bytes; chunks lie 16-byte aligned, so each slice's two transfers may add
        # up to 15 bytes of padding per chunk
        assert abs(wire[1] - wire[0]) <= 2 * 15 * (world - 1) * k, f"slices={k}: wire bytes {wire}"
    big = _inputs(world, (5 << 19,), seed=4)[rank]  # 2.5 MiB of bf16: sliced in 2 by default
    assert_equal(tc.all_reduce(big), tc.all_reduce(big, slices=1), "default slicing vs slices=1")
    hs = [tc.all_reduce(x, slices=3, async_op=True), tc.all_reduce(x * 2, async_op=True)]
    assert_equal(hs[0].wait(), sync, "two in flight: the first (slices=3)")
    assert_equal(hs[1].wait(), tc.all_reduce(x * 2), "two in flight: the second")


def test_async_handles_and_slices_match_sync_unsliced():
    run_distributed(_async_slices_body, 2)


# -- policy, statistics, buffers ---------------------------------------------------------------------
def _policy_bytes(world: int) -> dict[str, int]:
    """Exact bytes the policy test moves: n bf16 elements, every chunk a whole number of groups."""
    n = world * 128 * 8
    c128 = taco.get_codec("taco")
    return {
        "n": n,
        "raw_ar": 2 * (world - 1) * 2 * n // world,
        "wire_ar": 2 * (world - 1) * c128.nbytes(n // world),
        "wire_ar_64": 2 * (world - 1) * taco.get_codec("taco", group_size=64).nbytes(n // world),
    }


def _policy_body(rank: int, world: int) -> None:
    b = _policy_bytes(world)
    n, raw_ar, wire_ar = b["n"], b["raw_ar"], b["wire_ar"]
    c128 = taco.get_codec("taco")
    x = _inputs(world, (n,), seed=5)[rank]
    policy = tc.CommPolicy(overrides={"layers.*.mlp.down.fwd": "none"}, min_bytes=4096)
    ref = x.clone()
    dist.all_reduce(ref)
    assert_equal(tc.all_reduce(x, site="layers.3.mlp.down.fwd", policy=policy), ref, "override plain")
    assert_equal(
        tc.all_reduce(x, site="layers.3.attn.out.fwd", policy=policy), tc.all_reduce(x), "default taco"
    )
    small = x[:100]
    ref = small.clone()
    dist.all_reduce(ref)
    assert_equal(tc.all_reduce(small, site="tiny", policy=policy), ref, "min_bytes plain")
    assert_equal(
        tc.all_reduce(small, codec="taco", site="tiny", policy=policy),
        tc.all_reduce(small),
        "explicit codec wins",
    )
    for _ in range(2):
        tc.all_gather(x, site="ag", policy=policy)
        tc.reduce_scatter(x, site="rs", policy=policy)
    allocated = policy.buffers.allocated_bytes
    tc.all_reduce(x, site="layers.3.attn.out.fwd", policy=policy)
    tc.all_gather(x, site="ag", policy=policy)
    now = policy.buffers.allocated_bytes
    assert now == allocated, f"no new buffers: {now} bytes allocated after repeats, {allocated} before"
    other = tc.CommPolicy(codec="taco(group_size=64)")
    tc.all_reduce(x, site="layers.3.attn.out.fwd", policy=other)
    stats = {k: (s.calls, s.raw_bytes, s.wire_bytes, s.fallbacks) for k, s in policy.stats.sites.items()}
    # 100 elements, two-shot (4 ranks): rank 0 owns the only chunk; the others send it to rank 0,
    # then every rank all-gathers one (padded) chunk; gather (2 ranks, "auto"): every rank sends
    # its one encoded message to the other
    raw_small = 2 * (world - 1) * 200 // world
    padded = aligned(c128.nbytes(100))  # chunks lie 16-byte aligned in the buffers that travel
    if world == 2:
        wire_small = raw_small + padded
    else:
        wire_small = raw_small + (padded if rank else 0) + (world - 1) * padded
    for site, want in (
        ("layers.3.mlp.down.fwd", (1, raw_ar, raw_ar, 0)),
        ("layers.3.attn.out.fwd", (2, 2 * raw_ar, 2 * wire_ar, 0)),
        ("tiny", (2, 2 * raw_small, wire_small, 0)),
        ("ag", (3, 3 * (world - 1) * 2 * n, 3 * (world - 1) * c128.nbytes(n), 0)),
        ("rs", (2, 2 * (world - 1) * 2 * n // world, 2 * (world - 1) * c128.nbytes(n // world), 0)),
    ):
        got = stats.get(site)
        assert got == want, f"stats[{site!r}] (calls, raw, wire, fallbacks): {got}, expected {want}"
    got_other = {k: (s.calls, s.raw_bytes, s.wire_bytes) for k, s in other.stats.sites.items()}
    want_other = {"layers.3.attn.out.fwd": (1, raw_ar, b["wire_ar_64"])}
    assert got_other == want_other, f"taco(group_size=64) stats: {got_other}, expected {want_other}"
    summary = policy.stats.summary()
    assert "layers.3.attn.out.fwd" in summary, f"summary lacks layers.3.attn.out.fwd:\n{summary}"
    policy.stats.reset()
    assert len(policy.stats.sites) == 0, f"reset left sites {list(policy.stats.sites)}"


@pytest.mark.parametrize("world", [2, 4])
def test_policy_overrides_min_bytes_and_exact_byte_counts(world):
    b = _policy_bytes(world)
    assert b["wire_ar"] == 2 * (world - 1) * taco.get_codec("taco").nbytes(b["n"]) // world
    assert b["wire_ar"] * 1.88 <= b["raw_ar"]  # taco G=128 on bf16 moves <= 1/1.88 of the plain bytes
    run_distributed(_policy_body, world)


def test_policy_codec_for_without_distributed():
    p = tc.CommPolicy(codec="taco", options={"group_size": 64}, overrides={"*.down.*": None}, min_bytes=100)
    assert p.codec_for("layers.0.attn.out.fwd", 1000, torch.bfloat16).spec == "taco(group_size=64,fmt=e4m3)"
    assert p.codec_for("layers.0.mlp.down.fwd", 1000, torch.bfloat16) is None
    assert p.codec_for("x", 49, torch.bfloat16) is None and p.codec_for("x", 50, torch.bfloat16) is not None
    assert p.codec_for(None, 10**6, torch.float32) is not None
    want = "int8-hadamard(group_size=32,signs=auto,scale_fmt=bf16)"  # every option spelled out
    assert build_codec("int8-hadamard(group_size=32)").spec == want
    d = tc.CommPolicy()
    assert d.slices == 4 and d.slices_for(100) == 1
    assert d.slices_for(3 << 20) == 3 and d.slices_for(1 << 30) == 4
    assert tc.CommPolicy(slices=2, min_slice_bytes=10).slices_for(100) == 2
    assert build_codec("none") is None and build_codec(taco.get_codec("none")) is None
    # the default `codec` is a sentinel, not a name: an explicit "taco" is never mistaken for it
    assert not isinstance(tc.DEFAULT_CODEC, str) and tc.DEFAULT_CODEC != "taco"
    assert inspect.signature(tc.all_reduce).parameters["codec"].default is tc.DEFAULT_CODEC
    with pytest.raises(ValueError, match="choose one of"):
        tc.CommPolicy(overrides={"a": "bogus"})
    with pytest.raises(ValueError, match="slices"):
        tc.CommPolicy(slices=0)
    with pytest.raises(ValueError, match="min_bytes"):
        tc.CommPolicy(min_bytes=-1)


def test_site_codec_override_wins_over_globs():
    p = tc.CommPolicy(codec="taco", overrides={"*.down.*": None})
    p.set_site_codec("layers.0.mlp.down.fwd", "int8-hadamard", {"group_size": 64})
    p.set_site_codec("layers.1.attn.out.fwd", "none")
    want = "int8-hadamard(group_size=64,signs=auto,scale_fmt=bf16)"
    assert p.codec_for("layers.0.mlp.down.fwd", 1000, torch.float32).spec == want
    assert p.codec_for("layers.1.mlp.down.fwd", 1000, torch.float32) is None  # the glob still applies
    assert p.codec_for("layers.1.attn.out.fwd", 1000, torch.float32) is None
    assert p.codec_for("layers.2.attn.out.fwd", 1000, torch.float32).spec.startswith("taco")
    assert p.site_codecs() == {"layers.0.mlp.down.fwd": want, "layers.1.attn.out.fwd": "none"}
    assert f"layers.0.mlp.down.fwd: {want}" in p.describe()


def _observer_body(rank: int, world: int) -> list:
    seen = []
    p = tc.CommPolicy(codec="taco", overrides={"b": None})
    p.observer = lambda site, op, x, codec: seen.append([site, op, list(x.shape), codec and codec.name])
    x = torch.randn(4, 256)
    before = x.clone()
    tc.all_reduce(x, site="a", policy=p)
    tc.all_gather(x, site="b", policy=p)
    tc.reduce_scatter(x, policy=p)
    assert torch.equal(x, before)
    return seen


def test_policy_observer_sees_every_call_before_it_runs():
    for seen in run_distributed(_observer_body, 2):
        assert seen == [
            ["a", "all_reduce", [4, 256], "taco"],
            ["b", "all_gather", [4, 256], None],
            ["reduce_scatter", "reduce_scatter", [4, 256], "taco"],
        ]


def test_argument_errors_without_distributed():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="unknown codec 'bogus'.*taco"):
        tc.all_reduce(x, codec="bogus")
    with pytest.raises(TypeError, match="codec='none'"):
        tc.all_reduce(torch.arange(8), codec="taco")
    with pytest.raises(TypeError, match="codec='none'"):
        tc.reduce_scatter(torch.arange(8), policy=tc.CommPolicy())
    with pytest.raises(TypeError, match="codec='none'"):
        tc.recv(torch.zeros(3, dtype=torch.int32), 0)


# -- errors, groups, point-to-point ------------------------------------------------------------------
def _errors_body(rank: int, world: int) -> None:
    for what, fn, want in (
        (
            "reduce_scatter of 3 rows",
            lambda: tc.reduce_scatter(torch.randn(3, 4)),
            "not divisible by the group size 2",
        ),
        ("all_reduce numel", lambda: tc.all_reduce(torch.randn(10 + rank)), "ranks disagree"),
        ("all_gather shape", lambda: tc.all_gather(torch.randn(2, 3 + rank)), "ranks disagree"),
        ("all_reduce slices", lambda: tc.all_reduce(torch.randn(10), slices=2 + rank), "ranks disagree"),
        (
            "all_reduce codec",
            lambda: tc.all_reduce(torch.randn(10), codec="taco" if rank else "fp8-group"),
            "ranks disagree",
        ),
        ("all_gather dim 1 of 1-d", lambda: tc.all_gather(torch.randn(4), dim=1), "out of range"),
    ):
        try:
            fn()
        except ValueError as e:
            assert want in str(e), f"{what}: ValueError {str(e)!r} does not say {want!r}"
        else:
            raise AssertionError(f"{what}: no ValueError (expected one saying {want!r})")


def test_mismatches_across_ranks_raise_value_error_on_every_rank():
    run_distributed(_errors_body, 2)


def _groups_p2p_body(rank: int, world: int) -> None:
    singles = [dist.new_group([r]) for r in range(world)]
    x = _inputs(world, (6, 128))[rank]
    for op in (tc.all_reduce, tc.all_gather, tc.reduce_scatter):
        y = op(x, group=singles[rank])
        assert_equal(y, x, f"{op.__name__} group of one")
        assert y.data_ptr() != x.data_ptr(), f"{op.__name__} group of one: returned its input's storage"
    pair = dist.new_group([1, 3])  # global ranks 1 and 3; p2p names global ranks
    xs = _inputs(world, (6, 128), dtype=torch.float16, seed=9)
    if rank == 1:
        tc.send(xs[1], 3, group=pair)
        tc.send(xs[1].t(), 3, group=pair, codec="int8-hadamard")
    elif rank == 3:
        got = tc.recv(xs[3], 1, group=pair)
        assert got.dtype == torch.float16, f"recv taco: dtype {got.dtype}, expected torch.float16"
        assert_equal(got, TACO.roundtrip(xs[1]), "recv taco vs the sender's round trip")
        like = xs[3].t()
        got = tc.recv(like, 1, group=pair, codec="int8-hadamard")
        _assert_shape(got, tuple(like.shape), "recv int8-hadamard, transposed")
        want = taco.get_codec("int8-hadamard").roundtrip(xs[1].t().contiguous())
        assert_equal(got, want, "recv int8-hadamard, transposed, vs the sender's round trip")
    if rank in (1, 3):
        y = tc.all_reduce(xs[rank], group=pair)
        sqnr = sqnr_db(xs[1].double() + xs[3].double(), y)
        assert sqnr > 25, f"subgroup all_reduce: SQNR {sqnr:.3f} dB <= 25 dB"
    if rank == 0:
        tc.send(torch.randn(7), 2)
        tc.send(torch.randn(4), 2)
    elif rank == 2:
        try:
            tc.recv(torch.empty(8), 0)
        except ValueError as e:
            assert "sender sent 7 elements" in str(e), f"mismatch detected: ValueError {str(e)!r}"
        else:
            raise AssertionError("mismatch detected: recv of 8 elements from a send of 7 did not raise")
        _assert_shape(tc.recv(torch.empty(4), 0), (4,), "channel still usable")
    # Ranks 0 and 2 finish first; without this they could tear the default group down while 1 and 3
    # still use it under `new_group([1, 3])` (seen as a gloo "Broken pipe" on a loaded machine).
    dist.barrier()


def test_group_of_one_subgroups_and_send_recv():
    run_distributed(_groups_p2p_body, 4)


# -- the benchmark and the capped network namespace ---------------------------------------------------
def _bench(argv: list[str], path) -> list[dict]:
    from tests.helpers.bench import run_bench

    threads = torch.get_num_threads()
    try:
        assert run_bench("comm", [*argv, "--repeats", "1", "--json", str(path)]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(path.read_text())


def test_bench_comm_runs_every_variant_and_writes_json(tmp_path):
    argv = ["--sizes", "64K", "--world", "2", "--slices", "1,2", "--ops", "all_reduce,all_gather"]
    rows = _bench(argv, tmp_path / "comm.json")["rows"]
    got = {(r["op"], r["codec"], r["slices"]) for r in rows}
    want = {("all_reduce", "bf16", 1), ("all_reduce", "taco", 1), ("all_reduce", "taco", 2)}
    assert got == want | {("all_gather", "bf16", 1), ("all_gather", "taco", 1)}
    for r in rows:
        if r["codec"] == "taco":
            assert r["raw_bytes"] / r["wire_bytes"] >= 1.88 and r["buffers_repeat"] == 0 and r["sqnr_db"] > 28


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2",
)


@needs_root
def test_netns_caps_lo_and_always_deletes_the_namespace():
    from taco.bench.netns import NetNamespace

    ns = NetNamespace(rate_mbit=50)
    with pytest.raises(RuntimeError, match="inside"), ns:
        assert ns.exists()
        cmd = ns.command(["tc", "qdisc", "show", "dev", "lo"])
        show = subprocess.run(cmd, capture_output=True, text=True)
        assert "tbf" in show.stdout and "50Mbit" in show.stdout
        raise RuntimeError("inside")
    assert not ns.exists()
    broken = NetNamespace(rate_mbit=50, burst="not-a-size")  # tc fails after `ip netns add`
    with pytest.raises(RuntimeError, match="tbf"), broken:
        pass
    assert not broken.exists()


def test_netns_without_root_says_so(monkeypatch):
    from taco.bench import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(netns.shutil, "which", lambda name: f"/usr/sbin/{name}")
    with pytest.raises(netns.BenchError, match="needs root"):
        netns.NetNamespace(10).__enter__()


@needs_root
def test_bench_comm_reexecutes_inside_a_capped_namespace(tmp_path):
    data = _bench(["--sizes", "64K", "--world", "2", "--rate", "200"], tmp_path / "capped.json")
    assert "tbf rate 200 Mbit/s" in data["meta"]["link"]
    assert {r["codec"] for r in data["rows"]} == {"bf16", "taco"}
    ns = data["meta"]["link"].split()[1].rstrip(":")  # "netns taco-PID-XXXX: lo tbf ..."
    assert ns.startswith("taco-")
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns not in names  # this run's namespace is gone (others' concurrent ones may exist)
