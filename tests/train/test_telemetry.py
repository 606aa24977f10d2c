"""Fidelity telemetry and the guard: the measurement against a direct computation, a 2-rank run's
metrics.jsonl / TensorBoard / comm_stats.txt, and a corrupting codec at one site switched by the guard."""

import json
import logging
import math

import pytest
import torch

from taco.codec import Codec, build_codec, get_codec, sqnr_db
from taco.comm import CommPolicy
from taco.comm.telemetry import (
    SQNR_CAP_DB,
    FidelityGuard,
    FidelityHistory,
    FidelityProbe,
    merge_sites,
    roundtrip_fidelity,
)
from taco.train.launch import launch
from tests.helpers.dist import run_distributed
from tests.helpers.runs import tiny

BAD_SITE = "layers.0.mlp.down.fwd"


class NoisyCodec(Codec):
    """fp32 on the wire; decode adds a deterministic ripple of 0.3 x mean |v| (SQNR ~ 13 dB), or
    writes NaN into every 7th element with `nan=True`."""

    name = "noisy-test"

    def __init__(self, nan: bool = False) -> None:
        super().__init__()
        self.nan = nan

    def nbytes(self, numel: int, dtype: torch.dtype = torch.bfloat16) -> int:
        return 4 * numel

    def _encode_flat(self, x: torch.Tensor, out: torch.Tensor) -> None:
        out.view(torch.float32).copy_(x)

    def _decode_flat(self, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        v = buf.view(torch.float32)[:numel]
        ripple = torch.cos(torch.arange(numel, device=v.device, dtype=torch.float32))
        y = v + 0.3 * v.abs().mean() * ripple
        if self.nan:
            y[::7] = float("nan")
        return y.to(dtype)


def _direct(x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
    fx, fy = torch.isfinite(x.float()), torch.isfinite(y.float())
    both = fx & fy
    return sqnr_db(x.float()[both], y.float()[both]), int((~fx).sum()), int((fx & ~fy).sum())


def test_roundtrip_fidelity_matches_a_direct_computation():
    x = torch.randn(8, 256, dtype=torch.bfloat16) * 3
    for codec in (get_codec("taco"), get_codec("int8-hadamard"), NoisyCodec()):
        got = roundtrip_fidelity(x, codec)
        assert got.dtype == torch.float64 and got.shape == (3,)
        want = _direct(x, codec.roundtrip(x))
        assert abs(got[0].item() - want[0]) < 0.01, (codec.spec, got, want)
        assert got[1:].tolist() == [0, 0]
    assert 30 < roundtrip_fidelity(x, get_codec("taco"))[0].item() < 34
    # non-finite input is counted and left out of the SQNR; a codec making NaN is counted apart
    x[0, :5] = float("nan")
    x[3, 7] = float("inf")
    got = roundtrip_fidelity(x, get_codec("int8-hadamard")).tolist()
    y = get_codec("int8-hadamard").roundtrip(x)
    want = _direct(x, y)
    assert got[1] == 6 and got[1:] == [want[1], want[2]], (got, want)
    x = torch.randn(4, 70)
    nan = NoisyCodec(nan=True)
    got = roundtrip_fidelity(x, nan).tolist()
    want = _direct(x, nan.roundtrip(x))
    assert got[1:] == [0, 40] and abs(got[0] - want[0]) < 0.01, (got, want)
    # exact round trip: the cap, not inf
    assert roundtrip_fidelity(torch.zeros(64), get_codec("taco"))[0].item() == SQNR_CAP_DB


def test_probe_measures_first_call_per_site_only_while_armed_and_chains():
    policy = CommPolicy(codec="taco")
    seen = []
    policy.observer = lambda *a: seen.append(a[0])
    probe = FidelityProbe()
    prev = policy.observer
    policy.observer = lambda *a: (prev and prev(*a), probe(*a))
    taco, x1, x2 = get_codec("taco"), torch.randn(4, 64), torch.randn(4, 64) * 100
    policy.observer("a", "all_reduce", x1, taco)
    assert probe.collect() == {} and seen == ["a"]  # not armed
    probe.armed = True
    policy.observer("a", "all_reduce", x1, taco)
    policy.observer("a", "all_reduce", x2, taco)  # second call of the step: not measured
    policy.observer("b", "all_reduce", x2, None)  # plain: nothing to measure
    policy.observer("c", "all_gather", torch.zeros(0), taco)
    got = probe.collect()
    assert list(got) == ["a"] and seen == ["a", "a", "a", "b", "c"]  # the previous observer saw all
    assert abs(got["a"][0] - sqnr_db(x1, taco.roundtrip(x1))) < 0.01
    assert probe.specs == {"a": taco.spec} and probe.collect() == {}


def test_merge_history_and_guard_decisions():
    merged = merge_sites([{"b": (30.0, 0, 0), "a": (31.0, 1, 0)}, {"a": (25.0, 2, 0), "c": (40.0, 0, 3)}])
    assert merged == {"a": (25.0, 3, 0), "b": (30.0, 0, 0), "c": (40.0, 0, 3)}
    assert list(merged) == ["a", "b", "c"]
    guard = FidelityGuard(28.0, patience=2, fallback="int8-hadamard")
    specs = {"a": "taco", "b": "taco", "c": "taco"}
    i8 = build_codec("int8-hadamard").spec
    first = guard.decide(merged, specs)  # c made NaN from finite input: at once; a: 1 strike
    assert [(s, n) for s, n, _ in first] == [("c", i8)]
    assert "3 non-finite" in first[0][2]
    assert guard.decide({"a": (29.0, 0, 0)}, specs) == []  # recovered: strikes reset
    assert guard.decide({"a": (27.0, 0, 0)}, specs) == []
    second = guard.decide({"a": (27.5, 0, 0)}, specs)
    assert [(s, n) for s, n, _ in second] == [("a", i8)]
    assert "27.5 dB < floor 28.0 dB at 2 checks" in second[0][2]
    # a site already on the fallback goes to none; a "none" fallback goes straight there
    assert guard.decide({"c": (10.0, 0, 1)}, {"c": i8})[0][1] == "none"
    assert FidelityGuard(28.0, 1, "none").decide({"a": (1.0, 0, 0)}, specs)[0][1] == "none"
    h = FidelityHistory()
    h.add({"a": (30.0, 0, 0)})
    h.add({"a": (20.0, 2, 1)})
    row = next(line for line in h.summary().splitlines() if line.startswith("a "))
    assert row.split() == ["a", "2", "20.00", "25.00", "20.00", "2", "1"]
    assert h.summary().endswith("guard: no site switched")


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_run_logs_per_site_sqnr_to_metrics_tensorboard_and_comm_stats(corpus, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "t"
    launch(tiny(corpus, out, "--train.steps=3", "--compression.telemetry_every=1"))
    recs = _records(out)
    assert len(recs) == 3
    for r in recs:
        sq = {k[len("sqnr_db/"):]: v for k, v in r.items() if k.startswith("sqnr_db/")}
        assert {"layers.0.attn.qkv.bwd", "layers.0.attn.out.fwd", "layers.1.mlp.down.fwd"} <= set(sq), r
        assert all(25 < v < 40 for v in sq.values()), sq
        assert all(r[f"nonfinite/{s}"] == 0 and r[f"nonfinite_in/{s}"] == 0 for s in sq)
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "sqnr_db/layers.0.attn.out.fwd" in tags and "nonfinite/layers.1.mlp.down.fwd" in tags
    assert len(acc.Scalars("sqnr_db/layers.0.attn.out.fwd")) == 3
    stats = (out / "comm_stats.txt").read_text()
    section = stats.split("[tp fidelity]\n")[1].splitlines()
    row = next(line for line in section if line.startswith("layers.0.attn.out.fwd "))
    assert row.split()[1] == "3"  # three checks
    assert "guard: no site switched" in section


def _guarded_rank(rank, world, cfg, data_dir):
    from taco.train.trainer import Trainer

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    logging.getLogger("taco.comm").addHandler(handler)
    dims = cfg.parallel.dims().build()
    trainer = Trainer(cfg, dims, data_dir, log=rank == 0, device=torch.device("cpu"))
    trainer.run.policy.set_site_codec(BAD_SITE, NoisyCodec())
    try:
        trainer.fit()
    finally:
        trainer.close()
    return trainer.run.policy.site_codecs(), [x for x in lines if "fidelity guard" in x]


def test_guard_switches_exactly_the_failing_site_after_patience(corpus, tmp_path):
    from taco.train.data import resolve_data_dir

    out = tmp_path / "g"
    cfg = tiny(corpus, out, "--train.steps=4", "--compression.telemetry_every=1",
               "--compression.guard_patience=2")
    results = run_distributed(_guarded_rank, 2, cfg, resolve_data_dir(cfg.data, prepare=True), timeout=300)
    want = {BAD_SITE: build_codec("int8-hadamard").spec}
    assert [r[0] for r in results] == [want, want]  # every rank switched exactly that site
    assert results[1][1] == [] and len(results[0][1]) == 1  # one log line, from rank 0
    line = results[0][1][0]
    assert f"step 2 site {BAD_SITE!r}" in line and "floor 28.0 dB at 2 checks" in line
    assert f"noisy-test -> {want[BAD_SITE]}" in line
    recs = _records(out)
    sq = [r[f"sqnr_db/{BAD_SITE}"] for r in recs]
    assert sq[0] < 20 and sq[1] < 20 and sq[2] > 38 and sq[3] > 38, sq  # noisy twice, then int8
    assert all(math.isfinite(r["loss"]) for r in recs)
    assert "guard: step 2 site 'layers.0.mlp.down.fwd'" in (out / "comm_stats.txt").read_text()


@pytest.mark.slow
def test_resume_keeps_the_guards_switches_and_reproduces_the_run(corpus, tmp_path):
    # a 40 dB floor fails taco (~32 dB) at every site: the guard moves all of them at step 2
    guarded = ("--compression.telemetry_every=1", "--compression.min_sqnr_db=40")
    launch(tiny(corpus, tmp_path / "full", "--train.steps=4", *guarded))
    launch(tiny(corpus, tmp_path / "part", "--train.steps=2", "--train.checkpoint_interval=2", *guarded))
    launch(tiny(corpus, tmp_path / "part", "--train.steps=4", "--train.resume=true", *guarded))
    full, part = _records(tmp_path / "full"), _records(tmp_path / "part")
    i8 = build_codec("int8-hadamard").spec
    assert all(36 < v < 200 for k, v in full[2].items() if k.startswith("sqnr_db/")), full[2]  # int8, step 3
    assert [r["loss"] for r in full[2:]] == [r["loss"] for r in part[2:]]  # bit-exact: the switches were kept

    def actions(run):
        text = (tmp_path / run / "comm_stats.txt").read_text()
        return [line for line in text.splitlines() if line.startswith("guard: step")]

    sites = [k for k in full[0] if k.startswith("sqnr_db/")]
    assert len([a for a in actions("full") if "step 2 " in a and a.endswith(f"-> {i8}")]) == len(sites) == 10
    assert not any("step 2 " in a for a in actions("part"))  # the resumed run did not switch them again
    assert [a for a in actions("full") if "step 2 " not in a] == actions("part")  # later switches alike


@pytest.mark.slow
def test_pipeline_stages_report_their_sites_through_rank_0(corpus, tmp_path):
    out = tmp_path / "pp"
    launch(tiny(corpus, out, "--train.steps=2", "--parallel.pp=2", "--parallel.microbatches=2",
                "--compression.telemetry_every=1"))
    for r in _records(out):  # stage 0 holds layer 0 and the embedding, stage 1 layer 1 and the head
        sq = {k[len("sqnr_db/"):] for k in r if k.startswith("sqnr_db/")}
        assert {"tok_emb.fwd", "layers.0.mlp.down.fwd", "layers.1.attn.qkv.bwd", "lm_head.bwd"} <= sq, r
        assert all(25 < r[f"sqnr_db/{s}"] < 40 for s in sq)
