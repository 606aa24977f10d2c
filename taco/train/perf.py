"""How hard a run works its devices: model FLOPs utilisation (MFU) and peak memory, for the log.

Why this file exists: tokens/s alone does not say whether a step is slow because the model is big
or because the devices idle (waiting on the link, the codec, the pipeline); MFU does, and peak
memory says how much room is left. Both follow the usual conventions, so they compare with other
trainers' (nanoGPT, torchtitan, the PaLM paper's appendix B):

- training FLOPs per token = 6 N + 12 L d T: N the weights of every matrix multiply (the output
  head included, the embedding lookups not), L layers, d = heads x head size, T the sequence
  length (attention scores and their use, forward and backward); recomputation is not counted;
- MFU = FLOPs per token x tokens per second / (number of devices x peak FLOP/s of one device);
- the peak of one device: `train.peak_tflops` when set; else a table of dense bf16/fp32 peaks of
  common GPUs (the vendors' data sheets, without sparsity); else measured once at start-up, the
  best of a few square matrix multiplies in the training dtype on the rank's device and threads
  (how CPUs get theirs). The source is printed when the run starts;
- peak memory: on CUDA the most the caching allocator held (`torch.cuda.max_memory_reserved`,
  what an out-of-memory error counts against); on a CPU the process's peak resident set.
"""

from __future__ import annotations

import resource
import sys
import time

import torch
from torch import nn

GPU_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    # name fragment (first match wins): (dense bf16, fp32 without TF32) TFLOP/s
    "H100 PCIe": (756.0, 51.2),
    "H100 NVL": (835.0, 60.0),
    "H100": (989.4, 66.9),  # SXM
    "H200": (989.4, 66.9),
    "GH200": (989.4, 66.9),
    "A100": (312.0, 19.5),
    "L40S": (362.1, 91.6),
    "L40": (181.0, 90.5),
    "L4": (121.0, 30.3),
}


def flops_per_token(model: nn.Module, n_layer: int, attn_width: int, seq_len: int) -> float:
    """Training FLOPs per token of the full (unsharded) `model`: 6 N + 12 L d T (module docstring);
    N counts the weight of every nn.Linear, the output head's included (tied or not)."""
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return 6.0 * n + 12.0 * n_layer * attn_width * seq_len


def _measure_peak(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the best of a few n x n matrix multiplies on `device` in `dtype` (start-up only)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3):  # the first one warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / 4)
    if device.type == "cuda":  # the probe's memory is not the run's: give it back, forget its peak
        del a, b
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return 2.0 * n**3 / best


def device_peak_flops(device: torch.device, dtype: torch.dtype, tflops: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device in `dtype`, where that figure comes from) for MFU.

    `tflops` > 0 (`train.peak_tflops`) is taken as given; a GPU of `GPU_PEAK_TFLOPS` gets its data
    sheet's dense figure; anything else is measured (`_measure_peak`)."""
    if tflops > 0:
        return tflops * 1e12, f"{tflops:g} TFLOP/s per device (train.peak_tflops)"
    kind = "bf16" if dtype == torch.bfloat16 else "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for frag, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
            if frag in name:
                peak = bf16 if kind == "bf16" else fp32
                return peak * 1e12, f"{peak:g} TFLOP/s per device ({name}, dense {kind}, data sheet)"
    peak = _measure_peak(device, dtype)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    how = f"measured: best {kind} matmul on {device}{threads}; set train.peak_tflops to use another"
    return peak, f"{peak / 1e12:.3g} TFLOP/s per device ({how})"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank so far: CUDA allocator's reserved peak, or the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux
