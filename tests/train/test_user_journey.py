"""The rough edges of a new user's first hour, each fixed and kept fixed: one clear line instead of
a traceback or a flood, a warning that said nothing gone, defaults shown, progress kept on Ctrl-C.

Runs are the tiny TP=2 GPT of `tests.helpers.runs.tiny` (world 2, a few steps); the signal tests
start `taco train` as a job of its own, as a terminal would (`tests.helpers.procs`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from taco.cli import main
from taco.train.launch import launch
from tests.helpers.procs import ROOT, child_pids, finish_run, proc_name, start_long_run
from tests.helpers.runs import losses, tiny, tiny_args


def _train(capfd, argv: list[str]) -> tuple[int, list[str]]:
    code = main(["train", *argv])
    return code, [x for x in capfd.readouterr().err.splitlines() if x.strip()]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def run2(corpus, tmp_path_factory):
    """A finished 2-step TP=2 run with checkpoints at steps 1 and 2 (copy it before changing it)."""
    out = tmp_path_factory.mktemp("run2") / "run"
    launch(tiny(corpus, out, "--train.steps=2", "--train.checkpoint_every=1", "--train.eval_interval=0"))
    return out


def test_resuming_with_another_model_size_is_one_line_naming_the_parameter(run2, corpus, tmp_path, capfd):
    out = tmp_path / "run"
    shutil.copytree(run2, out)
    argv = [*tiny_args(corpus, out), "--parallel.tp=2", "--model.hidden=64", "--train.resume=true"]
    code, err = _train(capfd, argv)
    assert code == 1 and len(err[-1]) < 600, err
    want = r"taco train: error on rank [01]: CheckpointError: .*rank[01]\.pt: tok_emb\.weight has shape "
    want += r"\[192, 32\] in the checkpoint but \[192, 64\] in this model .*"
    assert re.fullmatch(want, err[-1]), err[-1]
    assert not any("size mismatch" in x for x in err), err


def test_data_parallel_runs_print_no_ddp_warning(corpus, tmp_path, capfd):
    code, err = _train(capfd, [*tiny_args(corpus, tmp_path / "dp"), "--parallel.dp=2", "--train.steps=2"])
    assert code == 0, err
    assert not any("find_unused_parameters" in x or "Warning" in x for x in err), err


def test_a_closed_pipe_ends_the_output_quietly():
    """`taco config show | head`: the reader goes away; no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "taco.cli", "config", "show"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), cwd=ROOT,
    )  # fmt: skip
    proc.stdout.close()  # before the command writes a byte: every write fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 128 + signal.SIGPIPE, err
    assert err == "", err


