"""3D parallelism (dp, pp, tp) against the single-process reference, and with every axis compressed.

`parallel_step` is the shared body of the pipeline, data-parallel and 3D tests: one training
step of a tiny_model GPT/Qwen on a mesh, returning the per-axis statistics and comparing loss and every
gradient with the unsharded model on the whole batch (asserted in the rank, values in the message).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from taco.train.launch import launch
from tests.helpers.dist import run_distributed
from tests.helpers.runs import cli_error, parallel_step, resume_exact, run_config, tiny_args


def _both_models_3d(rank: int, world: int) -> list[dict]:
    gpt = parallel_step(rank, world, "gpt", 2, 2, 2, schedule="1f1b", n_micro=2)
    qwen = parallel_step(rank, world, "qwen", 2, 2, 2, sp=True, schedule="gpipe", n_micro=2)
    on = {"tp": "taco", "pp": "taco", "dp": "int8-hadamard"}
    comp = parallel_step(rank, world, "gpt", 2, 2, 2, n_micro=2, codecs=on, tol=None)
    return [gpt, qwen, comp]


@pytest.mark.slow  # 8 gloo ranks: ~70 s on the shared 2-core box
def test_3d_step_matches_reference_and_compresses_every_axis():
    res = run_distributed(_both_models_3d, 8, timeout=300)
    for gpt, qwen, comp in res:
        assert gpt["checked"] > 0 and qwen["checked"] > 0  # every gradient matched the reference
        assert math.isfinite(comp["loss"]) and abs(comp["loss"] - comp["ref_loss"]) < 0.02
        assert comp["grad_err"] < 0.2, comp["grad_err"]
        assert 0 < comp["tp_wire"] < 0.6 * comp["tp_raw"]
        assert 0 < comp["dp_wire"] < 0.6 * comp["dp_raw"]
        assert comp["dp_hook_calls"] >= 1
        assert 0 < comp["pp_wire"] < 0.6 * comp["pp_raw"]  # stage 0 sends activations, 1 gradients


def _pp_tp(rank: int, world: int) -> list[dict]:
    return [
        parallel_step(rank, world, "gpt", 1, 2, 2, schedule="1f1b", n_micro=4),
        parallel_step(rank, world, "qwen", 1, 2, 2, sp=True, n_micro=2),  # [b, s/tp, h] between stages
    ]


def test_pp_with_tp_and_sequence_parallel_stages_matches_reference():
    for gpt, qwen in run_distributed(_pp_tp, 4):
        assert gpt["checked"] > 0 and qwen["checked"] > 0


# -- the trainer on pipeline / 3D meshes ------------------------------------------------------------


def test_trainer_pipeline_reports_bytes_per_axis(corpus, tmp_path):
    mesh = ["--parallel.pp=2", "--parallel.microbatches=2", "--compression.pp_codec=int4-hadamard"]
    res = launch(run_config(corpus, tmp_path / "pp", *mesh))
    assert math.isfinite(res["final_val_loss"]) and res["mesh"] == "DP1-PP2-TP1"
    assert 0 < res["pp_wire_bytes_per_step"] < 0.6 * res["pp_raw_bytes_per_step"]
    assert res["tp_raw_bytes_per_step"] == res["dp_raw_bytes_per_step"] == 0
    rec = json.loads((tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"tp_wire_bytes", "pp_wire_bytes", "dp_wire_bytes", "pp_raw_bytes", "val_loss"} <= set(rec)


@pytest.mark.slow  # 3 runs of 2 ranks each: ~35 s apiece
@pytest.mark.parametrize("axis", ["pp", "dp"])
def test_trainer_pipeline_or_compressed_dp_resumes_exactly(corpus, tmp_path, axis):
    codec = "int4-hadamard" if axis == "pp" else "int8-hadamard"
    mesh = [f"--parallel.{axis}=2", "--parallel.microbatches=2", f"--compression.{axis}_codec={codec}"]
    resume_exact(corpus, tmp_path, mesh)


@pytest.mark.slow  # 3 runs of 8 ranks
def test_trainer_3d_with_every_axis_compressed_resumes_exactly(corpus, tmp_path):
    mesh = ["--parallel.dp=2", "--parallel.pp=2", "--parallel.tp=2", "--parallel.microbatches=2"]
    mesh += ["--compression.tp_codec=taco", "--compression.pp_codec=taco"]
    mesh += ["--compression.dp_codec=int8-hadamard"]
    res = resume_exact(corpus, tmp_path, mesh)
    assert res["mesh"] == "DP2-PP2-TP2"
    for a in ("tp", "pp", "dp"):
        assert 0 < res[f"{a}_wire_bytes_per_step"] < 0.6 * res[f"{a}_raw_bytes_per_step"], a
    assert "[dp]" in (tmp_path / "full" / "comm_stats.txt").read_text()


def test_bad_meshes_stop_at_start_up_with_one_clear_message(corpus, tmp_path, capsys, monkeypatch):
    base = ["train", *tiny_args(corpus, tmp_path / "x")]
    e = cli_error(capsys, [*base, "--parallel.pp=3"])
    assert "parallel.pp = 3" in e and "n_layer = 2" in e
    e = cli_error(capsys, [*base, "--parallel.microbatches=3"])
    assert "batch_size = 4 must be divisible" in e and "microbatches" in e
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    e = cli_error(capsys, [*base, "--parallel.pp=2"])
    assert "= 2 but torchrun started 3 ranks" in e


def test_codec_none_ignores_options_left_in_the_config():
    from taco.train.build import build_policy
    from taco.train.config import load_config

    opts = [f"--compression.{a}_codec_options.group_size=64" for a in ("tp", "pp", "dp")]
    cfg = load_config(None, ["--compression.tp_codec=none", *opts])  # e.g. a baseline of demo.toml
    assert build_policy(cfg).codec_for("x", 1 << 20, torch.float32) is None
    assert build_policy(cfg, "pp").codec_for("pp.act", 1 << 20, torch.float32) is None
