"""taco.comm memory and NaN/Inf accounting: the shared, capped BufferCache and sampled checks.

The BufferCache arithmetic is checked exactly without torch.distributed; the model-like
sequence and the non-finite counts run in gloo ranks (tests/helpers/dist.py) and are asserted in the
parent.
"""

from __future__ import annotations

import pytest
import torch

import taco.comm as tc
from taco.comm import BufferCache, bucket_bytes
from taco.comm.stats import SiteStats
from tests.helpers.dist import run_distributed

CPU = torch.device("cpu")
MiB = 1 << 20


# -- BufferCache without distribution -----------------------------------------------------------------
def test_bucket_bytes_size_classes():
    assert [bucket_bytes(n) for n in (0, 1, 512, 513, 4096)] == [512, 512, 512, 1024, 4096]
    # above 4 KiB: 4 classes per power of two
    sizes = (4097, 5120, 5121, 7169, 8192, 8193)
    assert [bucket_bytes(n) for n in sizes] == [5120, 5120, 6144, 8192, 8192, 10240]
    for n in (4097, 10_000, 123_457, 3 * MiB + 1):
        assert n <= bucket_bytes(n) < 1.25 * n
    with pytest.raises(ValueError):
        bucket_bytes(-1)


def test_buffer_cache_take_give_evict_and_high_water_exact():
    c = BufferCache(max_cached_bytes=2048)
    a = c.take("send", 1000, CPU)
    b = c.take("send", 1000, CPU)
    assert a.numel() == b.numel() == 1000 and a.dtype == torch.uint8 and a.is_contiguous()
    assert a.data_ptr() != b.data_ptr()  # two takers in flight never share a buffer
    assert (c.allocated_bytes, c.in_use_bytes, c.cached_bytes, c.held_high_water) == (2048, 2048, 0, 2048)
    a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
    c.give("send", a)
    assert (c.in_use_bytes, c.cached_bytes, c.cached_high_water) == (1024, 1024, 1024)
    d = c.take("send", 900, CPU)  # same size class (1024): a's buffer, nothing allocated
    assert d.numel() == 900 and d.data_ptr() == a_ptr and c.allocated_bytes == 2048
    c.give("send", b)  # idle order, oldest first: b, d
    c.give("send", d)
    assert (c.in_use_bytes, c.cached_bytes) == (0, 2048)
    e = c.take("recv", 600, CPU)  # another role: not served from the "send" buffers
    assert e.data_ptr() not in (a_ptr, b_ptr)
    assert (c.allocated_bytes, c.in_use_bytes, c.cached_bytes, c.held_high_water) == (3072, 1024, 2048, 3072)
    c.give("recv", e)  # 3072 idle > cap 2048: b, the least recently given, is dropped
    assert (c.in_use_bytes, c.cached_bytes, c.cached_high_water) == (0, 2048, 2048)
    f = c.take("send", 1000, CPU)
    assert f.data_ptr() == a_ptr and c.allocated_bytes == 3072  # d's (a's) buffer survived
    g = c.take("send", 1000, CPU)
    assert g.data_ptr() != a_ptr and c.allocated_bytes == 4096  # b's was dropped: a new one
    assert (c.in_use_bytes, c.cached_bytes) == (2048, 1024)  # f, g in use, e idle
    assert c.held_high_water == 3072  # never more at once than when e was taken
    assert c.describe() == "buffers: high-water 0.00 MiB held, 0.00 MiB cached (cap 0.00 MiB)"


def test_buffer_cache_returned_buffer_over_cap_is_dropped_and_zero_cap_reuses_nothing():
    c = BufferCache(max_cached_bytes=1000)
    c.give("x", c.take("x", 1000, CPU))  # its size class (1024) alone exceeds the cap
    assert (c.cached_bytes, c.cached_high_water, c.allocated_bytes) == (0, 0, 1024)
    z = BufferCache(max_cached_bytes=0)
    for _ in range(3):
        z.give("x", z.take("x", 10, CPU))
    assert (z.allocated_bytes, z.cached_bytes, z.held_high_water) == (3 * 512, 0, 512)