def test_export_of_a_damaged_checkpoint_advises_another_step(run2, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(run2, out)
    f = out / "checkpoints" / "step_0000002" / "rank1.pt"
    f.write_bytes(f.read_bytes()[:-100])
    assert main(["export", "--run", str(out), "--out", str(tmp_path / "hf")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert str(f) in line and "truncated" in line, line
    assert f"taco export --run {out} --step N" in line and "also has step 1" in line, line
    assert "train.resume" not in line, line
    assert main(["export", "--run", str(out), "--out", str(tmp_path / "hf"), "--step", "1"]) == 0
    assert "exported step 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("--compression.tp_codec_options.group_size=100", ["compression.tp_codec", "group_size=100"]),
        ("--compression.tp_codec_options.bogus=1", ["compression.tp_codec", "bogus"]),
        ("--compression.guard_fallback=taco(group_size=7)", ["compression.guard_fallback", "group_size=7"]),
    ],
)
def test_codec_options_are_checked_before_any_rank_starts(corpus, tmp_path, capfd, override, names):
    out = tmp_path / "run"
    code, err = _train(capfd, [*tiny_args(corpus, out), "--parallel.tp=2", override])
    assert code == 2 and len(err) == 1, err  # the launcher's one line: no rank ran
    assert err[0].startswith("taco train: ") and all(n in err[0] for n in names), err
    assert not list(out.glob("error_rank*.log")) and not (out / "metrics.jsonl").exists()


def test_bench_cluster_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "cluster", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("50,100,200,400,1000", "bf16,fp32", "7200", "16384", "both"):
        assert f"(default: {shown})" in text, shown


def test_checkpoint_every_is_an_alias_with_a_default(corpus, tmp_path):
    from taco.train.config import load_config

    assert load_config(None).train.checkpoint_interval == 500
    assert load_config(None, ["--train.checkpoint_every=7"]).train.checkpoint_interval == 7
    toml = tmp_path / "c.toml"
    toml.write_text("[train]\ncheckpoint_every = 3\n")
    assert load_config(toml).train.checkpoint_interval == 3


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_run_keeps_its_last_step_and_resumes_from_it(corpus, tmp_path, sig):
    """Ctrl-C (SIGINT to the job's process group) or SIGTERM to the launcher at step k: every rank
    stops, one line says so, a checkpoint of step k is written atomically, and (SIGINT, to keep
    the suite short) `--train.resume=true` continues at step k + 1 as the uninterrupted run."""
    out = tmp_path / "run"
    flat = ["--train.warmup_steps=0", "--train.min_lr=1e-3", "--train.lr=1e-3"]  # lr independent of steps
    proc = start_long_run(corpus, out, *flat)
    try:
        step = 0
        while step < 3:  # a few steps in, somewhere in the middle of one
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()[-2000:]
            if m := re.search(r" step +(\d+)/", line):
                step = int(m.group(1))
        kids = child_pids(proc.pid)
        assert sum(proc_name(k).startswith("taco-rank") for k in kids) == 2, [proc_name(k) for k in kids]
    except BaseException:
        finish_run(proc, child_pids(proc.pid), 1)
        raise
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    code, err, took = finish_run(proc, kids, timeout=60)
    assert code == 128 + sig and took < 20, (code, took, err)
    m = re.fullmatch(
        rf"taco train: stopped by {sig.name}: checkpoint of step (\d+) written to (.*); continue with "
        r"--train.resume=true",
        err[-1],
    )
    assert m, err
    k = int(m.group(1))
    assert k >= step and Path(m.group(2)) == out / "checkpoints" / f"step_{k:07d}", err
    assert (out / "checkpoints" / "latest").read_text() == f"step_{k:07d}"
    assert not list(out.rglob("*.tmp")) and not any("Traceback" in x for x in err), err
    assert max(losses(out)) == k  # the records end with the saved step
    if sig != signal.SIGINT:
        return
    # resumed for 2 more steps: the same losses as a run that was never stopped
    args = ["--parallel.tp=2", "--train.eval_interval=0", f"--train.steps={k + 2}", *flat]
    res = launch(tiny(corpus, out, *args, "--train.log_interval=1", "--train.resume=true"))
    assert res["resumed_from"] == k
    launch(tiny(corpus, tmp_path / "straight", *args, "--train.log_interval=1"))
    assert losses(out) == losses(tmp_path / "straight")


def test_a_second_signal_stops_at_once(corpus, tmp_path):
    """The first Ctrl-C asks for a checkpoint; a second one stops every rank without waiting (here
    rank 1 is frozen, so the first request could never be met)."""
    proc = start_long_run(corpus, tmp_path / "run")
    try:
        while " step " not in proc.stdout.readline():
            assert proc.poll() is None, proc.stderr.read()[-2000:]
        kids = child_pids(proc.pid)
        (rank1,) = [k for k in kids if proc_name(k) == "taco-rank1"]
        os.kill(rank1, signal.SIGSTOP)
        os.killpg(proc.pid, signal.SIGINT)
        while "finishing the step" not in proc.stderr.readline():
            assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)
    except BaseException:
        finish_run(proc, child_pids(proc.pid), 1)
        raise
    code, err, took = finish_run(proc, kids, timeout=30)
    assert code == 130 and took < 15, (code, took, err)
    assert err[-1] == "taco train: stopped by SIGINT: 2 rank(s) stopped at once, no checkpoint written", err


def test_flops_per_token_counts_every_matrix_multiply():
    from taco.models import build_model
    from taco.train.perf import flops_per_token

    L, h, V, T = 3, 64, 1000, 32
    gpt = build_model("gpt", n_layer=L, n_head=4, hidden=h, vocab_size=V, seq_len=T)
    n = L * 12 * h * h + V * h  # qkv, out, MLP 4h up and down; the (tied) output head
    assert flops_per_token(gpt, L, h, T) == 6 * n + 12 * L * h * T
    qwen = build_model("qwen", n_layer=L, n_head=4, n_kv_head=2, head_dim=32, hidden=h, intermediate=96,
                       vocab_size=V, seq_len=T, tie_embeddings=False)  # fmt: skip
    d = 4 * 32
    n = L * (h * d + 2 * h * 2 * 32 + d * h + 3 * h * 96) + V * h
    assert flops_per_token(qwen, L, d, T) == 6 * n + 12 * L * d * T


def test_the_peak_of_a_device_is_stated(monkeypatch):
    import torch

    from taco.train.perf import device_peak_flops

    assert device_peak_flops(torch.device("cpu"), torch.float32, 2.5) == (2.5e12, pytest.approx(
        "2.5 TFLOP/s per device (train.peak_tflops)"))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    peak, source = device_peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert peak == 989.4e12 and "H100" in source and "bf16" in source
    peak, source = device_peak_flops(torch.device("cpu"), torch.float32)
    assert 1e8 < peak < 1e14 and "measured" in source


def test_the_log_metrics_and_tensorboard_show_mfu_and_peak_memory(corpus, tmp_path, capfd):
    out = tmp_path / "run"
    assert main(["train", *tiny_args(corpus, out), "--parallel.tp=2", "--train.peak_tflops=0.001"]) == 0
    log = capfd.readouterr().out
    assert "[taco] MFU against 0.001 TFLOP/s per device (train.peak_tflops)" in log, log
    lines = [x for x in log.splitlines() if " step " in x]
    assert lines and all(re.search(r" mfu \d+\.\d\d% mem \d+\.\d\d GiB ", x) for x in lines), lines
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        assert 0 < r["mfu"] < 10 and 0.05 < r["peak_mem_gib"] < 64, r
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(out / "tb"))
    tb.Reload()
    assert {"mfu", "peak_mem_gib"} <= set(tb.Tags()["scalars"])
