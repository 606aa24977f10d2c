"""The "+overlap" rows of `taco bench cluster` and the cost model of a batch-split step."""

from __future__ import annotations

import argparse

import pytest

from taco.bench import cluster
from taco.bench import cluster_overlap as overlap
from taco.bench import cost_model as cm
from taco.train.config import load_config


def test_overlap_ideal_is_the_max_bound_and_beats_the_codec_bound():
    f, r = 0.72, 2.56
    assert cm.ideal_overlap_speedup(f, r) == pytest.approx(2.56 / 0.72)  # the wire-bound side: 3.56x
    assert cm.ideal_speedup(f, r) == pytest.approx(1 / (0.28 + 0.72 / 2.56))  # 1.78x
    assert cm.ideal_overlap_speedup(0.9, 1.0) == pytest.approx(1 / 0.9)  # uncompressed: comm-bound
    assert overlap.ideal("int6-hadamard+overlap", f, r) == cm.ideal_overlap_speedup(f, r)
    assert overlap.ideal("int6-hadamard", f, r) == cm.ideal_speedup(f, r)
    with pytest.raises(ValueError):
        cm.ideal_overlap_speedup(1.2, 2.0)


def test_overlapped_step_is_a_two_stage_pipeline_of_the_pieces():
    assert cm.overlapped_step(1.0, 0.5, 1) == 1.5  # no pieces: they add
    assert cm.overlapped_step(1.0, 0.5, 2) == 1.25  # max + min / k
    assert cm.overlapped_step(0.4, 1.0, 4) == pytest.approx(1.1)
    link = cm.Link("test", bandwidth=1e6)
    msgs = [cm.Message("all_reduce", 250_000, 2.0)] * 4  # 4 x 500 kB plain: 2 s of wire on 2 ranks
    plain, comm = cm.step_time_measured_compute(1.0, msgs, 2, link)
    split, comm2 = cm.step_time_measured_compute(1.0, msgs, 2, link, pieces=2)
    assert comm == comm2 == pytest.approx(2.0) and plain == pytest.approx(3.0)
    assert split == pytest.approx(2.0 + 1.0 / 2)