def test_buffer_cache_auto_cap_and_misuse():
    c = BufferCache()
    assert c.cap == 0
    c.give("x", c.take("x", 1000, CPU))
    assert c.cap == 4 * 1024 and c.cached_bytes == 1024  # no message noted: 4 x largest request
    c.note_message(3 * MiB)
    assert c.cap == 12 * MiB
    c.give("y", c.take("y", 2 * MiB, CPU))
    assert c.cached_bytes == 2 * MiB + 1024 and c.held_high_water == 2 * MiB + 1024
    assert c.describe() == (
        "buffers: high-water 2.00 MiB held, 2.00 MiB cached (cap 12.00 MiB, auto 4 x largest message)"
    )
    t = c.take("x", 10, CPU)
    with pytest.raises(ValueError, match="given back as"):
        c.give("y", t)
    c.give("x", t)
    with pytest.raises(ValueError, match="not a buffer taken"):
        c.give("x", t)  # twice
    with pytest.raises(ValueError, match="not a buffer taken"):
        c.give("x", torch.empty(10, dtype=torch.uint8))
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError):
            BufferCache(max_cached_bytes=bad)
        with pytest.raises(ValueError):
            tc.CommPolicy(max_cached_bytes=bad)
        with pytest.raises(ValueError):
            tc.CommPolicy(nonfinite_check_every=bad)


def test_site_stats_sampling_schedule():
    s = SiteStats()
    due = []
    for _ in range(9):
        s.calls += 1
        due.append(s.due(4))
    assert due == [True, False, False, False, True, False, False, False, True]
    assert not s.due(0) and s.due(1)


# -- a model-like sequence of compressed all-reduces -------------------------------------------------
LAYERS, KINDS, ROUNDS = 10, ("attn.out.fwd", "mlp.down.fwd", "attn.qkv.bwd", "mlp.up.bwd"), 3
SITES = [f"layers.{i}.{k}" for i in range(LAYERS) for k in KINDS]
SHAPES = {"fwd": (16, 256), "bwd": (24, 256)}  # bf16: 8 KiB and 12 KiB messages


def _x(rank: int, rnd: int, j: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rnd + 10 * j + rank)
    return torch.randn(SHAPES[SITES[j][-3:]], generator=g).to(torch.bfloat16)


FIELDS = {
    "cap": "cap",
    "cached": "cached_bytes",
    "cached_hw": "cached_high_water",
    "held_hw": "held_high_water",
    "allocated": "allocated_bytes",
    "in_use": "in_use_bytes",
    "largest": "largest_message",
    "largest_request": "largest_request",
}


def _model_body(rank: int, world: int, algo: str) -> dict:
    ref = tc.CommPolicy(codec="taco", max_cached_bytes=1 << 40, all_reduce_algo=algo)  # no cap in practice
    auto = tc.CommPolicy(codec="taco", all_reduce_algo=algo)
    tight = tc.CommPolicy(codec="taco", max_cached_bytes=20_000, all_reduce_algo=algo)  # evicts
    requested = []  # (role, nbytes) of every take of the auto policy's first round
    take = auto.buffers.take
    auto.buffers.take = lambda role, n, dev, lane: requested.append((role, n)) or take(role, n, dev, lane)
    res = {"same": True, "allocated": []}
    for rnd in range(ROUNDS):
        for j, site in enumerate(SITES):
            x = _x(rank, rnd, j)
            y_ref = tc.all_reduce(x, site=site, policy=ref)
            res["same"] &= torch.equal(tc.all_reduce(x, site=site, policy=auto), y_ref)
        if rnd == 0:
            auto.buffers.take = take
        res["allocated"].append(auto.buffers.allocated_bytes)
        # the tight policy: a layer's four sites in flight at once, so they must not share buffers
        for i in range(LAYERS):
            js = range(i * len(KINDS), (i + 1) * len(KINDS))
            hs = [tc.all_reduce(_x(rank, rnd, j), site=SITES[j], policy=tight, async_op=True) for j in js]
            ys = [h.wait() for h in hs]
            refs = [tc.all_reduce(_x(rank, rnd, j), site=SITES[j], policy=ref) for j in js]
            res["same"] &= all(torch.equal(a, b) for a, b in zip(ys, refs))
    res["requested"] = requested
    for name, p in (("auto", auto), ("tight", tight)):
        b = p.buffers
        res[name] = {k: getattr(b, attr) for k, attr in FIELDS.items()}
    res["summary"] = auto.stats.summary()
    return res


