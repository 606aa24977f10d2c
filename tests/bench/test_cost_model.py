"""The cost model of `taco.bench.cost_model` (issue #7): formulas, alpha-beta numbers, monotonicity."""

from __future__ import annotations

import math

import pytest

from taco.bench import cost_model as cm
from taco.bench import gpu_projection as gp

MB = 1e6
FAST = cm.CodecCost("fast", 1.0625, 1e12, 1e12)


def test_ideal_speedup_formula():
    assert cm.ideal_speedup(0.0, 2.0) == 1.0
    assert cm.ideal_speedup(1.0, 1.88) == pytest.approx(1.88)
    assert cm.ideal_speedup(0.85, 2 / 1.0625) == pytest.approx(1 / (0.15 + 0.85 * 1.0625 / 2))
    assert cm.ideal_speedup(0.5, 1.0) == 1.0
    with pytest.raises(ValueError):
        cm.ideal_speedup(1.2, 2.0)
    with pytest.raises(ValueError):
        cm.ideal_speedup(0.5, 0.0)


def test_link_alpha_beta_and_shared_bus():
    link = cm.Link("x", bandwidth=1e9, alpha=1e-5)
    assert link.transfer(1 * MB, world=4, hops=3) == pytest.approx(3e-5 + 1e-3)
    bus = cm.Link("lo", bandwidth=1e9, alpha=0.0, shared=True)
    assert bus.transfer(1 * MB, world=4, hops=1) == pytest.approx(4e-3)  # every rank's bytes in turn
    assert cm.gbit(100) == 12.5e9


def test_wait_is_hidden_by_the_first_phase_bytes():
    """A fixed wait (rank skew, latency) shows in full on a fast link and disappears behind the
    early rank's first-phase sends on a slow one."""
    bus = cm.Link("lo", bandwidth=1e8, shared=True, wait=2e-3)
    assert bus.transfer(1 * MB, world=2, hops=0) == pytest.approx(20e-3 + 2e-3)
    assert bus.transfer(1 * MB, world=2, hops=0, first_bytes=0.1 * MB) == pytest.approx(20e-3 + 1e-3)
    assert bus.transfer(1 * MB, world=2, hops=0, first_bytes=0.5 * MB) == pytest.approx(20e-3)
    # plain ring, 2 ranks, 1 MB: the first chunk is 0.5 MB; compressed on 2 ranks (the gather
    # all-reduce): all of its one all-gather
    assert cm.collective_time("all_reduce", 500_000, 2, 2, bus).total_s == pytest.approx(20e-3)
    slow = cm.Link("lo", bandwidth=1e9, shared=True, wait=2e-3)
    assert cm.collective_time("all_reduce", 500_000, 2, 2, slow).total_s == pytest.approx(2e-3 + 1.5e-3)
    c = cm.collective_time("all_reduce", 500_000, 2, 2, slow, FAST)  # 2 x 0.53125 MB, first all of it
    assert c.wire_s == pytest.approx(1.0625e-3 + 2e-3 - 0.53125e-3)


def test_plain_ring_all_reduce_numbers():
    link = cm.Link("x", bandwidth=1e9, alpha=1e-5)
    t2 = cm.collective_time("all_reduce", 500_000, 2, 2, link)  # 1 MB message, 2 ranks
    assert t2.wire_s == pytest.approx(2 * 1e-5 + 1e-3) and t2.code_s == 0
    t4 = cm.collective_time("all_reduce", 500_000, 2, 4, link)  # 2 (N-1)/N = 1.5 MB per rank, 6 hops
    assert t4.total_s == pytest.approx(6e-5 + 1.5e-3)
    assert cm.collective_time("all_reduce", 500_000, 2, 1, link).total_s == 0.0
    rs = cm.collective_time("reduce_scatter", 500_000, 2, 4, link)
    ag = cm.collective_time("all_gather", 500_000, 2, 4, link)
    assert rs.total_s + ag.total_s == pytest.approx(t4.total_s)  # SP moves the all-reduce's bytes


