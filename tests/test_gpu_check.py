"""benchmarks/gpu_check.sh --dry-run (issue 11): the prepared GPU check runs end to end on the CPU.

The GPU machine that runs the real check is lent rarely and briefly, so every step of the script
(and of benchmarks/gpu_check.py behind it) is exercised here first: CPU, tiny sizes, Triton
interpreter. The train step needs the `train.device` config key, which a parallel branch adds: it is
asserted `ok` only when that key exists, and otherwise to fail visibly, naming the missing key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from taco.train.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
CPU_STEPS = ["setup", "kernel-tests", "codec-bandwidth", "host-overhead", "allreduce-replay", "train-data"]


def has_train_device() -> bool:
    return "device" in {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash")
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    p = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = p.stdout
    assert "=== summary (dry-run" in out, out[-3000:] + p.stderr[-2000:]
    table = out[out.index("=== summary") :].splitlines()
    assert table[1].split()[:3] == ["step", "status", "seconds"]

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mode"] == "dry-run"
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == [*CPU_STEPS, "train"]
    for name, s in steps.items():
        row = next((line for line in table if line.startswith(name + " ")), None)
        assert row is not None and s["status"].split()[0] in row, (name, table)
    log = (tmp_path / "gpu_check.log").read_text()
    for name in CPU_STEPS:
        step_log = (tmp_path / "steps" / f"{name}.log").read_text()
        assert steps[name]["status"] == "ok", (name, steps[name], step_log[-3000:])
    assert "x copy time at" in steps["codec-bandwidth"]["key"]
    assert "fused" in steps["allreduce-replay"]["key"]
    assert "=== [train]" in log

    train = steps["train"]
    if has_train_device():
        assert train["status"] == "ok", (train, (tmp_path / "steps" / "train.log").read_text()[-3000:])
        assert "params on cpu" in train["key"]
        assert (tmp_path / "train" / "metrics.jsonl").is_file()
    else:  # the key comes from a parallel branch: until then the step fails, and says why
        assert train["status"].startswith("FAILED"), train
        assert "train.device" in train["key"], train
    failed = [s for s in steps.values() if s["status"].startswith("FAILED")]
    assert p.returncode == (1 if failed else 0)