@pytest.mark.parametrize("algo,buffers", [("two_shot", 4), ("gather", 2)])
def test_model_like_sequence_stays_under_cap_and_matches_uncapped(algo, buffers):
    for r in run_distributed(_model_body, 2, algo):
        assert r["same"], "capped/shared buffers changed a result"
        a, t = r["auto"], r["tight"]
        # the gather's receive buffer (2 encoded messages) is a little larger than the message
        assert a["largest"] == 24 * 256 * 2 and a["cap"] == 4 * max(a["largest"], a["largest_request"])
        assert a["in_use"] == t["in_use"] == 0  # every buffer given back
        assert a["cached"] <= a["cached_hw"] <= a["cap"] and a["held_hw"] <= a["cap"]
        # what the per-site cache kept: every site's buffers of one call, never freed
        assert len(r["requested"]) == buffers * len(SITES)  # buffers per all-reduce of one slice
        per_site = sum(n for _, n in r["requested"])
        assert per_site > 5 * a["held_hw"], (per_site, a["held_hw"])
        # after the first round the shared buffers serve every site: nothing more is allocated
        assert r["allocated"][0] == r["allocated"][-1]
        assert t["cached_hw"] <= 20_000 and t["cached"] <= 20_000
        assert t["allocated"] > t["held_hw"]  # evicted buffers were re-allocated later
        last = r["summary"].splitlines()[-1]
        assert last.startswith("buffers: high-water ") and "auto 4 x largest message" in last
        assert f"{a['held_hw'] / MiB:.2f} MiB held" in last


# -- sampled non-finite checks ------------------------------------------------------------------------
def _nonfinite_body(rank: int, world: int) -> dict:
    x = torch.randn(4, 256).to(torch.bfloat16)
    bad = x.clone()
    if rank == 1:
        bad[2, 7] = float("nan")
    inf = x.clone()
    if rank == 0:
        inf[0, 0] = float("inf")
    every1 = tc.CommPolicy(nonfinite_check_every=1)
    every4 = tc.CommPolicy(nonfinite_check_every=4, overrides={"plain*": "none"})
    off = tc.CommPolicy(nonfinite_check_every=0)
    for _ in range(8):
        tc.all_reduce(bad, site="nan", policy=every1)
        tc.all_reduce(x, site="finite", policy=every1)
        tc.all_reduce(inf, site="plain.inf", codec="none", policy=every1)
        tc.all_reduce(bad, site="nan", policy=every4)
        tc.all_gather(bad, site="plain.ag", policy=every4)
        tc.all_reduce(bad, site="nan", policy=off)
    h = [tc.all_reduce(bad, site="async", policy=every4, async_op=True) for _ in range(5)]
    for handle in reversed(h):  # results arrive out of order: the sample is still calls 1 and 5
        handle.wait()
    counts = {}
    for name, p in (("every1", every1), ("every4", every4), ("off", off)):
        for site, s in p.stats.sites.items():
            counts[f"{name} {site}"] = (s.calls, s.checked, s.nonfinite)
    return {"counts": counts, "summary": every4.stats.summary()}


