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
