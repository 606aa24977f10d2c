"""`taco bench cluster --peers`: Megatron-Core's and DTensor's TP trained beside the project's runs.

The peers (2 gloo ranks, a small GPT) train the same batches from a loss near ln(vocab), close to
the project's baseline at step 1, with finite losses and the same TP bytes per step; the report
gives every row its speedup over the best peer with the paired rounds' 95% interval (table,
markdown, JSON, plot); a peer whose framework is missing is skipped with a one-line reason.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import pytest

from taco.bench import cluster, peers
from taco.bench.cluster_analysis import Sweep, analyse
from taco.bench.cluster_noise import CONTROL, ratio_interval
from taco.bench.cluster_records import LinkResult
from taco.bench.cluster_report import format_markdown, format_report, headline, write_json
from taco.train.config import load_config
from tests.helpers.bench import run_bench

TINY = ["--model.n_layer=2", "--model.hidden=64", "--model.n_head=4", "--model.seq_len=32",
        "--train.batch_size=2", "--train.steps=5", "--train.warmup_steps=2",
        "--train.eval_steps=1"]  # fmt: skip


def _rec(codec: str, step_s: float) -> dict:
    steps = [dict(step_s=step_s, loss=5.0, raw_bytes=100.0, wire_bytes=100.0 if codec != "taco" else 40.0,
                  comm_s=0.5 * step_s, encode_s=0.0, decode_s=0.0) for _ in range(3)]  # fmt: skip
    return dict(mode="bf16", codec=codec, rate_mbit=200.0, world=2, steps=steps, sites={}, val_loss=4.0)


ROUNDS = [  # per round: run -> mean step seconds; megatron the faster peer
    {"none": 1.00, CONTROL: 1.01, "taco": 0.50, "peer:megatron": 0.90, "peer:dtensor": 1.10},
    {"none": 1.02, CONTROL: 1.00, "taco": 0.52, "peer:megatron": 0.93, "peer:dtensor": 1.12},
    {"none": 0.99, CONTROL: 0.99, "taco": 0.49, "peer:megatron": 0.91, "peer:dtensor": 1.08},
]


def _report():
    runs = []
    for i, times in enumerate(ROUNDS):
        order = list(times.items()) if i % 2 == 0 else list(times.items())[::-1]
        runs += [_rec(codec, t) for codec, t in order]
    link = LinkResult.from_json(dict(rate_mbit=200.0, probe=dict(bytes_per_s=2.4e7, rtt_s=1e-3), calib={},
                                     runs=runs))  # fmt: skip
    cfg = load_config(None, ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"])
    sweep = Sweep.of(cfg, modes=["bf16"], codecs=["taco"], warmup=1, burst="0b",
                     peers=["peer:megatron", "peer:dtensor"])  # fmt: skip
    return analyse([link], sweep, {})


def _times(run: str) -> list[float]:
    return [r[run] for r in ROUNDS]


def test_every_row_has_its_speedup_over_the_best_peer_with_an_interval(tmp_path):
    rep = _report()
    rows = {r.codec: r for r in rep.rows}
    assert list(rows) == ["none", CONTROL, "taco", "peer:megatron", "peer:dtensor"]
    mega = sum(_times("peer:megatron")) / 3
    for codec, r in rows.items():
        assert r.best_peer == "peer:megatron"
        assert r.peer_speedup == pytest.approx(mega / (sum(_times(codec)) / 3))
    assert rows["peer:megatron"].peer_ci95 is None  # the best peer against itself: no interval
    assert rows["taco"].peer_ci95 == pytest.approx(ratio_interval(_times("peer:megatron"), _times("taco")))
    assert rows["none"].peer_ci95 == pytest.approx(ratio_interval(_times("peer:megatron"), _times("none")))
    lo, hi = rows["taco"].peer_ci95
    assert 1.7 < lo < 1.82 < hi < 1.95
    assert rows["peer:dtensor"].speedup < 1 < rows["peer:megatron"].speedup  # over the project's baseline
    assert rows["peer:megatron"].model_step_s is None  # the cost model models the project's runs only

    text = format_report(rep)
    assert "vs peer" in text and "MB/step" in text and f"{lo:.3f}-{hi:.3f}" in text
    md = format_markdown(rep)
    head = md.splitlines()[0]
    assert "speedup" in head and "over best peer" in head and "95% CI (peer)" in head and "MB/step" in head
    taco_line = next(line for line in md.splitlines() if "| taco |" in line)
    assert "peer:megatron" in taco_line and f"{rows['taco'].peer_speedup:.2f}x" in taco_line
    quotes = headline(rep)
    assert any(q.startswith("taco (bf16, 200 Mbit/s): ") and "over the uncompressed baseline" in q
               and "over the best peer, peer:megatron" in q for q in quotes)  # fmt: skip
    assert any(q.startswith("none (bf16, 200 Mbit/s): ") for q in quotes)

    out = tmp_path / "s.json"
    write_json(str(out), {}, [], {}, rep)
    doc = json.loads(out.read_text())
    got = {r["codec"]: r for r in doc["rows"]}
    assert got["taco"]["speedup_ci95"] and got["taco"]["peer_ci95"] == pytest.approx([lo, hi])
    assert got["taco"]["best_peer"] == "peer:megatron" and got["taco"]["peer_speedup"] > 1.7
    assert doc["headline"] == quotes

    from taco.bench.plots import plot_speedup

    png = tmp_path / "s.png"
    plot_speedup(rep.rows, {}, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_peer_jobs_run_the_baseline_job_in_the_same_rounds(tmp_path):
    cfg = load_config(None, ["--train.batch_size=2", "--model.seq_len=16", "--model.hidden=32"])
    args = argparse.Namespace(comm=["bf16", "fp32"], codecs=["taco"], threads=1, backend="auto", warmup=1,
                              timeout=60, repeats=2, peers=["megatron", "dtensor"])  # fmt: skip
    specs = cluster.plan_runs(cfg, args, tmp_path)
    assert [(s["mode"], s["codec"]) for s in specs] == [
        (m, c) for m in ("bf16", "fp32") for c in ("none", CONTROL, "taco", "peer:megatron", "peer:dtensor")
    ]
    for s in specs:
        if peers.is_peer(s["codec"]):
            base = next(b for b in specs if (b["mode"], b["codec"]) == (s["mode"], "none"))
            assert s["config"] == base["config"] and s["peer"] == peers.peer_name(s["codec"])
    order = [s["codec"] for s in cluster.interleave(specs[:5], 2)]
    assert order[:5] == order[5:][::-1]  # alternating rounds, as the project's runs


def test_a_missing_megatron_is_skipped_with_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "megatron", None)  # `import megatron` fails as when not installed
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    assert "megatron-core is not installed" in peers.unavailable("megatron")
    ok, skipped = peers.runnable_peers(["megatron", "dtensor"])
    assert ok == ["dtensor"] and skipped == [
        "peer megatron skipped: megatron-core is not installed (pip install 'taco-tp[megatron]')"
    ]
    assert "[cluster] peer megatron skipped: megatron-core is not installed" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown peer 'nccl'"):
        peers.unavailable("nccl")


def test_a_missing_peer_is_named_in_the_run_and_its_json(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    out = tmp_path / "c.json"
    argv = ["--rates", "", "--uncapped", "none", "--codecs", "none", "--peers", "megatron",
            "--json", str(out)]  # fmt: skip
    assert run_bench("cluster", argv) == 0
    assert "peer megatron skipped: megatron-core is not installed" in capsys.readouterr().out
    meta = json.loads(out.read_text())["meta"]
    assert meta["peers"] == [] and meta["peer_skips"][0].startswith("peer megatron skipped")


@pytest.mark.parametrize("mode", ["bf16", "fp32"])
@pytest.mark.parametrize("peer", ["megatron", "dtensor"])
def test_peers_train_the_same_model_as_the_project(tmp_path, peer, mode):
    if peer == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from taco.bench.cluster_rounds import rank_round
    from taco.bench.ranks import spawn_ranks
    from taco.train.data import resolve_data_dir

    cfg = load_config(str(cluster.ROOT / "configs" / "cluster.toml"), TINY)
    data_dir = resolve_data_dir(cfg.data, prepare=True)
    args = argparse.Namespace(comm=[mode], codecs=[], threads=1, backend="eager", warmup=1, timeout=300,
                              repeats=1, peers=[peer])  # fmt: skip
    base_spec, peer_spec = cluster.plan_runs(cfg, args, data_dir)
    base, got = spawn_ranks(rank_round, 2, dict(runs=[base_spec, peer_spec], block=2))  # side by side
    losses = [s["loss"] for s in got["steps"]]
    assert all(math.isfinite(v) for v in losses) and math.isfinite(got["val_loss"])
    vocab = cfg.model.vocab_size or 2048
    assert abs(losses[0] - math.log(vocab)) < 0.1, f"{peer}: first loss {losses[0]:.3f} vs ln V"
    assert abs(losses[0] - base["steps"][0]["loss"]) < 0.02 * base["steps"][0]["loss"]
    assert losses[-1] < losses[0]  # it learns
    assert abs(got["val_loss"] - base["val_loss"]) < 0.03 * base["val_loss"]
    # the same TP messages, in the mode's dtype: per step exactly the bytes the project's counters see
    assert got["steps"][1]["wire_bytes"] == base["steps"][1]["raw_bytes"] > 0
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[mode]
    tp = {k: v for k, v in got["sites"].items() if k == f"all_reduce.{dtype}.{2 * 32 * 64}"}
    assert sum(v["calls"] for v in tp.values()) == 5 * (4 * 2 + 2)  # 4 per block, embedding, head
