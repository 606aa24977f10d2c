"""Compile every shipped Triton kernel variant ahead of time for a GPU architecture, without a GPU,
and print what each one holds: registers, spill bytes, shared memory, compile time.

Why: registers decide how many programs an SM runs at once (sm_90: 65536 per SM, so at most 168
per thread for three CTAs of 128 threads), and a kernel that spills to local memory adds traffic
to a memory-bound pass; both are fixed at compile time, so they are checked here on any machine
(triton bundles ptxas). The variants are not listed by hand: the host side of the Triton backend
(`taco.kernels.triton_taco._Spec`) is run on CPU tensors with its kernels replaced by recorders,
and every launch it makes (the codecs gpu_check times, plus taco at every group size; encode from
bf16 and fp32, decode to bf16 and fp32, decode-sum-encode of the two-shot all-reduce, decode-sum
of the gather all-reduce and reduce-scatter) is bound exactly as `JITFunction.run` binds it (the
same specialization and options, so the same cache key as a launch on the GPU), then compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", ARCH, 32))` into a fresh cache. The
resources are ptxas's own report (`-v`).

Usage:
    python benchmarks/kernel_resources.py --arch sm_90 [--jobs 2] [--only taco] [--json PATH]
Last line: "K kernels, max R registers, S bytes spilled". Exit status 1 if a kernel spills or
uses more than --max-registers (default 168).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if __name__ == "__main__":  # before triton is imported (importing this module changes nothing)
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, never interpret
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="taco-kernel-resources-")  # a cold cache
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

KERNELS = ("_encode_kernel", "_decode_kernel", "_decode_sum_encode_kernel")
EXTRA = ("taco(group_size=32)", "taco(group_size=256)", "taco(group_size=512)", "taco(fmt=e5m2)",
         "int4-hadamard(scale_search=absmax)")  # fmt: skip
"""Beside the codecs gpu_check times: taco at the other group sizes and E5M2, and int4-hadamard with
absmax scales (its default least-squares search has no Triton kernel)."""


def _codecs(only: str | None) -> list:
    """The codecs gpu_check times (`gpu_common.triton_codecs`: every codec the Triton kernels serve on
    a CUDA device, default options, and the extra specs), then `EXTRA`."""
    import taco
    from benchmarks.gpu_common import EXTRA_SPECS
    from taco.codec import accepted_options
    from taco.codec.specs import parse_spec
    from taco.kernels import triton_taco as tt

    extra = [parse_spec(s) for s in EXTRA_SPECS]
    out = []
    for name in taco.list_codecs():
        opts = accepted_options(name, {"backend": "triton"})
        if opts:
            out += [taco.get_codec(name, **opts, **o) for o in [{}] + [o for n, o in extra if n == name]]
    for spec in EXTRA:
        name, opts = parse_spec(spec)
        out.append(taco.get_codec(name, **opts, backend="triton"))
    cuda = torch.device("cuda")  # a device type only: nothing runs on it
    return [c for c in out if tt.supports(c, cuda) and (only is None or only in c.spec)]


def record(only: str | None = None) -> list[tuple[str, str, str, tuple, dict]]:
    """Every distinct launch of the Triton backend's host side for the shipped variants:
    (label, kernel name, cache key, args, kwargs), CPU tensors standing for the GPU's."""
    from unittest import mock

    from taco.kernels import triton_taco as tt

    seen: dict[str, tuple] = {}
    label = [""]

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name, self.fn = name, getattr(tt, name)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                key = cache_key(self.fn, args, kwargs)
                seen.setdefault(key, (label[0], self.name, key, args, kwargs))

            return launch

    n, own_n = 4 * 4096, 4096
    with contextlib.ExitStack() as stack:
        for name in KERNELS:
            stack.enter_context(mock.patch.object(tt, name, Recorder(name)))
        backend = tt.TritonBackend()
        for codec in _codecs(only):
            nb = codec.nbytes(own_n)
            buf = torch.zeros(4 * (nb + 16), dtype=torch.uint8)
            for dtype in (torch.bfloat16, torch.float32):
                d = "bf16" if dtype == torch.bfloat16 else "fp32"
                x = torch.zeros(n, dtype=dtype)
                label[0] = f"{codec.spec} encode {d}"
                backend.encode(codec, x[:own_n], buf[:nb])
                label[0] = f"{codec.spec} decode {d}"
                backend.decode(codec, buf[:nb], x[:own_n])
            own, stride = torch.zeros(own_n, dtype=torch.bfloat16), -(-nb // 16) * 16
            label[0] = f"{codec.spec} decode-sum-encode (two-shot)"
            out = torch.zeros(nb, dtype=torch.uint8)
            backend.decode_sum_encode(codec, buf, stride, 3, own_n, own, 1, out, None)
            label[0] = f"{codec.spec} decode-sum (reduce-scatter)"
            backend.decode_sum_encode(codec, buf, stride, 3, own_n, own, 1, None, own.clone())
            label[0] = f"{codec.spec} decode-sum (gather)"
            backend.decode_sum_encode(codec, buf, stride, 4, own_n, None, 0, None, own.clone())
    return list(seen.values())


def _binder(fn):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", ARCH[0], 32)
    backend = make_backend(target)
    return target, backend, create_function_from_signature(fn.signature, fn.params, backend)


ARCH = [90]


def cache_key(fn, args, kwargs) -> str:
    """The key `JITFunction.run` files this launch's compiled kernel under (one key, one compile)."""
    from triton.runtime.jit import compute_cache_key

    _, backend, binder = _binder(fn)
    _, specialization, options = binder(*args, **kwargs)
    return f"{fn.__name__}:{compute_cache_key({}, specialization, options)}"


def compile_one(item) -> dict:
    """Compile one recorded launch as the GPU would; ptxas's report of it."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    label, name, _, args, kwargs = item
    from taco.kernels import triton_taco as tt

    fn = getattr(tt, name)
    target, backend, binder = _binder(fn)
    bound, specialization, options = binder(*args, **kwargs)
    opts, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(log):
        src = ASTSource(fn, signature, constexprs, attrs)
        kernel = triton.compile(src, target=target, options=opts.__dict__)
    secs = time.perf_counter() - t0
    text = log.getvalue()
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    return {
        "variant": label,
        "kernel": name,
        "num_warps": opts.num_warps,
        "num_stages": opts.num_stages,
        "registers": int(regs.group(1)) if regs else -1,
        "spill_stores": int(spill.group(1)) if spill else -1,
        "spill_loads": int(spill.group(2)) if spill else -1,
        "stack": int(stack.group(1)) if stack else -1,
        "shared": int(kernel.metadata.shared),
        "compile_s": round(secs, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90", help="sm_XY (default sm_90)")
    ap.add_argument("--jobs", type=int, default=2, help="compiles in parallel")
    ap.add_argument("--only", default=None, help="only codecs whose spec contains this")
    ap.add_argument("--max-registers", type=int, default=168)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    ARCH[0] = int(a.arch.removeprefix("sm_"))
    items = record(a.only)
    print(f"{len(items)} distinct kernel variants, compiling for {a.arch} ({a.jobs} jobs)", flush=True)
    with ProcessPoolExecutor(a.jobs, initializer=ARCH.__setitem__, initargs=(0, ARCH[0])) as pool:
        rows = list(pool.map(compile_one, items))
    head = ("variant", "kernel", "warps", "stages", "regs", "spill", "smem", "s")
    print("{:58} {:26} {:>5} {:>6} {:>4} {:>5} {:>6} {:>5}".format(*head))
    for r in rows:
        spill = r["spill_stores"] + r["spill_loads"]
        print(
            f"{r['variant'][:58]:58} {r['kernel']:26} {r['num_warps']:5} {r['num_stages']:6} "
            f"{r['registers']:4} {spill:5} {r['shared']:6} {r['compile_s']:5.1f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    top = max(r["registers"] for r in rows)
    spilled = sum(r["spill_stores"] + r["spill_loads"] for r in rows)
    print(f"{len(rows)} kernels, max {top} registers, {spilled} bytes spilled")
    bad = any(r["registers"] < 0 for r in rows)
    return 1 if bad or spilled or top > a.max_registers else 0


if __name__ == "__main__":
    raise SystemExit(main())