def test_overlap_labels_plan_batch_split_runs_of_their_codec(tmp_path):
    cfg = load_config(None, ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"])
    codecs = ["int6-hadamard", "int6-hadamard+overlap", "none+overlap"]
    args = argparse.Namespace(comm=["bf16"], codecs=codecs, threads=1, backend="auto", warmup=1, timeout=60)
    specs = {s["codec"]: s["config"] for s in cluster.plan_runs(cfg, args, tmp_path)}
    assert list(specs) == ["none", "int6-hadamard", "int6-hadamard+overlap", "none+overlap"]
    got = {k: (c["compression"]["tp_codec"], c["parallel"]["tp_overlap"]) for k, c in specs.items()}
    assert got == {
        "none": ("none", "none"),
        "int6-hadamard": ("int6-hadamard", "none"),
        "int6-hadamard+overlap": ("int6-hadamard", "batch-split"),
        "none+overlap": ("none", "batch-split"),
    }
    assert overlap.split_label("+overlap") == ("none", True)
    everywhere = load_config(None, ["--train.batch_size=2", "--parallel.tp_overlap=batch-split"])
    specs = cluster.plan_runs(everywhere, args, tmp_path)
    assert {s["config"]["parallel"]["tp_overlap"] for s in specs} == {"batch-split"}
    rates = cluster.codec_rates(["int6-hadamard+overlap", "int6-hadamard"], 4096, 1, "auto")
    assert set(rates) == {"int6-hadamard/bf16", "int6-hadamard/fp32"}


def test_chunked_labels_plan_chunked_runs_and_need_sp(tmp_path):
    args = argparse.Namespace(
        comm=["bf16"], codecs=["int6-hadamard", "int6-hadamard+chunked"], threads=1, backend="auto",
        warmup=1, timeout=60,
    )  # fmt: skip
    small = ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"]
    sp = load_config(None, [*small, "--parallel.sp=true"])
    specs = {s["codec"]: s["config"] for s in cluster.plan_runs(sp, args, tmp_path)}
    got = {k: (c["compression"]["tp_codec"], c["parallel"]["tp_overlap"]) for k, c in specs.items()}
    assert got["int6-hadamard+chunked"] == ("int6-hadamard", "chunked")
    assert got["int6-hadamard"] == ("int6-hadamard", "none")
    assert overlap.split_label("int6-hadamard+chunked") == ("int6-hadamard", True)
    assert overlap.ideal("int6-hadamard+chunked", 0.72, 2.56) == cm.ideal_overlap_speedup(0.72, 2.56)
    assert overlap.pieces("int6-hadamard+chunked", 2, 4) == 4  # a ring of tp steps
    assert overlap.pieces("int6-hadamard+overlap", 2, 4) == 2 and overlap.pieces("none", 2, 4) == 1
    plain = load_config(None, small)
    with pytest.raises(ValueError, match="parallel.sp=true"):
        cluster.plan_runs(plain, args, tmp_path)


def test_overlap_auto_labels_plan_auto_runs(tmp_path):
    args = argparse.Namespace(
        comm=["bf16"], codecs=["int6-hadamard+overlap-auto", "int6-hadamard+overlap"], threads=1,
        backend="auto", warmup=1, timeout=60,
    )  # fmt: skip
    cfg = load_config(None, ["--train.batch_size=4"])
    specs = {s["codec"]: s["config"] for s in cluster.plan_runs(cfg, args, tmp_path)}
    got = {k: (c["compression"]["tp_codec"], c["parallel"]["tp_overlap"]) for k, c in specs.items()}
    assert got["int6-hadamard+overlap-auto"] == ("int6-hadamard", "auto")
    assert got["int6-hadamard+overlap"] == ("int6-hadamard", "batch-split")
    assert overlap.split_label("int6-hadamard+overlap-auto") == ("int6-hadamard", True)
    assert overlap.pieces("int6-hadamard+overlap-auto", 4, 2) == 4
    assert overlap.ideal("int6-hadamard+overlap-auto", 0.72, 2.56) == cm.ideal_overlap_speedup(0.72, 2.56)


def test_every_overlap_row_reports_what_the_overlap_adds_over_its_codec_alone():
    from taco.bench.cluster_analysis import Sweep, analyse
    from taco.bench.cluster_noise import ratio_interval
    from taco.bench.cluster_records import LinkResult
    from taco.bench.cluster_report import format_report

    rounds = [  # per round: run -> mean step seconds
        {"none": 1.00, "taco": 0.60, "taco+overlap": 0.48, "taco+overlap-auto": 0.61},
        {"none": 1.01, "taco": 0.61, "taco+overlap": 0.49, "taco+overlap-auto": 0.60},
        {"none": 0.99, "taco": 0.59, "taco+overlap": 0.47, "taco+overlap-auto": 0.60},
    ]

    def run(codec: str, step_s: float) -> dict:
        steps = [dict(step_s=step_s, loss=5.0, raw_bytes=100.0, wire_bytes=100.0 if codec == "none" else 40.0,
                      comm_s=0.5 * step_s, encode_s=0.0, decode_s=0.0) for _ in range(3)]  # fmt: skip
        return dict(mode="bf16", codec=codec, rate_mbit=200.0, world=2, steps=steps, sites={}, val_loss=4.0)

    runs = [run(c, t) for times in rounds for c, t in times.items()]
    link = LinkResult.from_json(dict(rate_mbit=200.0, probe=dict(bytes_per_s=2.4e7, rtt_s=1e-3), calib={},
                                     runs=runs))  # fmt: skip
    cfg = load_config(None, ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"])
    codecs = ["taco", "taco+overlap", "taco+overlap-auto"]
    rep = analyse([link], Sweep.of(cfg, modes=["bf16"], codecs=codecs, warmup=1, burst="0b"), {})
    rows = {r.codec: r for r in rep.rows}
    times = {c: [r[c] for r in rounds] for c in rounds[0]}
    assert rows["taco"].over_codec is None and rows["none"].over_codec is None
    assert rows["taco+overlap"].over_codec == pytest.approx(sum(times["taco"]) / sum(times["taco+overlap"]))
    assert rows["taco+overlap"].over_codec_ci95 == pytest.approx(
        ratio_interval(times["taco"], times["taco+overlap"])
    )
    text = format_report(rep)
    assert "taco+overlap (bf16, 200 Mbit/s): 1.25x over taco alone (95% CI" in text
    auto = next(line for line in text.splitlines() if line.startswith("taco+overlap-auto (bf16, 200"))
    assert "over taco alone" in auto and auto.endswith("no effect measured")  # 0.60 vs 0.60: no gain
    assert rep.to_json()["rows"][2]["over_codec"] == pytest.approx(rows["taco+overlap"].over_codec)
