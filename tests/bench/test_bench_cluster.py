"""`taco bench cluster` (issue #7): no-root message, analysis of run records, a real capped run (slow)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
from pathlib import Path

import pytest

from taco.bench import cluster
from taco.bench.cluster_analysis import Sweep, analyse
from taco.bench.cluster_records import LinkResult, RunRecord, pool_runs
from taco.bench.cluster_report import format_markdown, format_report
from taco.codec.specs import split_specs
from taco.train.config import load_config
from tests.helpers.bench import CALIB_50, CALIB_UNCAPPED, NUMEL, rec, run_bench


def test_without_root_it_says_so_and_exits_nonzero(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/sbin/{name}")
    assert run_bench("cluster", ["--rates", "50"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "CAP_NET_ADMIN" in err


def test_unknown_extra_arguments_are_rejected(capsys):
    assert run_bench("cluster", ["--rates", "50", "stray"]) == 2
    assert "unrecognized arguments: stray" in capsys.readouterr().err


def _report(bwd: int = 2):
    cfg = load_config(None, ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"])
    sweep = Sweep.of(cfg, modes=["bf16"], codecs=["taco"], warmup=1, burst="0b", delay_ms=0.0,
                     model_codec="inplace")  # fmt: skip
    results = [
        dict(rate_mbit=None, probe=dict(bytes_per_s=1e9, rtt_s=1e-4), calib=CALIB_UNCAPPED, runs=[
            rec("bf16", "none", None, 0.10, 0.01, 2, bwd), rec("bf16", "taco", None, 0.11, 0.01, 2, bwd)]),
        dict(rate_mbit=50.0, probe=dict(bytes_per_s=6e6, rtt_s=1e-3), calib=CALIB_50, runs=[
            rec("bf16", "none", 50.0, 1.00, 0.91, 2, bwd), rec("bf16", "taco", 50.0, 0.55, 0.46, 2, bwd)]),
    ]  # fmt: skip
    rates = {"taco/bf16": dict(encode=1e8, decode=1e8, bytes_per_elem=1.0625)}
    rates["taco/fp32"] = rates["taco/bf16"]
    return analyse([LinkResult.from_json(r) for r in results], sweep, rates)


def test_analysis_f_r_speedup_ideal_and_model():
    rep = _report()
    assert rep.wire_dtype["bf16"] == {"fwd": 2.0, "bwd": 2.0}
    row = next(r for r in rep.rows if r.rate_mbit == 50.0 and r.codec == "taco")
    assert row.f == pytest.approx(0.91)
    assert row.r == pytest.approx(2 / 1.0625)
    assert row.speedup == pytest.approx(1.0 / 0.55)
    assert row.ideal == pytest.approx(1 / (1 - 0.91 + 0.91 / row.r))
    assert row.of_ideal == pytest.approx(row.speedup / row.ideal)
    assert row.f_cap == pytest.approx(1 - 0.09 / 1.0)  # uncapped compute: 0.10 - 0.01 s
    assert row.val_gap_pct == pytest.approx(0.1)
    inp = rep.model_inputs["bf16"]
    assert inp.compute_s == pytest.approx(0.09) and len(inp.messages) == 2
    # uncapped: 5 ms per all-reduce, of which both ranks' 2 x NUMEL bytes at 1 GB/s explain 4 us:
    # the rest is latency and the ranks waiting for each other
    wait = 0.005 - 2 * 2 * NUMEL / 1e9
    assert inp.wait_s["none"] == pytest.approx(wait)
    assert inp.wait_s["taco"] == pytest.approx(0.005 - 2 * 2 * NUMEL * 1.0625 / 2 / 1e9)
    base = next(r for r in rep.rows if r.rate_mbit == 50.0 and r.codec == "none")
    # at 50 Mbit/s: compute + 2 all-reduces of (both ranks' bytes over 6 MB/s + the wait, less
    # what the first rank's first ring chunk, NUMEL bytes, hides)
    pred = 0.09 + 2 * (2 * 2 * NUMEL / 6e6 + wait - NUMEL / 6e6)
    assert base.model_step_s == pytest.approx(pred)
    assert rep.links[50.0]["alpha_s"] == 1e-3
    text = format_report(rep)
    assert "| bf16 | 50 | 1000 | 0.91 | 550 | 1.88 | **1.82x** |" in format_markdown(rep)
    assert "comm bf16" in text and "fwd 2.00, bwd 2.00" in text
    assert row.curve_gap_pct == pytest.approx(
        statistics.fmean(100 * 0.001 / (5.0 - 0.1 * i) for i in range(4))
    )


def test_records_convert_from_and_to_the_json_the_worker_writes():
    run = dict(rec("bf16", "taco", 50.0, 0.55, 0.46, 2, 2), loadavg=[1.0, 1.5])
    assert RunRecord.from_json(run).to_json() == run
    probe = dict(bytes_per_s=6e6, rtt_s=1e-3)
    res = dict(rate_mbit=50.0, probe=probe, calib=CALIB_50, runs=[run], qdisc="tbf")
    assert LinkResult.from_json(res).to_json() == res
    uncapped = dict(res, rate_mbit=None, runs=[])
    del uncapped["qdisc"]
    assert LinkResult.from_json(uncapped).to_json() == uncapped


SAVED = Path(__file__).resolve().parents[2] / "docs" / "cluster_sweep.json"


def test_saved_sweep_reanalyses_to_the_documented_table(tmp_path, capsys):
    out = tmp_path / "sweep.md"
    assert run_bench("cluster", ["--from-json", str(SAVED), "--markdown", str(out)]) == 0
    documented = [line for line in SAVED.with_suffix(".md").read_text().splitlines() if line.startswith("|")]
    assert out.read_text().splitlines() == documented
    assert "comm bf16" in capsys.readouterr().out


# Issue #7's acceptance criteria. They are one issue's, so they live here and in docs/cluster.md
# ("How the sweep fares against issue #7"), not in the library; the saved sweep is judged as
# measured, never adjusted: a new sweep updates the expected verdicts here and the prose there.
COMM_BOUND_F, MIN_SPEEDUP, MIN_OF_IDEAL, MAX_MODEL_ERR_PCT, MAX_VAL_GAP_PCT = 0.85, 1.6, 0.85, 15.0, 0.25


def test_saved_sweep_against_the_issue_7_criteria():
    from taco.bench.cluster_report import load_sweep
    from taco.train.config import Config

    meta, results, rates = load_sweep(SAVED)
    sweep = Sweep.of(Config.from_dict(meta["config"]), modes=list(meta["modes"]), codecs=["taco"],
                     warmup=meta["warmup"], burst=meta["burst"])  # fmt: skip
    rows = analyse(results, sweep, rates).rows
    verdicts, figures = {}, {}
    for mode in sweep.modes:
        capped = [r for r in rows if r.mode == mode and r.codec == "taco" and r.rate_mbit]
        comm_bound = [r for r in capped if r.f >= COMM_BOUND_F]
        err = max(abs(r.model_err_pct) for r in rows if r.mode == mode)
        worst = min(capped, key=lambda r: r.of_ideal)
        gap = capped[0].val_gap_pct  # the same at every rate: the runs do not depend on the link
        speedups = [(r.rate_mbit, round(r.speedup, 2)) for r in comm_bound]
        of_ideal = (worst.rate_mbit, round(100 * worst.of_ideal, 1))
        figures[mode] = (speedups, of_ideal, round(err, 1), round(gap, 3))
        verdicts[mode] = dict(speedup=all(r.speedup >= MIN_SPEEDUP for r in comm_bound) and bool(comm_bound),
                              of_ideal=worst.of_ideal >= MIN_OF_IDEAL, model=err <= MAX_MODEL_ERR_PCT,
                              val_gap=abs(gap) <= MAX_VAL_GAP_PCT)  # fmt: skip
    assert figures == {
        "bf16": ([(50.0, 1.75)], (400.0, 88.5), 7.6, 0.302),
        "fp32": ([(50.0, 3.4), (100.0, 3.19)], (2000.0, 81.8), 11.2, -0.121),
    }
    assert verdicts == {
        "bf16": dict(speedup=True, of_ideal=True, model=True, val_gap=False),
        "fp32": dict(speedup=True, of_ideal=False, model=True, val_gap=True),
    }


def test_options_the_emulation_does_not_take_are_one_line_and_status_2(tmp_path, capsys):
    assert run_bench("cluster", ["--rates", "", "--uncapped", "none", "--set", "parallel.dp=2"]) == 2
    err = capsys.readouterr().err
    assert err == "taco bench cluster: the emulation runs TP only (sp=false, pp=dp=1)\n"
    cfg = load_config(None, ["--train.batch_size=2"])
    args = argparse.Namespace(comm=["bf16", "int4"], codecs=["taco"], threads=1, backend="auto", warmup=1,
                              timeout=60)  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown --comm modes \['int4'\]"):
        cluster.plan_runs(cfg, args, tmp_path)


def test_tc_sizes():
    from taco.bench.cluster_analysis import tc_bytes

    assert tc_bytes("32kb") == 32768 and tc_bytes("1mb") == 1 << 20
    assert tc_bytes("256kbit") == 32768 and tc_bytes("1500") == 1500


def test_repeated_uncapped_sets_are_pooled():
    a = dict(
        rate_mbit=None,
        probe=dict(bytes_per_s=1e9),
        calib=dict(alpha_s=1e-4, beta_bytes_per_s=1e9),
        runs=[rec("bf16", "none", None, 0.10, 0.01, 2, 2)],
    )
    b = dict(rate_mbit=None, probe=dict(bytes_per_s=3e9), calib=dict(alpha_s=3e-4, beta_bytes_per_s=3e9),
             runs=[rec("bf16", "none", None, 0.20, 0.03, 2, 2)])  # fmt: skip
    capped = dict(rate_mbit=50.0, probe={}, calib=CALIB_50, runs=[])
    merged = pool_runs([LinkResult.from_json(x) for x in (a, capped, b)], warmup=1)
    assert [m.rate_mbit for m in merged] == [None, 50.0]
    run = merged[0].runs[0]
    assert len(run.steps) == 4 + 3 and run.repeats == 2  # b's warmup step dropped
    assert run.summarize(1, 1).step_s == pytest.approx((3 * 0.1 + 3 * 0.2) / 6)
    assert run.sites["layers.0.attn.out.fwd"].calls == 8
    assert merged[0].calib["alpha_s"] == pytest.approx(2e-4)


def test_repeats_interleave_and_pool_per_link():
    from taco.bench.cluster import interleave

    a, b = dict(codec="none"), dict(codec="taco")
    assert [s["codec"] for s in interleave([a, b], 3)] == ["none", "taco", "taco", "none", "none", "taco"]
    with pytest.raises(ValueError, match="--repeats"):
        interleave([a, b], 0)
    times = [("none", 1.0), ("taco", 0.5), ("taco", 0.7), ("none", 1.2)]
    runs = [rec("bf16", codec, 50.0, t, t - 0.1, 2, 2) for codec, t in times]
    link = LinkResult.from_json(dict(rate_mbit=50.0, probe={}, calib=CALIB_50, runs=runs))
    (pooled,) = pool_runs([link], warmup=1)
    assert [(r.codec, r.repeats, len(r.steps)) for r in pooled.runs] == [("none", 2, 7), ("taco", 2, 7)]
    none, taco = (r.summarize(1, 1) for r in pooled.runs)
    assert none.step_s == pytest.approx(1.1) and taco.step_s == pytest.approx(0.6)
    assert pooled.runs[1].sites["layers.0.attn.out.fwd"].calls == 8
    assert pooled.calib == CALIB_50  # one capped set: its own probe and calibration


def test_wire_dtype_check_flags_fp32_backward():
    assert _report(bwd=4).wire_dtype["bf16"] == {"fwd": 2.0, "bwd": 4.0}


def test_modes_set_the_training_and_communication_dtypes(tmp_path):
    cfg = load_config(None, ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"])
    args = argparse.Namespace(comm=["bf16", "autocast", "fp32"], codecs=["taco"], threads=1, backend="auto",
                              warmup=1, timeout=60)  # fmt: skip
    specs = {(s["mode"], s["codec"]): s["config"] for s in cluster.plan_runs(cfg, args, tmp_path)}
    assert len(specs) == 6
    got = {m: (c["train"]["dtype"], c["parallel"]["tp_comm_dtype"]) for (m, _), c in specs.items()}
    assert got == {"bf16": ("bf16", "bf16"), "autocast": ("bf16", "input"), "fp32": ("fp32", "fp32")}
    assert specs[("fp32", "none")]["compression"]["tp_codec"] == "none"


def test_plot_speedup_writes_png(tmp_path):
    from taco.bench.gpu_projection import projection
    from taco.bench.plots import plot_projection, plot_speedup, plot_validation

    rep = _report()
    path = tmp_path / "s.png"
    plot_speedup(rep.rows, {"bf16/taco": [(50.0, 1.8), (100.0, 1.5)]}, str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"
    plot_validation(rep.rows, str(tmp_path / "v.png"))
    assert (tmp_path / "v.png").stat().st_size > 1000
    proj = tmp_path / "p.png"
    plot_projection(projection(tps=(2,)), str(proj))
    assert proj.stat().st_size > 1000


def _can_netns() -> bool:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_netns(), reason="needs root, ip and tc")
def test_tiny_real_run_in_a_capped_namespace(tmp_path):
    out = tmp_path / "c.json"
    argv = ["--rates", "400", "--comm", "bf16", "--warmup", "1", "--json", str(out), "--uncapped-steps", "0",
            "--set", "train.steps=3", "--set", "model.n_layer=1", "--set", "model.hidden=64",
            "--set", "train.batch_size=2", "--set", "train.eval_steps=1"]  # fmt: skip
    assert run_bench("cluster", argv) == 0
    res = json.loads(out.read_text())
    rows = {(r["rate_mbit"], r["codec"]): r for r in res["rows"]}
    assert set(rows) == {(None, "none"), (None, "taco"), (400.0, "none"), (400.0, "taco")}
    assert rows[(400.0, "taco")]["r"] == pytest.approx(2 / 1.0625, rel=0.02)
    assert res["wire_dtype"]["bf16"] == {"fwd": 2.0, "bwd": 2.0}
    assert "tbf" in res["results"][1]["qdisc"]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"taco-{os.getpid()}-" not in names  # the namespace is gone


def test_ratio_interval_is_the_t_interval_of_the_log_ratios():
    from taco.bench.cluster_noise import half_width, no_effect, ratio_interval, t95

    assert ratio_interval([1.0, 1.0], [0.5, 0.5]) == pytest.approx((2.0, 2.0))
    assert ratio_interval([1.0], [0.5]) is None  # one round: no interval
    base, run = [1.0, 1.1, 0.9], [0.5, 0.5, 0.5]
    logs = [math.log(b / r) for b, r in zip(base, run)]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)
    lo, hi = ratio_interval(base, run)
    mean = statistics.fmean(logs)
    assert (lo, hi) == pytest.approx((math.exp(mean - half), math.exp(mean + half)))
    assert half_width((0.97, 1.01)) == pytest.approx(0.02)
    assert no_effect((0.97, 1.01)) and not no_effect((1.01, 1.05)) and not no_effect(None)
    assert t95(1) == pytest.approx(12.706) and t95(100) == 1.96
    with pytest.raises(ValueError, match="2 samples"):
        t95(0)


def _rounds_link(rate: float | None, rounds: list[dict[str, float]]) -> LinkResult:
    """One link's runs of `rounds` (per round: codec -> step seconds), in the alternating order of
    `--repeats` (every other round reversed)."""
    runs = []
    for i, times in enumerate(rounds):
        order = list(times.items()) if i % 2 == 0 else list(times.items())[::-1]
        runs += [rec("bf16", codec, rate, t, 0.8 * t if codec == "none" else 0.4 * t, 2, 2)
                 for codec, t in order]  # fmt: skip
    return LinkResult.from_json(dict(rate_mbit=rate, probe=dict(bytes_per_s=6e6, rtt_s=1e-3), calib=CALIB_50,
                                     runs=runs))  # fmt: skip


def test_a_a_control_gives_the_noise_floor_and_every_row_an_interval(tmp_path):
    from taco.bench.cluster_noise import CONTROL
    from taco.bench.cluster_report import write_json

    cfg = load_config(None, ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"])
    sweep = Sweep.of(cfg, modes=["bf16"], codecs=["taco", "auto"], warmup=1, burst="0b")
    rounds = [  # taco: a clear 2x; auto (which kept the plain collectives): the baseline's time, +-1%
        {"none": 1.00, CONTROL: 1.01, "taco": 0.50, "auto": 0.99},
        {"none": 1.02, CONTROL: 1.00, "taco": 0.52, "auto": 1.02},
        {"none": 0.99, CONTROL: 0.99, "taco": 0.49, "auto": 1.00},
    ]
    rep = analyse([_rounds_link(50.0, rounds)], sweep, {})
    rows = {r.codec: r for r in rep.rows}
    assert list(rows) == ["none", CONTROL, "taco", "auto"]
    aa = [math.log(r["none"] / r[CONTROL]) for r in rounds]
    floor = 4.303 * statistics.stdev(aa) / math.sqrt(3)  # log half-width ~ the ratio's half-width
    assert rep.noise_floor == pytest.approx(floor, rel=0.01) and rows["taco"].noise_floor == rep.noise_floor
    assert rows[CONTROL].no_effect and rows["auto"].no_effect  # intervals around 1.0
    lo, hi = rows["taco"].speedup_ci95
    assert 1.9 < lo < 2.0 < hi < 2.1 and not rows["taco"].no_effect
    assert rows["none"].speedup_ci95 is None
    text = format_report(rep)
    assert text.count("no effect measured") == 2 and "noise floor (the A/A control's 95% half-width)" in text
    md = format_markdown(rep)
    assert "95% CI" in md and "no effect measured (" in md and f"{lo:.3f}-{hi:.3f}" in md
    out = tmp_path / "s.json"
    write_json(str(out), {}, [], {}, rep)
    doc = json.loads(out.read_text())
    assert doc["noise_floor"] == pytest.approx(rep.noise_floor)
    got = {r["codec"]: r for r in doc["rows"]}
    assert got["taco"]["speedup_ci95"] == pytest.approx([lo, hi]) and got["auto"]["no_effect"]


def test_repeats_add_the_a_a_control_with_the_baseline_config(tmp_path):
    from taco.bench.cluster_noise import CONTROL

    cfg = load_config(None, ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"])
    args = argparse.Namespace(comm=["bf16"], codecs=["taco"], threads=1, backend="auto", warmup=1, timeout=60,
                              repeats=1)  # fmt: skip
    assert [s["codec"] for s in cluster.plan_runs(cfg, args, tmp_path)] == ["none", "taco"]
    args.repeats = 3
    specs = cluster.plan_runs(cfg, args, tmp_path)
    assert [s["codec"] for s in specs] == ["none", CONTROL, "taco"]
    assert specs[0]["config"] == specs[1]["config"]  # the control is the baseline job itself


def test_a_ladder_codec_runs_with_its_telemetry_and_the_others_without(tmp_path):
    cfg = load_config(None, ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"])
    ladder = "ladder(int4-hadamard,int5-hadamard,int6-hadamard,taco,none)"
    args = argparse.Namespace(comm=["bf16"], codecs=split_specs(f"int6-hadamard,{ladder}"), threads=1,
                              backend="auto", warmup=1, timeout=60)  # fmt: skip
    specs = {s["codec"]: s["config"]["compression"] for s in cluster.plan_runs(cfg, args, tmp_path)}
    assert list(specs) == ["none", "int6-hadamard", ladder]
    assert specs[ladder]["tp_codec"] == ladder and specs[ladder]["telemetry_every"] == 10
    assert specs["int6-hadamard"]["telemetry_every"] == 0 and specs["none"]["telemetry_every"] == 0
