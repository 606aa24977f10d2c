"""A run's failure modes end cleanly: verified checkpoints, one-line rank errors, signals, run folders.

Each test is small (world 2, the tiny TP=2 GPT of `tests.helpers.runs.tiny`, a few steps). The
checkpoint tests share one run (4 steps, checkpoints at steps 2 and 4), copied before being damaged.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from taco.cli import main
from taco.train.checkpoint import load_checkpoint
from taco.train.config import load_config
from taco.train.errors import CheckpointError
from taco.train.launch import launch
from tests.helpers.procs import child_pids, finish_run, proc_name, start_long_run
from tests.helpers.runs import losses, tiny, tiny_args

MESH = {"dp": 1, "pp": 1, "tp": 2, "sp": 0}




@pytest.fixture(scope="module")
def run4(corpus, tmp_path_factory):
    """A finished 4-step TP=2 run with checkpoints at steps 2 and 4 (copy it before changing it)."""
    out = tmp_path_factory.mktemp("run4") / "run"
    launch(tiny(corpus, out, "--train.steps=4", "--train.checkpoint_interval=2", "--train.eval_interval=2"))
    return out


def _copy(run4: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run4, out)
    return out


def _train(capfd, argv: list[str]) -> tuple[int, list[str]]:
    """`taco train ...` in this process; (exit code, the non-empty lines of stderr, ranks' included)."""
    code = main(["train", *argv])
    err = capfd.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- 1, 3: checkpoints


def test_checkpoint_meta_records_rank_mesh_and_checksum_of_every_file(run4):
    d = run4 / "checkpoints" / "step_0000004"
    meta = json.loads((d / "meta.json").read_text())
    assert meta["step"] == 4 and meta["mesh"] == MESH
    for r, coords in ((0, {"dp": 0, "pp": 0, "tp": 0}), (1, {"dp": 0, "pp": 0, "tp": 1})):
        e = meta["files"][f"rank{r}.pt"]
        assert e["rank"] == r and e["coords"] == coords and re.fullmatch(r"[0-9a-f]{64}", e["sha256"])
        assert e["bytes"] == (d / f"rank{r}.pt").stat().st_size
    assert not list(run4.rglob("*.tmp"))  # written to temporary names, then renamed
    assert (run4 / "checkpoints" / "latest").read_text() == "step_0000004"


def _flip(f: Path, n: int = 64) -> None:
    b = bytearray(f.read_bytes())
    at = len(b) // 2
    b[at : at + n] = bytes(x ^ 0xFF for x in b[at : at + n])
    f.write_bytes(bytes(b))


@pytest.mark.parametrize("damage", ["flip", "swap", "missing", "empty"])
def test_a_damaged_checkpoint_stops_at_start_up_naming_the_file(run4, corpus, tmp_path, capfd, damage):
    out = _copy(run4, tmp_path)
    d = out / "checkpoints" / "step_0000004"
    r0, r1 = d / "rank0.pt", d / "rank1.pt"
    if damage == "flip":
        _flip(r0)
    elif damage == "swap":
        r0.rename(d / "x")
        r1.rename(r0)
        (d / "x").rename(r1)
    elif damage == "missing":
        r1.unlink()
    else:
        r1.write_bytes(b"")
    code, err = _train(capfd, [*tiny_args(corpus, out), "--parallel.tp=2", "--train.resume=true"])
    assert code == 2 and len(err) == 1, err  # one line, before any rank starts
    name = "rank1.pt" if damage in ("missing", "empty") else "rank0.pt"
    assert str(d / name) in err[0], err
    assert {"flip": "sha256", "swap": "rank1.pt's content", "missing": "missing", "empty": "empty"}[
        damage
    ] in err[0]


def test_a_rank_refuses_another_ranks_shard_even_when_meta_was_rewritten(run4, tmp_path):
    """The launcher checks the checksums; each rank also checks the rank and coords inside its file."""
    d = _copy(run4, tmp_path) / "checkpoints" / "step_0000004"
    (d / "rank0.pt").rename(d / "x")
    (d / "rank1.pt").rename(d / "rank0.pt")
    meta = json.loads((d / "meta.json").read_text())
    f = meta["files"]
    f["rank0.pt"]["sha256"], f["rank1.pt"]["sha256"] = f["rank1.pt"]["sha256"], f["rank0.pt"]["sha256"]
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"rank0\.pt holds rank 1's shard"):
        load_checkpoint(d, 0, MESH)


