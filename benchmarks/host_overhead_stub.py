"""Host time of one compressed all-reduce with the Triton kernels stubbed out (no GPU needed).

Why: on NVLink a 16 MiB all-reduce's kernels and transfers take tens of microseconds of GPU time, so
the Python that issues them (argument checks, slicing, buffers, launches) decides whether the GPU
waits for the host. Here the three Triton kernels are stand-ins that record their launch (kernel,
grid) and return, and the transfers are no-ops, so what is timed is the host work of
`taco.comm.all_reduce` on the Triton backend: CPU tensors, served by the Triton backend as under
`TRITON_INTERPRET=1`, a `CommPolicy` as the trainer makes one (no size check, no phase timing, no
sampled non-finite check: those are off or amortised on CUDA). Triton's own launch cost (its
argument binding, about 10-30 us per launch on a GPU host) is not in the figure; the launch count,
which it multiplies, is printed beside it.

Usage:
    PYTHONPATH=$PWD python benchmarks/host_overhead_stub.py [--mib 16] [--world 8] [--slices 1 4]
        [--codec taco] [--repeats 300]
Prints per slice count: launches per call and per slice, and the host time per call (median and a
95% interval of the median over repeated batches).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from contextlib import ExitStack, contextmanager
from unittest import mock

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors go to Triton

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

KERNELS = ("_encode_kernel", "_decode_kernel", "_decode_sum_encode_kernel")


class StubKernel:
    """Stands for a Triton kernel: `kernel[grid](*args, **meta)` records (name, grid) and returns."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append((self.name, tuple(grid)))

        return launch


class _Done:
    def wait(self) -> bool:
        return True


@contextmanager
def stubbed(world: int, rank: int):
    """Play rank `rank` of `world` with stub kernels and no-op transfers; yields the launch log,
    one (kernel name, grid) per launch."""
    from taco.comm import collectives, compressed
    from taco.kernels import triton_taco

    log: list = []
    done = _Done()
    with ExitStack() as stack:
        for name in KERNELS:
            stack.enter_context(mock.patch.object(triton_taco, name, StubKernel(name, log)))
        stack.enter_context(mock.patch.object(dist, "get_world_size", lambda group=None: world))
        stack.enter_context(mock.patch.object(dist, "get_rank", lambda group=None: rank))
        stack.enter_context(mock.patch.object(dist, "all_to_all_single", lambda *a, **k: done))
        stack.enter_context(mock.patch.object(compressed, "all_gather_into", lambda *a, **k: done))
        stack.enter_context(mock.patch.object(collectives, "all_gather_into", lambda *a, **k: done))
        yield log


def policy(codec: str = "taco"):
    """A policy as the trainer's on CUDA (no size check, no phase timing, no sampled NaN check),
    its codec on the Triton backend."""
    from taco.comm import CommPolicy
    from taco.comm.stats import CommStats

    stats = CommStats(timing=False)
    return CommPolicy(codec, {"backend": "triton"}, check_sizes=False, nonfinite_check_every=0, stats=stats)


def launches(x: torch.Tensor, world: int, rank: int, slices: int, pol) -> list:
    """The launches of one two-shot all-reduce of x as rank `rank` of `world`."""
    import taco.comm as tc

    with stubbed(world, rank) as log:
        tc.all_reduce(x, policy=pol, slices=slices, algo="two_shot", site="bench")
    return log


def time_calls(x: torch.Tensor, world: int, slices: int, pol, repeats: int, batch: int = 10) -> list[float]:
    """Seconds per call, one figure per batch of `batch` back-to-back calls."""
    import taco.comm as tc

    out = []
    with stubbed(world, 0):
        for _ in range(3):  # warm-up: buffers cached, codec spec built
            tc.all_reduce(x, policy=pol, slices=slices, algo="two_shot", site="bench")
        for _ in range(repeats // batch):
            t0 = time.perf_counter()
            for _ in range(batch):
                tc.all_reduce(x, policy=pol, slices=slices, algo="two_shot", site="bench")
            out.append((time.perf_counter() - t0) / batch)
    return out


def median_ci(xs: list[float], rounds: int = 2000) -> tuple[float, float, float]:
    """Median and a 95% bootstrap interval of the median."""
    g = torch.Generator().manual_seed(0)
    t = torch.tensor(xs, dtype=torch.float64)
    idx = torch.randint(len(xs), (rounds, len(xs)), generator=g)
    meds = t[idx].median(dim=1).values.sort().values
    return statistics.median(xs), float(meds[int(0.025 * rounds)]), float(meds[int(0.975 * rounds)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=16.0, help="message size in MiB of bf16")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--slices", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--codec", default="taco")
    ap.add_argument("--repeats", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(1)
    n = int(a.mib * (1 << 20)) // 2
    x = torch.randn(n).bfloat16()
    pol = policy(a.codec)
    print(f"two-shot all-reduce, {a.mib:g} MiB bf16, N={a.world}, codec {pol._default.spec}, stub kernels")
    for s in a.slices:
        log = launches(x, a.world, 0, s, pol)
        per = collections.Counter(name for name, _ in log)
        med, lo, hi = median_ci(time_calls(x, a.world, s, pol, a.repeats))
        k = len(log) / s
        print(
            f"slices={s}: {len(log)} launches ({k:.1f} per slice; {dict(per)}), "
            f"host time per call {med * 1e6:.0f} us (95% CI {lo * 1e6:.0f}-{hi * 1e6:.0f})"
        )


if __name__ == "__main__":
    main()
