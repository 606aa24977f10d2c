"""taco.comm: compressed collectives against torch.distributed and against the codec itself.

Every multi-rank body runs in gloo ranks spawned by tests/dist.py and returns plain values;
the assertions run in the parent. Inputs are generated from a seed, so every rank can rebuild
every other rank's tensor and the exact (fp64) reference.
"""

from __future__ import annotations

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
from taco.codec import sqnr_db
from tests.dist import run_distributed

TACO = taco.get_codec("taco")


def _inputs(world: int, shape: tuple[int, ...], dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]


def _exact_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double() for x in xs]).sum(0)


# -- codec none is the plain collective, bit for bit ------------------------------------------------
def _none_body(rank: int, world: int) -> list[tuple[str, bool]]:
    xs = _inputs(world, (8, 12))
    x = xs[rank]
    out = []
    for codec in (None, "none"):
        ref = x.clone()
        dist.all_reduce(ref)
        out.append((f"all_reduce {codec}", torch.equal(tc.all_reduce(x, codec=codec), ref)))
    ref = x.t().contiguous()
    dist.all_reduce(ref)
    out.append(("all_reduce non-contiguous", torch.equal(tc.all_reduce(x.t(), codec=None), ref)))
    h = tc.all_reduce(x, codec=None, async_op=True)
    ref = x.clone()
    dist.all_reduce(ref)
    out.append(("all_reduce async", torch.equal(h.wait(), ref)))
    for d in (0, 1):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        out.append(
            (f"all_gather dim {d}", torch.equal(tc.all_gather(x, codec=None, dim=d), torch.cat(parts, d)))
        )
    ref = torch.empty(8 // world, 12, dtype=x.dtype)
    dist.reduce_scatter_tensor(ref, x)
    out.append(("reduce_scatter dim 0", torch.equal(tc.reduce_scatter(x, codec=None), ref)))
    xi = (x * 8).round().float()  # integer values: exact sums in any order
    ref = torch.empty(8, 12 // world)
    dist.reduce_scatter(ref, [p.contiguous() for p in xi.chunk(world, 1)])
    out.append(("reduce_scatter dim 1", torch.equal(tc.reduce_scatter(xi, codec="none", dim=1), ref)))
    n = torch.arange(6) * (rank + 1)
    ref = n.clone()
    dist.all_reduce(ref)
    out.append(("all_reduce int64", torch.equal(tc.all_reduce(n, codec=None), ref)))
    if rank == 0:
        tc.send(x, 1, codec=None)
    elif rank == 1:
        out.append(("send/recv", torch.equal(tc.recv(x, 0, codec=None), xs[0])))
    out.append(("input untouched", torch.equal(x, _inputs(world, (8, 12))[rank])))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_codec_none_is_bit_identical_to_torch_distributed(world):
    for rank_result in run_distributed(_none_body, world):
        bad = [name for name, ok in rank_result if not ok]
        assert not bad, bad


# -- taco all-reduce: error bound, identical results ------------------------------------------------
def _sqnr_body(rank: int, world: int, numel: int, dtype: torch.dtype) -> tuple[float, float, torch.Tensor]:
    xs = _inputs(world, (numel,), dtype)
    ref = _exact_sum(xs)
    y = tc.all_reduce(xs[rank])
    assert y.dtype == dtype and y.shape == xs[rank].shape
    return sqnr_db(ref, y), sqnr_db(ref, TACO.roundtrip(ref.float())), y


@pytest.mark.parametrize(
    "world,numel",
    [(2, 64 * 128 + 77), (4, 32 * 128 + 5), pytest.param(8, 16 * 128 + 3, marks=pytest.mark.slow)],
)
def test_taco_all_reduce_sqnr_within_3_5_db_of_single_pass(world, numel):
    res = run_distributed(_sqnr_body, world, numel, torch.bfloat16)
    for sqnr, single, y in res:
        assert sqnr >= single - 3.5, (sqnr, single)
        assert torch.equal(y, res[0][2])  # every rank decodes the same bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_taco_all_reduce_other_dtypes(dtype):
    res = run_distributed(_sqnr_body, 2, 3000, dtype)
    for sqnr, single, y in res:
        assert sqnr >= single - 3.5 and torch.equal(y, res[0][2])


# -- all-gather and reduce-scatter: within the codec's own error ------------------------------------
def _ag_rs_body(rank: int, world: int) -> dict:
    xs = _inputs(world, (4 * world, 96))
    x = xs[rank]
    res = {}
    for d in (0, 1):
        y = tc.all_gather(x, dim=d)
        res[f"ag{d}"] = y
        res[f"ag{d}_exact"] = torch.equal(y, torch.cat([TACO.roundtrip(t) for t in xs], d))
    ref = _exact_sum(xs)
    for d in (0, 1):
        piece = ref.chunk(world, d)[rank]
        y = tc.reduce_scatter(x, dim=d)
        res[f"rs{d}_shape"] = tuple(y.shape) == tuple(piece.shape) and y.dtype == x.dtype
        res[f"rs{d}"] = (sqnr_db(piece, y), sqnr_db(piece, TACO.roundtrip(piece.float())))
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_and_reduce_scatter_within_codec_error(world):
    res = run_distributed(_ag_rs_body, world)
    for r in res:
        assert r["ag0_exact"] and r["ag1_exact"]
        assert torch.equal(r["ag0"], res[0]["ag0"]) and torch.equal(r["ag1"], res[0]["ag1"])
        for d in (0, 1):
            sqnr, single = r[f"rs{d}"]
            assert r[f"rs{d}_shape"] and sqnr >= single - 0.5, (sqnr, single)


# -- odd shapes, empty tensors, layouts, fallbacks ---------------------------------------------------
def _shapes_body(rank: int, world: int) -> list[tuple[str, bool]]:
    out = []
    for numel in (1, 3, 127, 129, 4 * 128 + 5, 1000):
        xs = _inputs(world, (numel,), seed=numel)
        y = tc.all_reduce(xs[rank])
        ys = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(ys, y)
        ok = all(torch.equal(t, y) for t in ys) and sqnr_db(_exact_sum(xs), y) > 25
        out.append((f"ragged {numel}", ok))
    e = torch.empty(0, 5, dtype=torch.bfloat16)
    out.append(("empty all_reduce", tc.all_reduce(e).shape == (0, 5)))
    out.append(("empty all_gather", tc.all_gather(e, dim=1).shape == (0, 5 * world)))
    out.append(("empty reduce_scatter", tc.reduce_scatter(e).shape == (0, 5)))
    out.append(("empty async", tc.all_reduce(e, async_op=True).wait().shape == (0, 5)))
    base = _inputs(world, (16 * world, 64 * world), seed=7)[rank]
    for name, x in (("transposed", base.t()), ("strided", base[:, ::2]), ("narrowed", base[1:5])):
        c = x.contiguous()
        out.append((f"{name} all_reduce", torch.equal(tc.all_reduce(x), tc.all_reduce(c))))
        out.append((f"{name} all_gather", torch.equal(tc.all_gather(x, dim=1), tc.all_gather(c, dim=1))))
        if x.shape[0] % world == 0:
            same = torch.equal(tc.reduce_scatter(x), tc.reduce_scatter(c))
            out.append((f"{name} reduce_scatter", same))
    scalar = torch.tensor(float(rank + 1))
    total = world * (world + 1) / 2
    out.append(("0-d all_reduce", abs(tc.all_reduce(scalar).item() - total) < 0.05 * total))
    # float64 cannot be encoded: plain collective, one log line per (site, reason), a counter
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("taco.comm").addHandler(handler)
    policy = tc.CommPolicy()
    x64 = torch.randn(10, dtype=torch.float64) + rank
    ref = x64.clone()
    dist.all_reduce(ref)
    same = [torch.equal(tc.all_reduce(x64, site="f64", policy=policy), ref) for _ in range(3)]
    out.append(("float64 plain", all(same) and policy.stats["f64"].fallbacks == 3))
    out.append(("one log line", len(seen) == 1 and "float64" in seen[0]))
    sparse = torch.sparse_coo_tensor([[rank, 3]], [1.0, 2.0], (5,))
    ref = sparse.clone()
    dist.all_reduce(ref)
    y = tc.all_reduce(sparse, site="sparse", policy=policy)
    out.append(("sparse plain", torch.equal(y.to_dense(), ref.to_dense()) and "sparse" in seen[-1]))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ragged_empty_noncontiguous_and_fallback(world):
    for rank_result in run_distributed(_shapes_body, world):
        bad = [name for name, ok in rank_result if not ok]
        assert not bad, bad


def _nan_body(rank: int, world: int) -> dict:
    x = _inputs(world, (1024,))[rank]
    if rank == 1:
        x[300] = float("nan")
    policy = tc.CommPolicy()
    y = tc.all_reduce(x, site="ar", policy=policy)
    g = tc.all_gather(x, site="ag", policy=policy)
    s = tc.reduce_scatter(x, site="rs", policy=policy)
    return {
        "ar": torch.isfinite(y).view(-1, 128).all(1).tolist(),
        "ag": torch.isfinite(g).view(-1, 128).all(1).tolist(),
        "rs": torch.isfinite(s).view(-1, 128).all(1).tolist(),
        "counts": [policy.stats[k].nonfinite for k in ("ar", "ag", "rs")],
    }


def test_nan_on_one_rank_is_non_finite_on_all_ranks():
    res = run_distributed(_nan_body, 2)
    bad_group = [i != 2 for i in range(8)]  # element 300 lies in group 2 of 128
    for rank, r in enumerate(res):
        assert r["ar"] == bad_group
        assert r["ag"] == [True] * 8 + bad_group
        assert r["rs"] == (bad_group[4:] if rank else bad_group[:4])  # only rank 0 owns group 2
        assert r["counts"] == ([1, 1, 1] if rank == 0 else [1, 1, 0])


# -- async handles and slicing ----------------------------------------------------------------------
def _async_slices_body(rank: int, world: int) -> list[tuple[str, bool]]:
    xs = _inputs(world, (24, 200), seed=3)
    x = xs[rank]
    out = []
    sync = tc.all_reduce(x)
    h1 = tc.all_reduce(x, async_op=True)
    h2 = tc.all_gather(x, async_op=True)
    h3 = tc.reduce_scatter(x, async_op=True)
    out.append(("handle pending", not h1.is_completed()))
    out.append(("async all_reduce", torch.equal(h1.wait(), sync) and h1.is_completed()))
    out.append(("async all_gather", torch.equal(h2.wait(), tc.all_gather(x))))
    out.append(("async reduce_scatter", torch.equal(h3.wait(), tc.reduce_scatter(x))))
    out.append(("wait twice", h1.wait() is h1.wait()))
    for k in (2, 3, 7, 1000):
        policy = tc.CommPolicy()
        a = tc.all_reduce(x, site="a", policy=policy)
        b = tc.all_reduce(x, site="b", policy=policy, slices=k)
        same_bytes = policy.stats["a"].wire_bytes == policy.stats["b"].wire_bytes
        out.append((f"slices={k}", torch.equal(a, b) and same_bytes))
    big = _inputs(world, (5 << 19,), seed=4)[rank]  # 2.5 MiB of bf16: sliced in 2 by default
    out.append(("default slicing", torch.equal(tc.all_reduce(big), tc.all_reduce(big, slices=1))))
    hs = [tc.all_reduce(x, slices=3, async_op=True), tc.all_reduce(x * 2, async_op=True)]
    out.append(
        ("two in flight", torch.equal(hs[0].wait(), sync) and torch.equal(hs[1].wait(), tc.all_reduce(x * 2)))
    )
    return out


def test_async_handles_and_slices_match_sync_unsliced():
    for rank_result in run_distributed(_async_slices_body, 2):
        bad = [name for name, ok in rank_result if not ok]
        assert not bad, bad


# -- policy, statistics, buffers ---------------------------------------------------------------------
def _policy_body(rank: int, world: int) -> dict:
    n = world * 128 * 8
    x = _inputs(world, (n,), seed=5)[rank]
    policy = tc.CommPolicy(overrides={"layers.*.mlp.down.fwd": "none"}, min_bytes=4096)
    res = {"rank": rank}
    ref = x.clone()
    dist.all_reduce(ref)
    res["override plain"] = torch.equal(tc.all_reduce(x, site="layers.3.mlp.down.fwd", policy=policy), ref)
    res["default taco"] = torch.equal(
        tc.all_reduce(x, site="layers.3.attn.out.fwd", policy=policy), tc.all_reduce(x)
    )
    small = x[:100]
    ref = small.clone()
    dist.all_reduce(ref)
    res["min_bytes plain"] = torch.equal(tc.all_reduce(small, site="tiny", policy=policy), ref)
    res["explicit codec wins"] = torch.equal(
        tc.all_reduce(small, codec="taco", site="tiny", policy=policy), tc.all_reduce(small)
    )
    for _ in range(2):
        tc.all_gather(x, site="ag", policy=policy)
        tc.reduce_scatter(x, site="rs", policy=policy)
    allocated = policy.buffers.allocated_bytes
    tc.all_reduce(x, site="layers.3.attn.out.fwd", policy=policy)
    tc.all_gather(x, site="ag", policy=policy)
    res["no new buffers"] = policy.buffers.allocated_bytes == allocated
    other = tc.CommPolicy(codec="taco(group_size=64)")
    tc.all_reduce(x, site="layers.3.attn.out.fwd", policy=other)
    res["stats"] = {
        k: (s.calls, s.raw_bytes, s.wire_bytes, s.fallbacks) for k, s in policy.stats.sites.items()
    }
    res["other"] = {k: (s.calls, s.raw_bytes, s.wire_bytes) for k, s in other.stats.sites.items()}
    res["summary"] = policy.stats.summary()
    policy.stats.reset()
    res["reset"] = len(policy.stats.sites) == 0
    return res


@pytest.mark.parametrize("world", [2, 4])
def test_policy_overrides_min_bytes_and_exact_byte_counts(world):
    n = world * 128 * 8  # bf16 elements: every chunk a whole number of groups
    c128, c64 = taco.get_codec("taco"), taco.get_codec("taco", group_size=64)
    raw_ar = 2 * (world - 1) * 2 * n // world
    wire_ar = 2 * (world - 1) * c128.nbytes(n // world)
    assert wire_ar == 2 * (world - 1) * c128.nbytes(n) // world
    assert wire_ar * 1.88 <= raw_ar  # taco G=128 on bf16 moves <= 1/1.88 of the plain bytes
    for r in run_distributed(_policy_body, world):
        stats = r["stats"]
        for key in (
            "override plain",
            "default taco",
            "min_bytes plain",
            "explicit codec wins",
            "no new buffers",
        ):
            assert r[key], key
        assert stats["layers.3.mlp.down.fwd"] == (1, raw_ar, raw_ar, 0)
        assert stats["layers.3.attn.out.fwd"] == (2, 2 * raw_ar, 2 * wire_ar, 0)
        # 100 elements: rank 0 owns the only chunk; the others send it to rank 0, then every
        # rank all-gathers one (padded) chunk
        raw_small = 2 * (world - 1) * 200 // world
        wire_small = raw_small + (c128.nbytes(100) if r["rank"] else 0) + (world - 1) * c128.nbytes(100)
        assert stats["tiny"] == (2, 2 * raw_small, wire_small, 0)
        assert stats["ag"] == (3, 3 * (world - 1) * 2 * n, 3 * (world - 1) * c128.nbytes(n), 0)
        assert stats["rs"] == (
            2,
            2 * (world - 1) * 2 * n // world,
            2 * (world - 1) * c128.nbytes(n // world),
            0,
        )
        assert r["other"] == {"layers.3.attn.out.fwd": (1, raw_ar, 2 * (world - 1) * c64.nbytes(n // world))}
        assert "layers.3.attn.out.fwd" in r["summary"] and r["reset"]


def test_policy_codec_for_without_distributed():
    p = tc.CommPolicy(codec="taco", options={"group_size": 64}, overrides={"*.down.*": None}, min_bytes=100)
    assert p.codec_for("layers.0.attn.out.fwd", 1000, torch.bfloat16).spec == "taco(group_size=64,fmt=e4m3)"
    assert p.codec_for("layers.0.mlp.down.fwd", 1000, torch.bfloat16) is None
    assert p.codec_for("x", 49, torch.bfloat16) is None and p.codec_for("x", 50, torch.bfloat16) is not None
    assert p.codec_for(None, 10**6, torch.float32) is not None
    assert tc.make_codec("int8-hadamard(group_size=32)").spec == "int8-hadamard(group_size=32)"
    d = tc.CommPolicy()
    assert d.slices == 4 and d.slices_for(100) == 1
    assert d.slices_for(3 << 20) == 3 and d.slices_for(1 << 30) == 4
    assert tc.CommPolicy(slices=2, min_slice_bytes=10).slices_for(100) == 2
    assert tc.make_codec("none") is None and tc.make_codec(taco.get_codec("none")) is None
    with pytest.raises(ValueError, match="choose one of"):
        tc.CommPolicy(overrides={"a": "bogus"})
    with pytest.raises(ValueError, match="slices"):
        tc.CommPolicy(slices=0)
    with pytest.raises(ValueError, match="min_bytes"):
        tc.CommPolicy(min_bytes=-1)


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
def _errors_body(rank: int, world: int) -> list[str]:
    msgs = []
    for fn in (
        lambda: tc.reduce_scatter(torch.randn(3, 4)),
        lambda: tc.all_reduce(torch.randn(10 + rank)),
        lambda: tc.all_gather(torch.randn(2, 3 + rank)),
        lambda: tc.all_reduce(torch.randn(10), slices=2 + rank),
        lambda: tc.all_reduce(torch.randn(10), codec="taco" if rank else "fp8-group"),
        lambda: tc.all_gather(torch.randn(4), dim=1),
    ):
        try:
            fn()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_mismatches_across_ranks_raise_value_error_on_every_rank():
    for msgs in run_distributed(_errors_body, 2):
        assert "not divisible by the group size 2" in msgs[0]
        assert all("ranks disagree" in m for m in msgs[1:5]), msgs
        assert "out of range" in msgs[5]


def _groups_p2p_body(rank: int, world: int) -> list[tuple[str, bool]]:
    out = []
    singles = [dist.new_group([r]) for r in range(world)]
    x = _inputs(world, (6, 128))[rank]
    for op in (tc.all_reduce, tc.all_gather, tc.reduce_scatter):
        y = op(x, group=singles[rank])
        out.append((f"{op.__name__} group of one", torch.equal(y, x) and y.data_ptr() != x.data_ptr()))
    pair = dist.new_group([1, 3])  # global ranks 1 and 3; p2p names global ranks
    xs = _inputs(world, (6, 128), dtype=torch.float16, seed=9)
    if rank == 1:
        tc.send(xs[1], 3, group=pair)
        tc.send(xs[1].t(), 3, group=pair, codec="int8-hadamard")
    elif rank == 3:
        got = tc.recv(xs[3], 1, group=pair)
        out.append(("recv taco", torch.equal(got, TACO.roundtrip(xs[1])) and got.dtype == torch.float16))
        like = xs[3].t()
        got = tc.recv(like, 1, group=pair, codec="int8-hadamard")
        ok = torch.equal(got, taco.get_codec("int8-hadamard").roundtrip(xs[1].t().contiguous()))
        out.append(("recv int8-hadamard, transposed", ok and got.shape == like.shape))
    if rank in (1, 3):
        y = tc.all_reduce(xs[rank], group=pair)
        out.append(("subgroup all_reduce", sqnr_db(xs[1].double() + xs[3].double(), y) > 25))
    if rank == 0:
        tc.send(torch.randn(7), 2)
        tc.send(torch.randn(4), 2)
    elif rank == 2:
        try:
            tc.recv(torch.empty(8), 0)
            out.append(("mismatch detected", False))
        except ValueError as e:
            out.append(("mismatch detected", "sender sent 7 elements" in str(e)))
        out.append(("channel still usable", tc.recv(torch.empty(4), 0).shape == (4,)))
    return out


def test_group_of_one_subgroups_and_send_recv():
    for rank_result in run_distributed(_groups_p2p_body, 4):
        bad = [name for name, ok in rank_result if not ok]
        assert not bad, bad


# -- the benchmark and the capped network namespace ---------------------------------------------------
def _bench(argv: list[str], path) -> list[dict]:
    from taco.bench.comm import main

    threads = torch.get_num_threads()
    try:
        assert main([*argv, "--repeats", "1", "--json", str(path)]) == 0
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
