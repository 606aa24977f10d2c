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
Prints per slice count: launches per call and per slice, and the host time per call: the thread's
CPU time (the host work; robust to a loaded machine) and the wall time, each the median over the
calls with a 95% bootstrap interval of the median.
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
    from taco.comm import call, compressed
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
        stack.enter_context(mock.patch.object(call, "all_gather_into", lambda *a, **k: done))
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


def time_calls(x: torch.Tensor, world: int, slices: int, pol, repeats: int) -> tuple[list, list]:
    """(thread CPU seconds, wall seconds) of each of `repeats` back-to-back calls. The CPU time is
    the host work itself (on a loaded machine the wall time adds the waits for a core)."""
    import taco.comm as tc

    cpu, wall = [], []
    with stubbed(world, 0):
        for _ in range(5):  # warm-up: buffers cached, codec spec built
            tc.all_reduce(x, policy=pol, slices=slices, algo="two_shot", site="bench")
        for _ in range(repeats):
            c0, w0 = time.thread_time(), time.perf_counter()
            tc.all_reduce(x, policy=pol, slices=slices, algo="two_shot", site="bench")
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
    return cpu, wall


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
        cpu, wall = time_calls(x, a.world, s, pol, a.repeats)
        (c, clo, chi), (w, wlo, whi) = median_ci(cpu), median_ci(wall)
        print(
            f"slices={s}: {len(log)} launches ({len(log) / s:.1f} per slice; {dict(per)}); host time per "
            f"call {c * 1e6:.0f} us CPU (95% CI {clo * 1e6:.0f}-{chi * 1e6:.0f}), "
            f"{w * 1e6:.0f} us wall ({wlo * 1e6:.0f}-{whi * 1e6:.0f})"
        )


if __name__ == "__main__":
    main()
