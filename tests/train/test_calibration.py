"""Calibration in training (issue 14, part 1): per-site codec choice, agreed by every rank, reused."""

import json
import math

import pytest
import torch

from taco.cli import main
from taco.codec import build_codec
from taco.train.adaptive.calibration import CALIBRATION_FILE, SiteSampler, decide
from taco.train.data import resolve_data_dir
from tests.helpers.dist import run_distributed
from tests.helpers.runs import tiny

CAL = ["--compression.calibrate=true", "--compression.calibrate_steps=2"]


def _fit(rank, world, cfg, data_dir):
    """One rank of a run built in-process: fit, then what its TP policy and calibration hold."""
    from taco.train.trainer import Trainer

    tr = Trainer(cfg, cfg.parallel.dims().build(), data_dir, log=rank == 0)
    try:
        tr.fit()
    finally:
        tr.close()
    policy = tr.run.policy
    sites = sorted(n for n in policy.stats.sites if n.endswith((".fwd", ".bwd")))
    return {
        "site_codecs": policy.site_codecs(),
        "sites": sites,
        "sampled": tr.run.wing.calibration.sampler is not None,
        "observer": tr.run.wing.calibration in tr.run.wing.on_message,  # sees the TP messages
    }


def _run(cfg):
    return run_distributed(_fit, cfg.parallel.world_size, cfg, resolve_data_dir(cfg.data, prepare=True))


@pytest.mark.slow  # three 2-rank runs, ~50 s on a loaded 2-core box
def test_calibrated_run_writes_every_site_every_rank_agrees_and_resume_reuses(corpus, tmp_path, capfd):
    out = tmp_path / "cal"
    a = _run(tiny(corpus, out, *CAL, "--train.steps=3"))
    doc = json.loads((out / CALIBRATION_FILE).read_text())
    sites = doc["sites"]
    assert a[0]["sites"] == a[1]["sites"] == sorted(sites)  # every TP site that ran, fwd and bwd
    assert {s.rsplit(".", 1)[1] for s in sites} == {"fwd", "bwd"} and len(sites) >= 8
    want = {s: build_codec(e["codec"]).spec for s, e in sites.items()}
    assert a[0]["site_codecs"] == a[1]["site_codecs"] == want  # both ranks installed the same
    assert a[0]["sampled"] and doc["steps"] == 2 and doc["step"] == 2
    assert a[0]["observer"] and not a[1]["observer"]  # only the decider (tp 0) keeps samples
    for e in sites.values():
        assert e["samples"] == 2 and e["sqnr_db"] >= doc["min_sqnr_db"]
        best = min(e["candidates"], key=lambda r: 10 ** (-r["sqnr_db"] / 10) * r["bytes_per_elem"])
        assert e["codec"] == best["codec"] and len(e["candidates"]) == 12  # 5 G x 2 axes, int8/6
        assert e["default"] == "taco(group_size=128,fmt=e4m3)" and e["default_sqnr_db"] > 20
    printed = capfd.readouterr().out
    assert "layers.0.attn.out.fwd" in printed and "default SQNR" in printed

    before = (out / CALIBRATION_FILE).read_text()
    r = _run(tiny(corpus, out, *CAL, "--train.steps=5", "--train.resume=true"))
    assert not r[0]["sampled"] and not r[1]["sampled"] and not r[0]["observer"]  # nothing re-sampled
    assert r[0]["site_codecs"] == r[1]["site_codecs"] == want
    assert (out / CALIBRATION_FILE).read_text() == before
    assert "resumed run" in capfd.readouterr().out

    # the file applied to a new run: the same codecs, no sampling, recorded in the new run folder
    path = out / CALIBRATION_FILE
    n = _run(tiny(corpus, tmp_path / "new", f"--compression.calibration={path}", "--train.steps=1"))
    assert n[0]["site_codecs"] == n[1]["site_codecs"] == want and not n[0]["sampled"]
    assert json.loads((tmp_path / "new" / CALIBRATION_FILE).read_text()) == doc


@pytest.mark.slow  # one 4-rank run, ~50 s
def test_with_pipeline_stages_every_stage_decides_and_every_rank_installs_all(corpus, tmp_path):
    out = tmp_path / "pp"
    cfg = tiny(corpus, out, *CAL, "--parallel.pp=2", "--parallel.microbatches=2", "--train.steps=2")
    got = _run(cfg)
    sites = json.loads((out / CALIBRATION_FILE).read_text())["sites"]
    stage0, stage1 = set(got[0]["sites"]), set(got[2]["sites"])  # ranks 0-1: stage 0, ranks 2-3: stage 1
    assert stage0 and stage1 and not stage0 & stage1 and set(sites) == stage0 | stage1
    assert "tok_emb.fwd" in stage0 and "lm_head.bwd" in stage1
    want = {s: build_codec(e["codec"]).spec for s, e in sites.items()}
    assert all(g["site_codecs"] == want for g in got)  # every rank holds every stage's choice


