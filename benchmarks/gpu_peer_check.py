"""The project's uncompressed training step against Megatron-Core's TP layers on one device.

    python benchmarks/gpu_peer_check.py --device cuda [--data-arg=--data.path=... ...] [--dry-run]

One process, one rank (world 1, tp = 1): configs/cluster.toml's model (GPT, 4 layers, hidden 128,
16 x 128 tokens, bf16 parameters with fp32 masters in AdamW) trained by the project's trainer
(`taco.train.trainer.Trainer`, codec none) and by the Megatron-Core peer of `taco bench cluster
--peers` (`taco.bench.peers`: ColumnParallelLinear / RowParallelLinear, a fused q/k/v,
VocabParallelEmbedding, vocab_parallel_cross_entropy), in alternating rounds (A B B A), each round
a fresh run from the same seed. A step is timed as the bench times it: learning rate, forward,
backward, gradient norm and clipping, optimizer, one host read of the loss (which waits for the
device). Printed: the mean step time of the steps after the warm-up per run and round, and the
ratio project / megatron-core with the paired rounds' 95% interval (`cluster_noise.ratio_interval`);
a KEY line for gpu_check.sh's summary. The ratio is reported, not judged. Without megatron-core
this says so and exits 77 (skipped).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from taco.bench.cluster_noise import ratio_interval
from taco.train.config import load_config
from taco.train.data import resolve_data_dir
from taco.train.procs import free_port

SHAPE = ["--parallel.tp=1", "--train.dtype=bf16", "--compression.tp_codec=none", "--train.eval_steps=1",
         "--train.eval_interval=0", "--compression.telemetry_every=0"]  # fmt: skip
SMALL = ["--model.n_layer=2", "--model.hidden=64", "--model.seq_len=32", "--train.batch_size=2"]
"""--dry-run: a shape the CPU runs in seconds"""


def project(cfg, data_dir, device: str) -> list[float]:
    """Step seconds of the project's trainer (codec none) for `cfg`."""
    from taco.train.build import build_run

    run = build_run(cfg, cfg.parallel.dims().build(), data_dir, device=device)
    return [run.step().seconds for _ in range(cfg.train.steps)]


def megatron(cfg, data_dir, device: str) -> list[float]:
    """Step seconds of the Megatron-Core peer for `cfg`."""
    from taco.bench.peers import train_peer

    return [s["step_s"] for s in train_peer("megatron", cfg, data_dir, device)["steps"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data-arg", action="append", default=[], help="a --data.* override (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="small and short (a CPU check)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (30; dry run 4)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (5; dry run 1)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of (project, megatron-core), alternating")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        print("KEY megatron-core is not importable here: the peer step comparison is skipped")
        return 77
    steps = args.steps or (4 if args.dry_run else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 5)
    over = [*SHAPE, *(SMALL if args.dry_run else []), *args.data_arg, f"--train.steps={steps}",
            f"--train.device={args.device}"]  # fmt: skip
    cfg = load_config("configs/cluster.toml", over)
    data_dir = resolve_data_dir(cfg.data)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    runs = {"taco none": project, "megatron-core": megatron}
    means: dict[str, list[float]] = {name: [] for name in runs}
    t0 = time.perf_counter()
    try:
        for i in range(args.rounds):
            for name, fn in list(runs.items())[:: 1 if i % 2 == 0 else -1]:  # A B, B A, ...
                secs = fn(cfg, data_dir, args.device)[warmup:]
                means[name].append(statistics.fmean(secs))
                ms = means[name][-1] * 1e3
                print(f"round {i}: {name:<14} {ms:8.2f} ms/step ({len(secs)} steps)", flush=True)
    finally:
        dist.destroy_process_group()
    mine, peer = (statistics.fmean(means[n]) for n in runs)
    ci = ratio_interval(means["megatron-core"], means["taco none"])
    ci_text = "-" if ci is None else f"{ci[0]:.3f}-{ci[1]:.3f}"
    print(f"{args.device}: taco none {mine * 1e3:.2f} ms/step, megatron-core {peer * 1e3:.2f} ms/step, "
          f"megatron-core / taco = {peer / mine:.3f} (95% CI {ci_text}, {args.rounds} rounds, "
          f"{time.perf_counter() - t0:.0f} s)")  # fmt: skip
    print(f"KEY step ms taco none {mine * 1e3:.2f}, megatron-core {peer * 1e3:.2f}: "
          f"speedup over megatron-core {peer / mine:.3f}x (95% CI {ci_text})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
