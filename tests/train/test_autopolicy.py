"""compression.when = "auto": the decision from given timings, and 2-rank runs whose timings are
injected (plain wins / compression wins / the prediction is contradicted) or really measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from taco.comm import CommPolicy
from taco.train.adaptive.autopolicy import (
    Message,
    SiteRecorder,
    Timing,
    decide,
    disagrees,
    gain_bound,
    predict_step_s,
)
from taco.train.config import load_config
from tests.helpers.dist import run_distributed
from tests.helpers.runs import tiny_args


def test_decide_compresses_only_where_it_beats_plain_by_the_margin():
    t = {
        "a.fwd": Timing(plain_s=1.0, compressed_s=0.5),
        "b.fwd": Timing(plain_s=1.0, compressed_s=0.98),  # 2% faster: under the 3% margin
        "c.bwd": Timing(plain_s=1.0, compressed_s=1.5),
        "d.bwd": Timing(plain_s=1.0, compressed_s=0.969),
    }
    assert decide(t, 0.03) == {"a.fwd": True, "b.fwd": False, "c.bwd": False, "d.bwd": True}
    assert decide(t, 0.0)["b.fwd"] is True
    assert decide({}, 0.03) == {}


def test_a_gain_inside_the_probes_spread_keeps_the_plain_collective():
    """The medians say 10% faster; the bound from the paired repeats says the gain may be 1%, under
    the 3% margin: plain. The same medians with a bound clearing the margin: compressed."""
    assert decide({"a": Timing(1.0, 0.9, gain_low_s=0.01)}, 0.03) == {"a": False}
    assert decide({"a": Timing(1.0, 0.9, gain_low_s=0.05)}, 0.03) == {"a": True}
    assert decide({"a": Timing(1.0, 0.99, gain_low_s=0.5)}, 0.03) == {"a": False}  # medians: 1% only
    assert decide({"a": Timing(1.0, 0.9, gain_low_s=-0.2)}, 0.0) == {"a": False}


def test_gain_bound_is_an_order_statistic_of_the_paired_differences():
    d = [0.5, -0.1, 0.3, 0.2, 0.4, 0.1, 0.6]  # 7 pairs: the 2nd smallest (P(Bin(7, 1/2) <= 1) = 6%)
    assert gain_bound(d) == 0.1
    assert gain_bound([0.3, 0.1, 0.2]) == 0.1  # 3 pairs: the smallest
    assert gain_bound(list(range(15))) == 4  # P(Bin(15, 1/2) <= 4) = 5.9%, <= 5: 15%
    assert gain_bound([2.0]) == 2.0


def test_prediction_adds_each_changed_sites_calls_times_its_time_change():
    t = {"a": Timing(0.010, 0.004), "b": Timing(0.010, 0.030), "c": Timing(0.002, 0.001)}
    calls = {"a": 2.0, "b": 3.0, "c": 1.0}
    before = {"a": True, "b": True, "c": True}
    after = {"a": True, "b": False, "c": True}
    # b goes plain: 3 calls x (10 ms - 30 ms); a and c unchanged
    assert predict_step_s(0.5, calls, t, before, after) == pytest.approx(0.5 - 3 * 0.020)
    # and back again from the new state: the inverse change
    assert predict_step_s(0.44, calls, t, after, before) == pytest.approx(0.5)
    assert predict_step_s(0.5, calls, t, before, before) == 0.5
    assert disagrees(1.2, 1.0, 0.15) and not disagrees(1.1, 1.0, 0.15)
    assert not disagrees(0.5, 1.0, 0.15)  # faster than predicted: the decision paid at least that


def test_auto_warm_up_starts_after_calibration_has_chosen_the_codecs():
    from types import SimpleNamespace

    from taco.train.adaptive import AutoPolicy, Observers, StepEnd

    cfg = load_config(None, ["--compression.when=auto", "--compression.auto_warmup_steps=2"]).compression
    policy = CommPolicy(codec="taco")
    calibration = SimpleNamespace(sampling=True)
    auto = AutoPolicy(policy, None, torch.device("cpu"), cfg, False, after=calibration)
    Observers(policy).register(auto)  # the policy's observer is now the registry
    decided: list[int] = []
    now = [0]
    auto.probe = lambda: decided.append(now[0]) or {}  # type: ignore[method-assign]
    x, taco = torch.zeros(4, 64), policy.codec_for("s.fwd", 256, torch.float32)
    for step in range(1, 7):
        now[0] = step
        calibration.sampling = step <= 3  # calibration decides at the end of step 3
        codec = taco if step <= 3 else None  # ... and turns s.fwd to plain, say
        policy.observer("s.fwd", "all_reduce", x, codec)
        auto.on_step_end(StepEnd(step, 0.1, {"step": step, "step_s": 0.1}))
    # steps 1-3 were not the warm-up: nothing recorded from them, the decision after steps 4-5
    assert decided == [5] and auto.recorder.messages == {} and auto.recorder.calls == {"s.fwd": 2}


def test_recorder_keeps_compressed_collectives_and_chains_behind_an_earlier_observer():
    seen: list[str] = []
    policy = CommPolicy(codec="taco", observer=lambda site, *a: seen.append(site))
    rec = SiteRecorder()
    mine, prev = rec, policy.observer
    policy.observer = lambda *a: (prev and prev(*a), mine(*a))
    codec = policy.codec_for("x", 256, torch.float32)
    x = torch.zeros(4, 64)
    calls = [("s.fwd", "all_reduce", codec), ("s.fwd", "all_reduce", codec), ("p.fwd", "all_reduce", None),
             ("q.bwd", "send", codec)]  # fmt: skip
    for site, op, c in calls:
        policy.observer(site, op, x, c)
    assert seen == ["s.fwd", "s.fwd", "p.fwd", "q.bwd"]
    assert rec.calls == {"s.fwd": 2, "p.fwd": 1, "q.bwd": 1}
    assert rec.messages == {"s.fwd": Message("all_reduce", (4, 64), torch.float32, codec)}
    assert rec.messages["s.fwd"].nbytes == 4 * 64 * 4
    rec.counting = False
    policy.observer("s.fwd", "all_reduce", x, codec)
    assert rec.calls["s.fwd"] == 2


def _cfg(corpus, out: Path, *extra: str):
    return load_config(None, [
        *tiny_args(corpus, out), "--model.kind=gpt", "--parallel.tp=2", "--compression.tp_codec=taco",
        "--compression.when=auto", "--compression.auto_warmup_steps=2", "--compression.auto_check_steps=2",
        "--compression.auto_repeats=2", "--train.eval_steps=1", "--train.eval_interval=0", *extra,
    ])  # fmt: skip


def _run_with(rank: int, world: int, cfg, timings) -> dict:
    """One rank of a run whose auto policy measures `timings[rank][k]` (plain_s, compressed_s) for
    every message at its k-th probe (the last entry from then on; None: really measured)."""
    import torch.distributed as dist

    from taco.train.data import resolve_data_dir
    from taco.train.trainer import Trainer

    tr = Trainer(cfg, cfg.parallel.dims().build(), resolve_data_dir(cfg.data), log=dist.get_rank() == 0)
    auto = tr.run.wing.auto
    if timings is not None:
        mine = timings[rank]
        auto.measure = lambda m: Timing(*mine[min(auto.redecisions, len(mine) - 1)])
    try:
        summary = tr.fit()
    finally:
        tr.close()
    specs = {s: m.codec.spec for s, m in auto.recorder.messages.items()}
    return dict(site_codecs=tr.run.policy.site_codecs(), summary=summary, specs=specs)


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_plain_wins_everywhere_when_the_slowest_rank_says_so(corpus, tmp_path):
    """Rank 0 alone would compress (0.5 < 1 ms); rank 1's 3 ms compressed time is the max: every rank
    of the TP group turns every site plain, and the steps after the decision send raw bytes."""
    out = tmp_path / "plain"
    res = run_distributed(
        _run_with, 2, _cfg(corpus, out, "--train.steps=6"), [[(1e-3, 0.5e-3)], [(1e-3, 3e-3)]]
    )
    sites = sorted(res[0]["specs"])
    assert (
        len(sites) >= 8 and any(s.endswith(".fwd") for s in sites) and any(s.endswith(".bwd") for s in sites)
    )
    for r in res:
        assert r["site_codecs"] == dict.fromkeys(sites, "none")
    auto = res[0]["summary"]["auto"]
    assert [d["compressed_sites"] for d in auto["decisions"]] == [0] * len(auto["decisions"])
    assert auto["sites"][sites[0]]["plain_ms"] == pytest.approx(1.0)
    assert auto["sites"][sites[0]]["compressed_ms"] == pytest.approx(3.0)
    recs = _records(out)
    assert recs[1]["auto_compressed_sites"] == 0  # the decision after step 2
    assert all(r["tp_wire_bytes"] < r["tp_raw_bytes"] for r in recs[:2])  # warm-up: compressed
    assert all(r["tp_wire_bytes"] == r["tp_raw_bytes"] > 0 for r in recs[2:])
    assert "[auto]" in (out / "comm_stats.txt").read_text()


def test_the_smallest_gain_bound_of_the_tp_group_decides(corpus, tmp_path):
    """Both ranks' medians say compression halves the call; rank 1's repeats bound the gain at 1%
    of the plain time only: every rank keeps every site plain, and the summary shows that bound."""
    out = tmp_path / "bound"
    res = run_distributed(
        _run_with, 2, _cfg(corpus, out, "--train.steps=5"), [[(1e-3, 0.5e-3, 0.4e-3)], [(1e-3, 0.5e-3, 1e-5)]]
    )
    sites = sorted(res[0]["specs"])
    for r in res:
        assert r["site_codecs"] == dict.fromkeys(sites, "none")
    row = res[0]["summary"]["auto"]["sites"][sites[0]]
    assert row["gain_low_ms"] == pytest.approx(0.01) and not row["compressed"]


def test_a_contradicted_prediction_reprobes_and_compression_returns_where_it_wins(corpus, tmp_path):
    """The first probe says plain saves ~10 s per call: the predicted step is far below the measured
    ones, so after auto_check_steps the sites are probed again (auto_max_redecisions = 1: once), and
    this time compression wins (max over ranks: 5 ms plain vs 1.5 ms): every site gets its codec back."""
    out = tmp_path / "comp"
    cfg = _cfg(corpus, out, "--train.steps=6", "--compression.auto_max_redecisions=1")
    res = run_distributed(_run_with, 2, cfg, [[(1e-3, 10.0), (5e-3, 1e-3)], [(1e-3, 10.0), (2e-3, 1.5e-3)]])
    for r in res:
        assert r["site_codecs"] == r["specs"]  # every site: its configured codec again
    auto = res[0]["summary"]["auto"]
    n = len(res[0]["specs"])
    assert auto["redecisions"] == 1
    first, second = auto["decisions"]
    assert (first["reason"], first["compressed_sites"]) == ("initial", 0)
    assert (second["reason"], second["compressed_sites"]) == ("re-decision 1", n)
    calls = sum(r["calls_per_step"] for r in auto["sites"].values())
    assert calls >= n
    assert first["predicted_step_s"] == pytest.approx(first["reference_step_s"] - calls * (10.0 - 1e-3))
    assert second["reference_step_s"] == first["measured_step_s"]
    assert second["predicted_step_s"] == pytest.approx(first["measured_step_s"] + calls * (1.5e-3 - 5e-3))
    recs = _records(out)
    assert [r["tp_wire_bytes"] < 0.6 * r["tp_raw_bytes"] for r in recs] == [
        True,
        True,
        False,
        False,
        True,
        True,
    ]
    assert recs[3]["auto_measured_step_s"] == first["measured_step_s"]


@pytest.mark.slow
def test_measured_probe_decides_the_same_on_both_ranks(corpus, tmp_path):
    out = tmp_path / "real"
    res = run_distributed(_run_with, 2, _cfg(corpus, out, "--train.steps=5"), None)
    assert res[0]["site_codecs"] == res[1]["site_codecs"]
    rows = res[0]["summary"]["auto"]["sites"]
    assert set(rows) == set(res[0]["specs"]) and all(
        r["plain_ms"] > 0 and r["compressed_ms"] > 0 for r in rows.values()
    )
    plain = {s for s, c in res[0]["site_codecs"].items() if c == "none"}
    assert plain == {s for s, r in rows.items() if not r["compressed"]}
    last = _records(out)[-1]
    assert (last["tp_wire_bytes"] == last["tp_raw_bytes"]) == (len(plain) == len(rows))


def test_bench_cluster_auto_runs_taco_with_when_auto_and_its_model_is_the_faster_choice(tmp_path):
    import argparse

    from taco.bench import cluster, cluster_analysis
    from taco.bench.cluster_analysis import Sweep, analyse, model_curves
    from taco.bench.cluster_records import LinkResult
    from taco.bench.cluster_report import format_markdown, format_report
    from tests.helpers.bench import CALIB_50, CALIB_UNCAPPED, rec

    cfg = load_config(None, ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"])
    args = argparse.Namespace(comm=["bf16"], codecs=["taco", "auto", "auto:int6-hadamard"], threads=1,
                              backend="eager", warmup=1, timeout=60)  # fmt: skip
    specs = {s["codec"]: s["config"]["compression"] for s in cluster.plan_runs(cfg, args, tmp_path)}
    assert {c: (v["tp_codec"], v["when"]) for c, v in specs.items()} == {
        "none": ("none", "always"), "taco": ("taco", "always"), "auto": ("taco", "auto"),
        "auto:int6-hadamard": ("int6-hadamard", "auto")}  # fmt: skip
    assert [cluster_analysis.auto_base(c) for c in ("auto", "auto:int5-hadamard", "taco", "autox")] == [
        "taco", "int5-hadamard", None, None]  # fmt: skip
    assert specs["auto"]["tp_codec_options"] == specs["taco"]["tp_codec_options"]
    rates = cluster.codec_rates(["auto"], 1024, 1, "eager")
    assert rates["auto/bf16"]["bytes_per_elem"] == pytest.approx(1 + 8 / 128)

    # uncapped: the auto run chose plain (its record is the baseline's numbers); at 50 Mbit/s it compresses
    plain_auto = dict(rec("bf16", "none", None, 0.10, 0.01, 2, 2), codec="auto")
    results = [
        dict(rate_mbit=None, probe=dict(bytes_per_s=1e9, rtt_s=1e-4), calib=CALIB_UNCAPPED, runs=[
            rec("bf16", "none", None, 0.10, 0.01, 2, 2), rec("bf16", "taco", None, 0.11, 0.01, 2, 2),
            plain_auto]),
        dict(rate_mbit=50.0, probe=dict(bytes_per_s=6e6, rtt_s=1e-3), calib=CALIB_50, runs=[
            rec("bf16", "none", 50.0, 1.00, 0.91, 2, 2), rec("bf16", "taco", 50.0, 0.55, 0.46, 2, 2),
            rec("bf16", "auto", 50.0, 0.56, 0.46, 2, 2)]),
    ]  # fmt: skip
    sweep = Sweep.of(cfg, modes=["bf16"], codecs=["taco", "auto"], warmup=1, burst="0b", delay_ms=0.0,
                     model_codec="inplace")  # fmt: skip
    rep = analyse([LinkResult.from_json(r) for r in results], sweep, {})
    row = {(r.rate_mbit, r.codec): r for r in rep.rows}
    assert row[(None, "auto")].r == 1.0 and row[(None, "auto")].ideal == 1.0
    assert row[(50.0, "auto")].r == pytest.approx(2 / 1.0625)
    for rate in (None, 50.0):  # the model of auto: the faster of plain and taco
        expect = min(row[(rate, "none")].model_step_s, row[(rate, "taco")].model_step_s)
        assert row[(rate, "auto")].model_step_s <= expect * (1 + 1e-9)
    assert row[(50.0, "auto")].model_step_s == pytest.approx(row[(50.0, "taco")].model_step_s)
    md = format_markdown(rep)  # two codecs: each row names its codec
    assert "auto" in format_report(rep) and "| codec | codec ms/step |" in md
    assert "| bf16 | 50 | 1000 | 0.91 | taco |" in md and "| bf16 | 50 | 1000 | 0.91 | auto |" in md
    curves = model_curves(rep, sweep)
    pairs = zip(curves["bf16/auto"], curves["bf16/taco"])
    assert all(a >= t - 1e-9 and a >= 1 - 1e-9 for (_, a), (_, t) in pairs)  # never below plain or taco


def test_without_tensor_parallelism_there_is_nothing_to_decide(corpus, tmp_path):
    from taco.train.launch import launch

    res = launch(_cfg(corpus, tmp_path / "tp1", "--parallel.tp=1", "--train.steps=3"))
    assert res["auto"]["sites"] == {} and res["auto"]["decisions"][0]["sites"] == 0
