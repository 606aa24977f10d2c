"""Activation recompute (`train.recompute`): bit-identical losses and gradients for every mode,
TP traffic of recompute counted apart, and fewer bytes kept for backward (docs/design.md 1.7)."""

from __future__ import annotations

import pytest
import torch

from taco.parallel.recompute import SavedBytes
from taco.train.build import build_run
from taco.train.config import load_config
from taco.train.data import resolve_data_dir
from tests.helpers.dist import run_distributed
from tests.helpers.runs import tiny_args


def _run(args: list[str], mode: str, steps: int) -> dict:
    cfg = load_config(None, [*args, f"--train.recompute={mode}"])
    tr = build_run(cfg, cfg.parallel.dims().build(), resolve_data_dir(cfg.data), device="cpu")
    losses, saved = [], 0
    for i in range(steps):
        if i == 0:
            with SavedBytes(tr.stage) as counter:
                losses.append(tr.step().loss)
            saved = counter.bytes
        else:
            losses.append(tr.step().loss)
    tp = tr.policies["tp"]
    sites = {n: (s.calls, s.wire_bytes) for n, s in tp.stats.sites.items()}
    again = {n: (s.calls, s.wire_bytes) for n, s in tp.recompute_stats.sites.items()}
    local = [getattr(p, "to_local", lambda p=p: p)() for p in tr.stage.parameters()]  # FSDP2: shards
    weights = [w.detach().clone() for w in local]
    return {"losses": losses, "saved": saved, "sites": sites, "recompute": again, "params": weights}


def _modes_body(rank: int, world: int, args: list[str], steps: int) -> dict:
    return {mode: _run(args, mode, steps) for mode in ("none", "full", "selective")}


def _check_modes(res: dict) -> None:
    base = res["none"]
    assert not base["recompute"], base["recompute"]
    for mode in ("full", "selective"):
        r = res[mode]
        assert r["losses"] == base["losses"], (mode, r["losses"], base["losses"])
        assert all(torch.equal(a, b) for a, b in zip(r["params"], base["params"])), f"{mode}: weights differ"
        assert r["sites"] == base["sites"], (mode, r["sites"], base["sites"])  # each site once per step
        assert r["recompute"], f"{mode}: no recomputed TP traffic counted"
    assert res["full"]["saved"] < res["selective"]["saved"] < base["saved"], {m: res[m]["saved"] for m in res}


@pytest.mark.parametrize("codec", ["none", "taco"])
def test_recompute_is_bit_identical_and_counts_each_site_once(corpus, tmp_path, codec):
    args = [*tiny_args(corpus, tmp_path / "run"), "--parallel.tp=2", f"--compression.tp_codec={codec}"]
    res = run_distributed(_modes_body, 2, args, 3)
    _check_modes(res[0])


MESHES = {
    "qwen-tp2-pp2-sp-1f1b": [
        "--model.kind=qwen", "--model.n_layer=4", "--model.n_head=4", "--model.n_kv_head=2",
        "--parallel.tp=2", "--parallel.pp=2", "--parallel.sp=true", "--parallel.microbatches=2",
        "--compression.tp_codec=taco", "--compression.pp_codec=int8-hadamard",
    ],
    "gpt-dp2-tp2-ddp": ["--parallel.tp=2", "--parallel.dp=2", "--compression.tp_codec=taco",
                        "--compression.dp_codec=int8-hadamard"],
    "gpt-dp2-tp2-fsdp2": ["--parallel.tp=2", "--parallel.dp=2", "--parallel.dp_shard=true",
                          "--compression.tp_codec=int6-hadamard"],
}  # fmt: skip


@pytest.mark.parametrize("mesh", list(MESHES))
def test_recompute_composes_with_pipelines_and_data_parallelism(corpus, tmp_path, mesh):
    args = [*tiny_args(corpus, tmp_path / "run"), *MESHES[mesh]]
    for res in run_distributed(_modes_body, 4, args, 2):
        _check_modes(res)


def _policy_body(rank: int, world: int) -> None:
    from taco import comm
    from taco.comm import CommPolicy

    seen: list[str] = []
    pol = CommPolicy(codec="taco", observer=lambda site, op, x, codec: seen.append(site))
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(rank))
    first = comm.all_reduce(x, site="s.fwd", policy=pol)
    with pol.recomputing():
        again = comm.all_reduce(x, site="s.fwd", policy=pol)
    assert torch.equal(first, again), "a recomputed collective must return the same bytes"
    assert seen == ["s.fwd"], seen  # the observer (calibration, telemetry, auto policy) once
    assert pol.stats["s.fwd"].calls == 1 and pol.recompute_stats["s.fwd"].calls == 1
    assert pol.stats["s.fwd"].wire_bytes == pol.recompute_stats["s.fwd"].wire_bytes > 0
    assert not pol.recompute


def test_a_recomputing_policy_counts_apart_and_hides_calls_from_its_observer():
    run_distributed(_policy_body, 2)


def test_calibration_and_telemetry_see_each_site_once_under_recompute(corpus, tmp_path):
    args = [*tiny_args(corpus, tmp_path / "run"), "--parallel.tp=2", "--compression.tp_codec=taco",
            "--compression.calibrate=true", "--compression.calibrate_steps=1",
            "--compression.telemetry_every=1"]  # fmt: skip
    _check_modes(run_distributed(_modes_body, 2, args, 3)[0])  # the same choices, losses and statistics