def test_compressed_two_shot_bytes_coding_and_overlap():
    link = cm.Link("x", bandwidth=1e9, alpha=0.0)
    codec = cm.CodecCost("c", 1.0, encode_rate=1e9, decode_rate=2e9)
    n = 1_000_000
    t = cm.collective_time("all_reduce", n, 2, 4, link, codec, slices=1)
    assert t.wire_s == pytest.approx(1.5e-3)  # 2 (N-1)/N * n * 1 B
    assert t.code_s == pytest.approx(n / 1e9 + 1.75 * n / 2e9)  # encode n, decode (2N-1)/N n
    assert t.total_s == pytest.approx(t.wire_s + t.code_s)
    g = cm.collective_time("all_reduce", n, 2, 2, link, codec, slices=1)  # two ranks: the gather
    assert g.wire_s == pytest.approx(1e-3)  # (N-1) * n * 1 B: the two-shot's 2 (N-1)/N
    assert g.code_s == pytest.approx(n / 1e9 + 2 * n / 2e9)  # encode n, decode N n
    t4 = cm.collective_time("all_reduce", n, 2, 4, link, codec, slices=4)
    assert t4.total_s == pytest.approx(max(t.wire_s, t.code_s) + min(t.wire_s, t.code_s) / 4)
    assert cm.collective_time("send", n, 2, 2, link, codec).wire_s == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        cm.collective_time("broadcast", n, 2, 2, link)


def test_speedup_grows_as_the_link_slows_and_stays_below_ideal():
    shape, par = gp.GPT_13B, gp.Parallel(tp=8, micro_batch=2)
    prev_t, prev_s = 0.0, 0.0
    for gbps in (3200, 800, 400, 200, 100, 25):
        hw = gp.Hardware("h", 5e14, cm.Link("l", cm.gbit(gbps), 1e-5))
        base = gp.step_time(shape, par, hw)
        comp = gp.step_time(shape, par, hw, FAST, slices=4)
        s = base.total_s / comp.total_s
        assert base.total_s > prev_t and s > prev_s
        assert s <= cm.ideal_speedup(base.tp_share, 2 / 1.0625) + 1e-9
        prev_t, prev_s = base.total_s, s


def test_tp_messages_and_flops():
    shape = gp.GPT_13B
    msgs = gp.tp_messages(shape, gp.Parallel(tp=2, micro_batch=2))
    assert len(msgs) == 4 * 40 + 2 and {m.numel for m in msgs} == {2 * 2048 * 5120}
    sp = gp.tp_messages(shape, gp.Parallel(tp=2, sp=True))
    assert sum(m.op == "all_gather" for m in sp) == sum(m.op == "reduce_scatter" for m in sp) == 4 * 40
    assert 7.5e10 < shape.flops_per_token() < 9e10  # ~6 x 13B
    qwen = gp.QWEN25_7B.matmul_params()
    assert 6.5e9 < qwen < 8e9


def test_pipeline_and_data_parallel_terms():
    hw = gp.Hardware("h", 5e14, cm.Link("l", 50e9, 1e-5))
    one = gp.step_time(gp.QWEN25_7B, gp.Parallel(tp=4, microbatches=8), hw)
    pp = gp.step_time(gp.QWEN25_7B, gp.Parallel(tp=4, pp=2, microbatches=8), hw)
    assert pp.bubble_s > 0 and pp.pp_s > 0 and pp.total_s < one.total_s
    dp = gp.step_time(gp.QWEN25_7B, gp.Parallel(tp=4, dp=4, microbatches=8), hw)
    assert dp.dp_s > 0 and dp.total_s > one.total_s


def test_measured_compute_step_with_per_dtype_codecs():
    link = cm.Link("lo", 1e7, 1e-4, shared=True)
    msgs = [cm.Message("all_reduce", 65536, 2), cm.Message("all_reduce", 65536, 4)]
    base, comm = cm.step_time_measured_compute(0.1, msgs, 2, link)
    assert comm == pytest.approx(4 * 1e-4 + 2 * 65536 * (2 + 4) / 1e7)
    assert base == pytest.approx(0.1 + comm)
    codecs = {2.0: cm.CodecCost("c", 1.0625, 1e9, 1e9), 4.0: cm.CodecCost("c", 1.0625, 5e8, 5e8)}
    comp, _ = cm.step_time_measured_compute(0.1, msgs, 2, link, codecs)
    assert comp < base


def test_projection_table():
    rows = gp.projection()
    assert len(rows) == 2 * 3 * len(gp.LINKS)
    by = {(r["model"], r["tp"], r["link"]): r for r in rows}
    assert by[("GPT-13B", 8, "IB100")]["speedup_H100"] > 1.5
    assert by[("GPT-13B", 2, "NVLink4")]["speedup_H100"] < 1.1
    assert all(
        math.isfinite(r["speedup_H200"]) and r["speedup_H200"] >= r["speedup_H100"] - 1e-9 for r in rows
    )
    text = gp.format_projection(rows)
    assert text.count("\n") == len(rows) + 1 and "speedup (H200)" in text
    assert "TFLOP/s" in gp.assumptions()