# ----------------------------------------------------------------------------- 8: hangs and signals


def test_the_process_group_timeout_is_a_config_field(corpus, tmp_path, monkeypatch):
    from taco.train import launch as launch_mod

    seen = {}
    monkeypatch.setattr(launch_mod.dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    cfg = load_config(None, [*tiny_args(corpus, tmp_path), "--parallel.tp=2", "--parallel.timeout_s=42"])
    launch_mod.init_rank(cfg, 0)
    assert seen["timeout"] == datetime.timedelta(seconds=42)
    # the TP/PP/DP groups too (dist.new_group's default is 30 min, whatever init_process_group got)
    groups = []
    monkeypatch.setattr(launch_mod.dist, "new_group", lambda ranks, **kw: groups.append(kw["timeout"]))
    for name, value in (("is_initialized", True), ("get_world_size", 2), ("get_rank", 0)):
        monkeypatch.setattr(launch_mod.dist, name, lambda v=value: v)
    fake = type("T", (), {"fit": dict, "close": lambda self: None})  # no DP hook worker to close
    monkeypatch.setattr("taco.train.trainer.Trainer", lambda *a, **kw: fake())
    launch_mod.run_rank(cfg, tmp_path, torch.device("cpu"))
    assert groups == [datetime.timedelta(seconds=42)]  # the one TP group of a tp=2 mesh
    assert load_config(None, tiny_args(corpus, tmp_path)).parallel.timeout_s <= 120  # a hang ends in ~2 min
    with pytest.raises(ValueError, match="parallel.timeout_s"):
        load_config(None, [*tiny_args(corpus, tmp_path), "--parallel.timeout_s=0"])


def _wait_first_step(proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if " step " in line:
                return
            if not line and proc.poll() is not None:
                break
    raise AssertionError(f"no step logged (exit code {proc.poll()}): {proc.stderr.read()[-2000:]}")


@pytest.mark.slow  # ~40 s: a rank stopped with SIGSTOP ends the job after parallel.timeout_s
def test_a_stopped_rank_ends_the_job_after_the_timeout(corpus, tmp_path):
    proc = start_long_run(corpus, tmp_path / "run", "--parallel.timeout_s=10")
    try:
        _wait_first_step(proc)
        kids = child_pids(proc.pid)
        (rank1,) = [k for k in kids if proc_name(k) == "taco-rank1"]
        os.kill(rank1, signal.SIGSTOP)
    except BaseException:
        finish_run(proc, child_pids(proc.pid), 1)
        raise
    code, err, took = finish_run(proc, kids, timeout=60)
    assert code == 1 and took < 40, (code, took, err)
    assert re.fullmatch(r"taco train: error on rank 0: .*", err[-1]), err


# ----------------------------------------------------------------------------- 9: rank errors


def test_an_error_inside_a_rank_is_one_line_naming_its_traceback_log(corpus, tmp_path, capfd):
    out = tmp_path / "run"
    (tmp_path / "file").write_text("")  # rank 0 fails to make the capture folder under a file
    capture = f"--train.capture_dir={tmp_path / 'file' / 'sub'}"
    code, err = _train(capfd, [*tiny_args(corpus, out), "--parallel.tp=2", capture])
    assert code == 1, err
    want = r"taco train: error on rank (0): NotADirectoryError: .*file/sub.* \(traceback: (.*)\)"
    m = re.fullmatch(want, err[-1])
    assert m, err
    assert not any("ProcessRaisedException" in x or "Traceback" in x for x in err), err
    log = Path(m.group(2))
    assert log == out / f"error_rank{m.group(1)}.log" and "Traceback" in log.read_text()


def test_the_root_cause_is_chosen_over_a_dead_peers_connection_errors():
    from taco.train.procs import pick_error

    comm = {"rank": 0, "type": "DistBackendError", "message": "Connection closed by peer", "time": 1.0}
    comm.update(comm=True, log="a")
    own = {"rank": 1, "type": "FileNotFoundError", "message": "x", "time": 2.0, "comm": False, "log": "b"}
    assert pick_error([comm, own], {}).rank == 1
    died = pick_error([comm], {1: -9})
    assert died.rank == 1 and "SIGKILL" in str(died)
    assert pick_error([comm], {}).rank == 0


# ----------------------------------------------------------------------------- 10: run folders


def test_resume_without_a_checkpoint_says_it_starts_from_step_0(corpus, tmp_path, capfd):
    out = tmp_path / "fresh"
    code, err = _train(capfd, [*tiny_args(corpus, out), "--train.steps=1", "--train.resume=true"])
    assert code == 0, err
    assert any(f"no checkpoint in {out / 'checkpoints'}; starting from step 0" in x for x in err), err
    code, err = _train(capfd, [*tiny_args(corpus, out), f"--train.resume={tmp_path / 'nothing'}"])
    assert code == 2 and "nothing" in err[-1], err
    (tmp_path / "empty").mkdir()
    code, err = _train(capfd, [*tiny_args(corpus, out), f"--train.resume={tmp_path / 'empty'}"])
    assert code == 2 and "no checkpoint" in err[-1], err


def _steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_folder_holding_a_run_is_refused_unless_overwritten(run4, corpus, tmp_path, capfd):
    out = _copy(run4, tmp_path)
    code, err = _train(capfd, [*tiny_args(corpus, out), "--parallel.tp=2"])
    assert code == 2 and len(err) == 1, err
    assert "already holds a run" in err[0] and "--train.overwrite=true" in err[0], err
    code, err = _train(capfd, [*tiny_args(corpus, out), "--parallel.tp=2", "--train.overwrite=true"])
    assert code == 0, err
    assert _steps(out) == [1, 2]  # the old run's records are gone
    assert len(list((out / "tb").glob("events.*"))) == 1
    assert not (out / "checkpoints" / "step_0000004").exists()  # nor can its checkpoints be resumed


def test_resuming_truncates_the_metrics_after_the_resume_step(run4, corpus, tmp_path):
    out = _copy(run4, tmp_path)
    before = losses(out)
    step2 = out / "checkpoints" / "step_0000002"
    res = launch(tiny(corpus, out, "--train.steps=4", "--train.eval_interval=2", f"--train.resume={step2}"))
    assert res["resumed_from"] == 2
    assert _steps(out) == [1, 2, 3, 4]  # not 1, 2, 3, 4, 3, 4
    assert losses(out) == before  # and the resumed steps are the same


def test_save_writes_meta_and_latest_only_after_every_rank_file(tmp_path, monkeypatch):
    """A crash while writing a rank file leaves the previous checkpoint as `latest`."""
    from taco.train.checkpoint import find_checkpoint, save_checkpoint

    st = {"model": {"w": torch.ones(3)}, "opt": {}, "step": 1, "mesh": {"dp": 1, "pp": 1, "tp": 1, "sp": 0}}
    save_checkpoint(tmp_path, 1, 0, st)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, 0, {**st, "step": 2})
    assert find_checkpoint(True, tmp_path).name == "step_0000001"
    assert not (tmp_path / "checkpoints" / "step_0000002" / "meta.json").exists()


def test_a_checkpoint_with_separate_q_k_v_is_one_clear_message(tmp_path):
    """Models fuse q/k/v (attn.qkv) and gate/up (mlp.gate_up); a checkpoint written with the separate
    projections is refused at load with one line naming the tensor and what to do."""
    from taco.train.checkpoint import load_checkpoint, save_checkpoint
    from taco.train.errors import CheckpointError

    mesh = {"dp": 1, "pp": 1, "tp": 1, "sp": 0}
    st = {"model": {"layers.0.attn.q.weight": torch.ones(3)}, "opt": {}, "step": 1, "mesh": mesh}
    d = save_checkpoint(tmp_path, 1, 0, st)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.q\.weight: .*separate projections") as e:
        load_checkpoint(d, 0, mesh)
    assert "\n" not in str(e.value)
    fused = {**st, "model": {"layers.0.attn.qkv.weight": torch.ones(3)}}
    assert load_checkpoint(save_checkpoint(tmp_path, 2, 0, fused), 0, mesh)["step"] == 1
