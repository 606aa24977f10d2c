"""Activation recompute on the demo model: bytes kept for backward, step time and losses per mode.

    PYTHONPATH=$PWD python benchmarks/recompute_bench.py --n-layer 8 --steps 6 --rounds 3

Two gloo ranks (TP=2, configs/demo.toml, n_layer from the command line). Per codec (none, taco) and
round, the modes run one after another from the same seed: `train.recompute` = none, full,
selective. Per mode: the bytes kept for backward in the first step (`SavedBytes`: saved-tensor
hooks, once per storage, parameters excluded, plus what a checkpointed block holds), for the
whole model and for the transformer blocks alone (the difference between n_layer and n_layer / 2
layers, scaled to n_layer: what the embedding, head and loss keep cancels), the per-step losses
(compared bit for bit with "none"), the TP bytes recompute re-sent per step, and the median step
time after the first step, wall clock and process CPU time (on a shared machine CPU time is the
steadier measure of the work recompute adds). Ratios to "none" are paired per round; their 95%
intervals are Student's t over rounds.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from taco.bench.cluster_noise import t95
from taco.parallel.recompute import SavedBytes
from taco.train.build import build_run
from taco.train.config import load_config
from taco.train.data import resolve_data_dir
from taco.train.procs import free_port

MODES = ("none", "full", "selective")


def _one(args: argparse.Namespace, codec: str, mode: str, n_layer: int) -> dict:
    cfg = load_config(
        "configs/demo.toml",
        [f"--model.n_layer={n_layer}", f"--compression.tp_codec={codec}", f"--train.recompute={mode}",
         f"--train.steps={args.steps}", "--train.out_dir=/tmp/taco-recompute-bench"],
    )  # fmt: skip
    tr = build_run(cfg, cfg.parallel.dims().build(), resolve_data_dir(cfg.data), device="cpu")
    losses, times, cpu, saved, again = [], [], [], 0, 0.0
    for i in range(args.steps):
        if i == 0:
            with SavedBytes(tr.stage) as c:
                st = tr.step()
            saved = c.bytes
        else:
            c0 = time.process_time()
            st = tr.step()
            cpu.append(time.process_time() - c0)
            times.append(st.seconds)
        losses.append(st.loss)
        again += st.wire_bytes["tp_recompute"]
    return {"losses": losses, "step_s": statistics.median(times), "cpu_s": statistics.median(cpu),
            "saved": saved, "recompute_wire": again / args.steps}  # fmt: skip


def _body(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    res: dict = {}
    for codec in args.codecs:
        blocks = {m: _one(args, codec, m, args.n_layer // 2)["saved"] for m in MODES}  # for the blocks' share
        for _ in range(args.rounds):
            for mode in MODES:
                res.setdefault((codec, mode), []).append(_one(args, codec, mode, args.n_layer))
        for mode in MODES:
            res[(codec, mode, "half")] = blocks[mode]
    if rank == 0:
        out.update(res)
    dist.destroy_process_group()


def _ratio(runs: list, base: list, key: str) -> str:
    """Mean paired ratio to the baseline with its Student-t 95% interval over rounds."""
    logs = [math.log(r[key] / b[key]) for r, b in zip(runs, base)]
    mean = statistics.fmean(logs)
    hw = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
    return f"{math.exp(mean):.2f}x [{math.exp(mean - hw):.2f}, {math.exp(mean + hw):.2f}]"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--codecs", default="none,taco")
    args = ap.parse_args(argv)
    args.codecs = args.codecs.split(",")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_body, args=(2, free_port(), args, out), nprocs=2, join=True)
        res = dict(out)
    n, half = args.n_layer, args.n_layer // 2
    print(f"demo model, n_layer={n}, TP=2 (gloo, CPU), {args.steps} steps x {args.rounds} rounds")
    print(f"{'codec':<6} {'mode':<10} {'saved MiB':>9} {'vs none':>8} {'blocks MiB':>10} {'vs none':>8} "
          f"{'wall s':>7} {'wall vs none (95% CI)':>24} {'CPU vs none (95% CI)':>24} "
          f"{'recompute TP MiB/step':>22} losses")  # fmt: skip
    for codec in args.codecs:
        base = res[(codec, "none")]
        blocks = {m: (res[(codec, m)][0]["saved"] - res[(codec, m, "half")]) * n / (n - half) for m in MODES}
        for mode in MODES:
            runs = res[(codec, mode)]
            same = all(r["losses"] == base[0]["losses"] for r in runs)
            saved = runs[0]["saved"]
            print(f"{codec:<6} {mode:<10} {saved / 2**20:>9.2f} {base[0]['saved'] / saved:>7.2f}x "
                  f"{blocks[mode] / 2**20:>10.2f} {blocks['none'] / blocks[mode]:>7.2f}x "
                  f"{statistics.median(r['step_s'] for r in runs):>7.3f} {_ratio(runs, base, 'step_s'):>24} "
                  f"{_ratio(runs, base, 'cpu_s'):>24} {runs[0]['recompute_wire'] / 2**20:>22.2f} "
                  f"{'bit-identical' if same else 'DIFFER'}")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
