"""The "inductor" backend: `torch.compile` of the reference group functions (any device).

Why it exists beside the native "compile" backend: it needs no C compiler of ours and runs
wherever torch.compile does (CPU with a C++ toolchain, CUDA), fusing the reference's
element-wise steps around the Hadamard matmul. Measured on this project's 2-core CPU: ~22 s of
compilation per process and ~2.3x the eager reference, versus ~10x for the native backend, so
it is opt-in (`backend="inductor"`), never the auto choice. One compiled graph per function,
dynamic in the number of groups.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from taco.codec import functional as Fn


@functools.cache
def _compiled(name: str) -> Callable:
    return torch.compile(getattr(Fn, name), dynamic=True, fullgraph=True)


def _lazy(name: str) -> Callable:
    def call(*args):
        return _compiled(name)(*args)

    call.__name__ = f"inductor_{name}"
    return call


FUNCTIONS = {
    "taco": (_lazy("taco_encode"), _lazy("taco_decode")),
    "fp8": (_lazy("fp8_encode"), _lazy("fp8_decode")),
    "int": (_lazy("int_encode"), _lazy("int_decode")),
}
