"""Activation recompute on one device against `taco plan`: memory per mode, measured and planned.

    python benchmarks/gpu_recompute_check.py --device cuda [--data-arg=--data.path=... ...]

One process, one rank (world 1). Per `train.recompute` mode, a GPT of the demo's family at a size
where activations dominate (8 layers, hidden 512, 512-token sequences, micro-batch 8, bf16) trains
3 steps from the same seed; step 3 is measured. Printed per mode: the bytes kept for backward
(saved-tensor hooks, `taco.parallel.recompute.SavedBytes`) against the plan's activations, and on
CUDA the step's peak `torch.cuda.max_memory_allocated` against the plan's total (parameters,
gradients, AdamW state, activations, buffers), the step time, and whether the losses equal the
"none" run's bit for bit. Exit 1 if a run fails or the losses differ; the ratios are reported,
not judged (a KEY line each, for the summary of gpu_check.sh).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from taco.parallel.recompute import SavedBytes
from taco.train import plan as P
from taco.train.build import build_run
from taco.train.config import load_config
from taco.train.data import resolve_data_dir
from taco.train.procs import free_port

SHAPE = ["--model.n_layer=8", "--model.hidden=512", "--model.n_head=8", "--model.seq_len=512",
         "--train.batch_size=8", "--train.dtype=bf16", "--parallel.tp=1", "--train.steps=3"]  # fmt: skip


SMALL = ["--model.hidden=128", "--model.seq_len=128", "--train.batch_size=4"]
"""--dry-run: a shape the CPU runs in seconds"""


def one(mode: str, device: str, extra: list[str]) -> dict:
    over = [*SHAPE, *extra, f"--train.recompute={mode}", f"--train.device={device}"]
    cfg = load_config("configs/demo.toml", over)
    tr = build_run(cfg, cfg.parallel.dims().build(), resolve_data_dir(cfg.data), device=device)
    sh = P.build_shapes(cfg, tr.train_ds.vocab_size)
    losses = [tr.step().loss for _ in range(2)]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with SavedBytes(tr.stage) as saved:
        losses.append(tr.step().loss)
    seconds = time.perf_counter() - t0
    mem = P.memory(cfg, sh)[0]
    return {
        "losses": losses, "saved": saved.bytes, "plan_act": mem.activations[mode],
        "plan_total": mem.total(mode), "peak": torch.cuda.max_memory_allocated() if cuda else 0,
        "seconds": seconds,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data-arg", action="append", default=[], help="a --data.* override (repeatable)")
    ap.add_argument("--dry-run", action="store_true", help="a small shape (CPU check of the script)")
    args = ap.parse_args(argv)
    extra = [*(SMALL if args.dry_run else []), *args.data_arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        res = {m: one(m, args.device, extra) for m in P.MODES}
    finally:
        dist.destroy_process_group()
    gib, ok = 2**30, True
    print(f"{'mode':<10} {'saved GiB':>9} {'plan act':>9} {'ratio':>6} {'peak GiB':>9} {'plan total':>10} "
          f"{'ratio':>6} {'step s':>7} losses")  # fmt: skip
    for mode, r in res.items():
        same = r["losses"] == res["none"]["losses"]
        ok &= same
        peak = r["peak"] / gib
        ratio = f"{r['peak'] / r['plan_total']:6.2f}" if r["peak"] else f"{'-':>6}"
        print(f"{mode:<10} {r['saved'] / gib:9.3f} {r['plan_act'] / gib:9.3f} "
              f"{r['saved'] / r['plan_act']:6.3f} {peak:9.3f} {r['plan_total'] / gib:10.3f} {ratio} "
              f"{r['seconds']:7.3f} "
              f"{'bit-identical' if same else 'DIFFER'}")  # fmt: skip
        print(f"KEY {mode}: saved/plan {r['saved'] / r['plan_act']:.3f}"
              + (f", peak/plan {r['peak'] / r['plan_total']:.2f}" if r["peak"] else ""))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
