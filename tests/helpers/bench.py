"""Shared pieces of the benchmark tests: a tiny `taco bench codec` run read back as JSON, and the
cluster records and link calibrations of the cluster sweep."""

from __future__ import annotations

import json

from taco.cli import main


def run_bench(name: str, argv: list[str]) -> int:
    """`taco bench NAME ARGV` (= `python -m taco.bench.NAME ARGV`): its exit status."""
    return main(["bench", name, *argv])


def run_json(tmp_path, *extra: str) -> dict:
    path = tmp_path / "out.json"
    assert run_bench("codec", [*TINY, *extra, "--json", str(path)]) == 0
    return json.loads(path.read_text())


CALIB_UNCAPPED = dict(alpha_s=1e-4, beta_bytes_per_s=1e9)


CALIB_50 = dict(alpha_s=1e-3, beta_bytes_per_s=6e6)


def rec(mode: str, codec: str, rate: float | None, step_s: float, comm_s: float, fwd: int, bwd: int) -> dict:
    """A fake rank-0 record: 4 steps, two TP sites (one all-reduce each per step)."""
    wire_scale = 1.0625 / fwd if codec != "none" else 1.0
    raw = NUMEL * (fwd + bwd)
    bump = 0.001 if codec != "none" else 0.0
    steps = [dict(step_s=step_s, loss=5.0 - 0.1 * i + bump, raw_bytes=raw, wire_bytes=raw * wire_scale,
                  comm_s=comm_s, encode_s=0.0, decode_s=0.0) for i in range(4)]  # fmt: skip
    sites = {
        "layers.0.attn.out.fwd": dict(calls=4, raw_bytes=4 * NUMEL * fwd, wire_bytes=0),
        "layers.0.attn.qkv.bwd": dict(calls=4, raw_bytes=4 * NUMEL * bwd, wire_bytes=0),
    }
    val = 4.0 if codec == "none" else 4.004
    return dict(mode=mode, codec=codec, rate_mbit=rate, world=2, steps=steps, sites=sites, val_loss=val)


TINY = ["--size", "4096", "--repeat", "1", "--device", "cpu"]


NUMEL = 2 * 16 * 32  # batch 2, seq 16, hidden 32