def test_sampled_nonfinite_counts_exact():
    for r in run_distributed(_nonfinite_body, 2):
        c = r["counts"]
        assert c["every1 nan"] == (8, 8, 8)
        assert c["every1 finite"] == (8, 8, 0)
        assert c["every1 plain.inf"] == (8, 8, 8)
        assert c["every4 nan"] == (8, 2, 2)
        assert c["every4 plain.ag"] == (8, 2, 2)
        assert c["every4 async"] == (5, 2, 2)
        assert c["off nan"] == (8, 0, 0)
        head, *rows = r["summary"].splitlines()
        assert head.split()[-2:] == ["checked", "nonfin"]
        total = next(row for row in rows if row.startswith("total"))
        assert total.split()[-2:] == ["6", "6"]


# -- the plain path copies no more than the collective needs ------------------------------------------
COPIES = {"aten.clone.default", "aten.copy_.default", "aten._to_copy.default"}


def _count_copies(fn) -> tuple[int, object]:
    """(copy ops dispatched while fn runs, fn's result)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += str(func) in COPIES
            return func(*args, **(kwargs or {}))

    with Count():
        result = fn()
    return Count.n, result


def _plain_copies_body(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from taco.comm.compressed import all_gather_into, reduce_scatter_into

    p = tc.CommPolicy(codec=None, check_sizes=False, nonfinite_check_every=0)
    x = torch.arange(8 * 12, dtype=torch.float32).view(8, 12) * (rank + 1)  # integers: exact sums
    x3 = x.view(1, 8, 12)
    ag, rs = torch.empty(8 * world, 12), torch.empty(8 // world, 12)
    # what torch.distributed itself copies (gloo emulates reduce_scatter with a copy)
    base = {
        "ar": _count_copies(lambda: dist.all_reduce(x.clone()))[0] - 1,
        "ag": _count_copies(lambda: all_gather_into(ag, x))[0],
        "rs": _count_copies(lambda: reduce_scatter_into(rs, x))[0],
    }
    got, same = {}, {}
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    ref_ar = x.clone()
    dist.all_reduce(ref_ar)
    calls = {
        "ar": (lambda: tc.all_reduce(x, policy=p), ref_ar),
        "ag0": (lambda: tc.all_gather(x, policy=p), torch.cat(parts, 0)),
        "ag1": (lambda: tc.all_gather(x, dim=1, policy=p), torch.cat(parts, 1)),
        "ag1 leading": (lambda: tc.all_gather(x3, dim=1, policy=p), torch.cat(parts, 0).view(1, -1, 12)),
        "rs0": (lambda: tc.reduce_scatter(x, policy=p), ref_ar.chunk(world, 0)[rank]),
        "rs1": (lambda: tc.reduce_scatter(x, dim=1, policy=p), ref_ar.chunk(world, 1)[rank]),
        "rs1 leading": (lambda: tc.reduce_scatter(x3, dim=1, policy=p), ref_ar.chunk(world, 0)[rank][None]),
    }
    for name, (fn, ref) in calls.items():
        got[name], y = _count_copies(fn)
        same[name] = torch.equal(y, ref)
    if rank == 0:
        got["send"], _ = _count_copies(lambda: tc.send(x, 1, policy=p))
    elif rank == 1:
        got["recv"], y = _count_copies(lambda: tc.recv(x, 0, policy=p))
        same["recv"] = torch.equal(y, torch.arange(96, dtype=torch.float32).view(8, 12))
    return {"base": base, "got": got, "same": same}


def test_plain_path_copies_only_what_the_collective_needs():
    for rank, r in enumerate(run_distributed(_plain_copies_body, 2)):
        assert all(r["same"].values()), r["same"]
        b, g = r["base"], r["got"]
        assert b["ar"] == 0  # torch.distributed's all_reduce works in place
        assert g["ar"] == 1  # the one copy of x into the result
        assert g["ag0"] == g["ag1 leading"] == b["ag"]  # gathered straight into the result
        assert g["ag1"] == b["ag"] + 1  # one transposing copy for an inner dim
        assert g["rs0"] == g["rs1 leading"] == b["rs"]
        assert g["rs1"] == b["rs"] + 1
        assert g["send" if rank == 0 else "recv"] == 0
