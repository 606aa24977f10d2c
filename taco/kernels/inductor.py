"""The "inductor" backend: `torch.compile` of the reference group functions (any device).

Why it exists beside the "native" backend: it needs no C compiler of ours and runs
wherever torch.compile does (CPU with a C++ toolchain, CUDA), fusing the reference's
element-wise steps around the Hadamard matmul. Measured on this project's 2-core CPU: ~22 s of
compilation per process and ~2.3x the eager reference, versus ~10x for the native backend, so
it is opt-in (`backend="inductor"`), never the auto choice. One compiled graph per function,
dynamic in the number of groups and the group size.

Graphs per function: one per combination of the arguments torch._dynamo specializes on (the fp8
dtype, rotation or none, one group or several, the device), past which torch._dynamo's
`recompile_limit` (8) would raise `FailOnRecompileLimitHit` (fullgraph=True). The calls run
without autograd (the codecs' outputs never need gradients, and grad mode would double the
graphs), and a call that would exceed the limit runs the eager reference instead: same values,
bit for bit, logged once per function. Calls matching a compiled graph stay compiled.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from taco.codec import functional as Fn
from taco.codec.backend import GroupFnBackend

log = logging.getLogger("taco.kernels")
# Reference functions that have hit the recompile limit (their fallback is logged once).
_FELL_BACK: set[str] = set()


def fit_cpu_codegen_to_aten() -> None:
    """Make inductor's CPU code agree with ATen when `ATEN_CPU_CAPABILITY` forces a capability.

    Forced to its portable kernels (`default`), ATen's headers that inductor compiles against carry
    no `at::vec`, while the code generator still picks the machine's SIMD width: every vectorised
    kernel then fails in g++ ("'at::vec' has not been declared", torch 2.13). Forced to a narrower
    ISA than the machine's (`avx2` on an AVX-512 CPU), the generated code assumes the narrow
    vector width while the kernels are compiled for the machine: wrong codes (whole vectors of
    zeros) and crashes (torch 2.13). Scalar code (`cpp.simdlen = 1`) is right under any forced
    capability; it sums in another order than the vectorised code, within the same float
    tolerance. Without the variable (ATen and inductor both pick the machine's ISA): nothing
    changes."""
    if os.environ.get("ATEN_CPU_CAPABILITY", "").strip():
        import torch._inductor.config as inductor_config

        inductor_config.cpp.simdlen = 1


@functools.cache
def _compiled(name: str) -> Callable:
    fit_cpu_codegen_to_aten()
    return torch.compile(getattr(Fn, name), dynamic=True, fullgraph=True)


@functools.cache
def _limit_errors() -> tuple[type[BaseException], ...]:
    """torch._dynamo's "too many graphs for this function" errors (named differently by version)."""
    import torch._dynamo.exc as exc

    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit", "RecompileLimitExceeded", "CacheLimitExceeded")
    found = tuple(getattr(exc, n) for n in names if isinstance(getattr(exc, n, None), type))
    return found or (exc.RecompileError,)


def _lazy(name: str) -> Callable:
    def call(*args):
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        with torch.no_grad():
            try:
                return _compiled(name)(*args)
            except _limit_errors() as e:
                if name not in _FELL_BACK:
                    _FELL_BACK.add(name)
                    log.warning(
                        "inductor backend: %s hit torch._dynamo's recompile limit (%s); calls that "
                        "would need a new graph run the eager reference (same results)",
                        name,
                        type(e).__name__,
                    )
                return getattr(Fn, name)(*args)

    call.__name__ = f"inductor_{name}"
    return call


FUNCTIONS = {
    "taco": (_lazy("taco_encode"), _lazy("taco_decode")),
    "fp8": (_lazy("fp8_encode"), _lazy("fp8_decode")),
    "int": (_lazy("int_encode"), _lazy("int_decode")),
}
BACKEND = GroupFnBackend("inductor", FUNCTIONS)
"""The reference composition (padding, layout, term-by-term sums) around the compiled functions."""
