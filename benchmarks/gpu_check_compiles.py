"""Count the Triton kernels benchmarks/gpu_check.sh compiles on a GPU, without a GPU.

Triton compiles a kernel once per cache key: the kernel, its constexprs, its options, the types of its
arguments and what it specializes them on (integers equal to 1 or divisible by 16, pointers aligned
to 16 bytes). Message sizes, offsets and strides are not specialized on (`do_not_specialize` in
`taco/kernels/triton_taco.py`), so the count is that of (codec, operation, dtypes) combinations the
script runs. Here every step that launches Triton kernels on the GPU is replayed on the CPU under the
interpreter (`TRITON_INTERPRET=1`, tiny sizes), and each launch is filed under the key it would have
on the GPU (`kernel_resources.cache_key`, the binding of `JITFunction.run`); the number of distinct
keys is the number of compiles a cold cache makes. What is replayed, step by step:
- codec-check: `gpu_codec_check.check_codec` of every codec the step checks;
- kernel-tests: the calls of tests/kernels/test_kernels.py's CUDA tests (their parameters read from their
  marks: encode and decode per codec and dtype, decode-sum-encode with a bf16 own term, round trips);
- codec-bandwidth, host-overhead, allreduce-replay: `gpu_check.py`'s commands with every codec;
- comm-loopback: tests/comm/test_comm_loopback.py's collectives with the Triton backend;
- train, train-tp2: the demo config's TP codec on its collectives (all-reduce two-shot and gather,
  reduce-scatter, all-gather) in bf16.

Usage: PYTHONPATH=$PWD python benchmarks/gpu_check_compiles.py [--budget 40]
Prints the distinct keys per step (new ones, and the running total); last line
"gpu_check compiles: K distinct kernels (budget B)". Exit status 1 above the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from pathlib import Path
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run everything on the CPU
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import torch  # noqa: E402

KERNELS = ("_encode_kernel", "_decode_kernel", "_decode_sum_encode_kernel")


class _Filing:
    """Stands for one kernel: `kernel[grid](...)` files the launch's GPU cache key, then launches."""

    def __init__(self, real, keys: Keys) -> None:
        from triton.runtime.jit import JITFunction

        self.real, self.keys = real, keys
        self.jit = JITFunction(real.fn, **real.kwargs)  # the GPU's binding of the same function

    def __getitem__(self, grid):
        from kernel_resources import cache_key

        def launch(*args, **kwargs):
            self.keys.keys.setdefault(cache_key(self.jit, args, kwargs), self.keys.step)
            return self.real[grid](*args, **kwargs)

        return launch


class Keys:
    """Wraps the three kernels for its lifetime; `keys`: GPU cache key -> the step that first used it."""

    def __init__(self) -> None:
        from taco.kernels import triton_taco as tt

        self.keys: dict[str, str] = {}
        self.step = ""
        self._stack = contextlib.ExitStack()
        for name in KERNELS:
            self._stack.enter_context(mock.patch.object(tt, name, _Filing(getattr(tt, name), self)))

    def close(self) -> None:
        self._stack.close()


def _quiet(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def codec_check(codecs) -> None:
    from gpu_codec_check import check_codec

    for c in codecs:
        spec, lines, ok = _quiet(check_codec, c.spec, "cpu", 4096 + 77)
        if not ok:  # the replay also checks: a kernel that disagrees with eager is reported
            print(f"codec-check {spec}: FAILED\n" + "\n".join(lines))


def kernel_tests() -> None:
    import taco
    import tests.kernels.test_kernels as tk

    def params(test, arg):
        for m in test.pytestmark:
            if m.name == "parametrize" and m.args[0] == arg:
                return m.args[1]
        raise LookupError(arg)

    test = tk.test_cuda_triton_matches_eager
    for name in params(test, "name"):
        for dtype in params(test, "dtype"):
            c = taco.get_codec(name, backend="triton")
            p = taco.get_codec(name, backend="eager").encode(torch.randn(1000).to(dtype))
            c.encode(torch.randn(1000).to(dtype))
            c.decode(p)
    for name in params(tk.test_cuda_decode_sum_encode_and_non_finite, "name"):
        c = taco.get_codec(name, backend="triton")
        n = 1000 + 5
        bufs = torch.cat([c.encode(torch.randn(n)).data for _ in range(4)])
        tk.dse(c, bufs, n, torch.randn(n, dtype=torch.bfloat16), 1)
        c.roundtrip(torch.randn(1024))


def gpu_check_steps(codecs) -> None:
    import gpu_check
    import gpu_common

    every = lambda device, dry=False: codecs  # noqa: E731 (the GPU run's codec list, not one per family)
    patches = [mock.patch.object(m, "need_codecs", every) for m in (gpu_check, gpu_common)]
    with patches[0], patches[1]:
        for cmd in ("bandwidth", "host", "replay"):
            _quiet(gpu_check.main, [cmd, "--dry-run"])


def loopback() -> None:
    import taco
    import tests.comm.test_comm_loopback as lb
    from taco.codec.specs import parse_spec

    def triton_codec(spec, device):
        name, opts = parse_spec(spec)
        return taco.get_codec(name, **opts, backend="triton"), taco.get_codec(name, **opts, backend="eager")

    with mock.patch.object(lb, "codec_for", triton_codec):
        for spec in lb.SPECS:
            for case in lb.CASES:
                lb.test_loopback_collective_matches_reference("cpu", spec, case)
        lb.test_loopback_back_to_back_calls_reuse_buffers_safely("cpu")


def train(codec_spec: str) -> None:
    import taco
    import tests.comm.test_comm_loopback as lb
    from taco.codec.specs import parse_spec

    name, opts = parse_spec(codec_spec)
    codec = taco.get_codec(name, **opts, backend="triton")
    x = torch.randn(8, 64, 128).to(torch.bfloat16)
    for op, world, kw in (("all_reduce", 2, {"algo": "gather"}), ("all_reduce", 4, {"algo": "two_shot"}),
                          ("reduce_scatter", 2, {"dim": 0}), ("all_gather", 2, {"dim": 0})):  # fmt: skip
        lb.run_op(op, x, codec, world, 0, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=40)
    a = ap.parse_args()
    torch.manual_seed(0)
    from gpu_common import triton_codecs

    codecs = triton_codecs(torch.device("cpu"))
    keys = Keys()
    steps = [
        ("codec-check", lambda: codec_check(codecs)),
        ("kernel-tests", kernel_tests),
        ("bandwidth/host/replay", lambda: gpu_check_steps(codecs)),
        ("comm-loopback", loopback),
        ("train", lambda: train("taco")),
    ]
    try:
        for step, run in steps:
            keys.step = step
            before = len(keys.keys)
            run()
            print(f"{step:22} {len(keys.keys) - before:3} new kernels, {len(keys.keys):3} in all", flush=True)
    finally:
        keys.close()
    total = len(keys.keys)
    by_kernel = {k: sum(key.startswith(k + ":") for key in keys.keys) for k in KERNELS}
    print("per kernel: " + ", ".join(f"{k} {v}" for k, v in by_kernel.items()))
    print(f"gpu_check compiles: {total} distinct kernels (budget {a.budget})")
    return 0 if total <= a.budget else 1


if __name__ == "__main__":
    raise SystemExit(main())
