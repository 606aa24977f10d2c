"""benchmarks/gpu_check.sh --dry-run: the prepared GPU check runs end to end on the CPU.

The GPU machine that runs the real check is lent rarely and briefly, so every step of the script
(and of benchmarks/gpu_check.py behind it) is exercised here first: CPU, tiny sizes, Triton
interpreter. The TP=2 trainer step needs two GPUs and is skipped, with its reason, in a dry run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from taco.kernels import triton_available

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
CPU_STEPS = [
    "setup", "codec-check", "kernel-tests", "codec-bandwidth", "host-overhead", "allreduce-replay",
    "comm-loopback", "train-data", "train", "recompute", "peer-step",
]  # fmt: skip
MEGATRON = all(importlib.util.find_spec(m) is not None for m in ("megatron", "megatron.core"))


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash")
@pytest.mark.skipif(not triton_available(), reason="needs triton (the gpu extra): it times Triton kernels")
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["GPU_CHECK_SLACK"] = "3"  # the wiring is under test, not the speed of a possibly loaded CPU
    p = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = p.stdout
    assert "=== summary (dry-run" in out, out[-3000:] + p.stderr[-2000:]
    table = out[out.index("=== summary") :].splitlines()
    assert table[1].split()[:4] == ["step", "status", "seconds", "compiles"]
    assert table[-2].startswith("Triton compiles in all: 0"), table  # the interpreter compiles nothing

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["mode"] == "dry-run" and summary["compiles"] == 0
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == [*CPU_STEPS, "train-tp2", "train-overlap"]
    for name, s in steps.items():
        row = next((line for line in table if line.startswith(name + " ")), None)
        assert row is not None and s["status"].split()[0] in row, (name, table)
    for name in CPU_STEPS:
        step_log = (tmp_path / "steps" / f"{name}.log").read_text()
        if name == "peer-step" and not MEGATRON:
            assert "megatron-core is not importable" in steps[name]["status"], steps[name]
            continue
        assert steps[name]["status"] == "ok", (name, steps[name], step_log[-3000:])
    assert "match eager" in steps["codec-check"]["key"]
    assert "x copy time at" in steps["codec-bandwidth"]["key"]
    assert "fused" in steps["allreduce-replay"]["key"]
    assert "passed" in steps["comm-loopback"]["key"]
    assert "params on cpu" in steps["train"]["key"]
    assert (tmp_path / "train" / "metrics.jsonl").is_file()
    assert "full: saved/plan 1.000" in steps["recompute"]["key"], steps["recompute"]  # exact on the CPU
    if MEGATRON:
        assert "speedup over megatron-core" in steps["peer-step"]["key"], steps["peer-step"]
    assert steps["train-tp2"]["status"].startswith("skipped") and "needs two" in steps["train-tp2"]["status"]
    assert steps["train-overlap"]["status"] == "ok" and "TP=2 int6-hadamard" in steps["train-overlap"]["key"]
    assert p.returncode == 0
