#!/usr/bin/env bash
# GPU check of taco.kernels (issue #6), one script, < 8 minutes on one H200:
#   1. the kernel tests on CUDA (Triton compiled for the GPU, not interpreted);
#   2. throughput of the fused Triton encode / decode / decode-sum-encode (N=4) for the taco and
#      int8-hadamard codecs on bf16 messages of 16, 64 and 256 MiB, each as a fraction of a
#      device-to-device copy of the same message in the same run (time ratio and bandwidth ratio);
#   3. a tile-size sweep (TACO_TRITON_TILE) at 64 MiB, to tune the default.
# It installs nothing: torch and triton are expected on the machine; the repo is put on PYTHONPATH.
#
# Usage: bash benchmarks/gpu_check.sh             # on a CUDA machine
#        bash benchmarks/gpu_check.sh --dry-run   # anywhere: CPU, tiny sizes, Triton interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DRY

if [[ $DRY == 0 ]]; then
  export TRITON_INTERPRET=0  # tests/conftest.py would otherwise turn the interpreter on
  python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: use --dry-run')"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "== kernel tests on CUDA"
  timeout 360 python -m pytest -q -p no:cacheprovider -rs tests/test_kernels.py
else
  export TRITON_INTERPRET=1
  echo "== dry run: interpreter tests"
  timeout 300 python -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "triton or decode_sum_encode"
fi

echo "== throughput (fraction of a device-to-device copy of the same bf16 message)"
timeout 240 python - <<'PY'
import os

import torch

import taco
import taco.kernels as K

dry = os.environ["DRY"] == "1"
dev = torch.device("cpu" if dry else "cuda")
sizes_mib = [1 / 64] if dry else [16, 64, 256]
reps = 2 if dry else 20


def timed(fn) -> float:
    """Mean seconds per call after a warm-up (CUDA events on the GPU)."""
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    import time

    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def row(name: str, mib: float) -> None:
    c = taco.get_codec(name, backend="triton")
    assert K._path(c, dev) == "triton", "the Triton kernels are not the path in use"
    n = int(mib * 2**20) // 2  # bf16 elements
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    buf = torch.empty(c.nbytes(n), dtype=torch.uint8, device=dev)
    t_copy = timed(lambda: y.copy_(x))
    t_enc = timed(lambda: K.encode_into(c, x, buf))
    t_dec = timed(lambda: K.decode_from(c, buf, n, torch.bfloat16))
    m = n // 4  # all-reduce middle step with N = 4 ranks: 4 chunks of n/4 elements
    bufs = torch.cat([c.encode(x[k * m : (k + 1) * m]).data for k in range(4)])
    out = torch.empty(c.nbytes(m), dtype=torch.uint8, device=dev)
    t_dse = timed(lambda: K.decode_sum_encode(c, bufs, m, out=out))
    copy_bw = 4 * n / t_copy  # bytes read + written by the copy, per second
    moved = {"encode": 2 * n + buf.numel(), "decode": buf.numel() + 2 * n, "dse(N=4)": bufs.numel() + out.numel()}
    times = {"encode": t_enc, "decode": t_dec, "dse(N=4)": t_dse}
    cells = [f"{op} {t_copy / t:5.2f}x-time {moved[op] / t / copy_bw:5.2f}x-bw" for op, t in times.items()]
    print(f"{name:14s} {mib:7.3f} MiB  copy {copy_bw / 1e9:8.1f} GB/s  " + "  ".join(cells), flush=True)


def code_agreement(name: str) -> None:
    n = 1 << 23 if not dry else 4096
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    a = taco.get_codec(name, backend="eager").encode(x).data
    b = taco.get_codec(name, backend="triton").encode(x).data
    p = n  # payload bytes (8-bit codes)
    print(f"{name:14s} codes differing from the eager reference: {(a[:p] != b[:p]).float().mean().item():.2e}")


for name in ("taco", "int8-hadamard"):
    code_agreement(name)
for name in ("taco", "int8-hadamard"):
    for mib in sizes_mib:
        row(name, mib)

if not dry:
    print("== tile sweep at 64 MiB (TACO_TRITON_TILE = elements per tile)")
    for tile in ("2048", "4096", "8192", "16384"):
        os.environ["TACO_TRITON_TILE"] = tile
        print(f"tile {tile}:", end=" ")
        row("taco", 64)
PY
echo "== gpu_check done"