@pytest.mark.slow  # two 2-rank runs, ~40 s
def test_taco_calibrate_runs_k_steps_writes_the_json_and_an_unmet_budget_fails(corpus, tmp_path, capfd):
    from tests.helpers.runs import tiny_args

    base = ["calibrate", *tiny_args(corpus, tmp_path / "c"), "--parallel.tp=2"]
    base.append("--compression.calibrate_steps=1")
    cands = '--compression.calibrate_candidates=["taco(group_size=32)","int8-hadamard"]'
    assert main([*base, cands]) == 0
    doc = json.loads((tmp_path / "c" / CALIBRATION_FILE).read_text())
    assert doc["step"] == 1
    assert doc["candidates"] == ["taco(group_size=32,fmt=e4m3)", "int8-hadamard(group_size=128)"]
    assert "apply it with --compression.calibration=" in capfd.readouterr().out
    bad = [*base, f"--train.out_dir={tmp_path / 'd'}", "--compression.max_bytes_per_elem=0.5"]
    assert main(bad) != 0
    err = capfd.readouterr().err
    assert "calibration of TP site" in err and "max_bytes_per_elem=0.5" in err


def _heavy(*shape):
    x = torch.randn(*shape)
    x[..., 3] *= 40  # an outlier channel: small groups (or grouping across it) pay
    return x


def test_decide_respects_the_floor_and_the_budget():
    samples = {"a.fwd": [_heavy(4, 16, 64), _heavy(4, 16, 64)], "b.bwd": [torch.randn(4, 16, 64)]}
    defaults = dict.fromkeys(samples, "taco(group_size=128,fmt=e4m3)")
    specs = ["taco(group_size=32)", "taco(group_size=128)", "int4-hadamard", "int6-hadamard", "int8-hadamard"]
    cands = [build_codec(c) for c in specs]
    score = lambda r: 10 ** (-r["sqnr_db"] / 10) * r["bytes_per_elem"]  # noqa: E731
    free = decide(samples, defaults, cands, -math.inf, 0)
    for e in free.values():  # no constraint: the best error x bytes of all
        assert e["codec"] == min(e["candidates"], key=score)["codec"]
        assert e["default_sqnr_db"] == next(r for r in e["candidates"] if "128,fmt" in r["codec"])["sqnr_db"]
    for floor, budget in ((28.0, 0.8), (18.0, 0.6), (33.0, 0)):
        got = decide(samples, defaults, cands, floor, budget)
        for e in got.values():
            cap = budget or math.inf
            ok = [r for r in e["candidates"] if r["sqnr_db"] >= floor and r["bytes_per_elem"] <= cap]
            assert e["sqnr_db"] >= floor and e["bytes_per_elem"] <= cap
            assert e["codec"] == min(ok, key=score)["codec"], (floor, budget, e)
    assert {e["codec"] for e in decide(samples, defaults, cands, 28.0, 0.8).values()} == {
        "int6-hadamard(group_size=64,signs=auto,scale_fmt=bf16)"
    }
    with pytest.raises(ValueError, match="site 'a.fwd'.*max_bytes_per_elem=0.5"):
        decide(samples, defaults, cands, -math.inf, 0.5)
    with pytest.raises(ValueError, match="min_sqnr_db=28.0"):  # int4 alone fits 0.6 B/elem: < 28 dB
        decide(samples, defaults, cands, 28.0, 0.6)
    with pytest.raises(ValueError, match="min_sqnr_db=60"):
        decide(samples, defaults, cands, 60.0, 0)


def test_sampler_keeps_the_first_call_per_step_bounded_and_leaves_inputs_alone():
    s = SiteSampler(max_samples=2, max_elems=4 * 8 * 16)
    x = torch.randn(4, 32, 16)
    keep = x.clone()
    codec = build_codec("taco")
    for _ in range(3):
        s("a.fwd", "all_reduce", x, codec)
        s("a.fwd", "all_reduce", x * 2, codec)  # a second call in the same step: not sampled
        s("p.fwd", "all_reduce", x, None)  # a plain site: nothing to calibrate
        s.end_step()
    assert torch.equal(x, keep) and set(s.samples) == {"a.fwd"}
    assert len(s.samples["a.fwd"]) == 2 and s.samples["a.fwd"][0].shape == (4, 8, 16)
    assert torch.equal(s.samples["a.fwd"][1], x[:, :8]) and s.defaults["a.fwd"] == codec.spec


def test_start_up_names_a_bad_candidate_or_calibration_file(tmp_path):
    from taco.train.adaptive.calibration import check_calibration
    from taco.train.config import load_config

    def cfg(*a):
        return load_config(None, ["--compression.calibrate=true", *a])

    with pytest.raises(ValueError, match=r"calibrate_candidates: 'taco\(group_size=48\)'"):
        check_calibration(cfg('--compression.calibrate_candidates=["taco(group_size=48)"]'))
    with pytest.raises(ValueError, match="tp_codec"):
        cfg("--compression.tp_codec=none")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        check_calibration(cfg(f"--compression.calibration={tmp_path / 'nope.json'}"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "sites": {"a.fwd": {"codec": "taco(group_size=48)"}}}')
    with pytest.raises(ValueError, match="site 'a.fwd'"):
        check_calibration(cfg(f"--compression.calibration={bad}"))
    bad.write_text('{"sites": []}')
    with pytest.raises(ValueError, match="not a calibration.json"):
        check_calibration(cfg(f"--compression.calibration={bad}"))
    check_calibration(cfg())  # the default candidates build
