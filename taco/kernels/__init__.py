"""Fused compression operators for the codec families (docs/design.md 2: codec <- kernels <- comm).

Importing this package registers three implementations of the one backend interface
(`taco.codec.backend.KernelBackend`: encode, decode, decode-sum-encode into given buffers):
- "native" (CPU): the C kernels of `taco_cpu.c`, one pass per batch of 16 groups, built once per
  machine (`native.py`, ~2 s, cached on disk; ~10x the eager reference on 16M bf16 elements);
- "triton" (CUDA, or anywhere under TRITON_INTERPRET=1): fused Triton kernels (`triton_taco.py`;
  the wire's bit formats, 2..8-bit packed codes and bf16/e8m0 scales, in `triton_bits.py`),
  imported lazily on first use and only if triton is importable;
- "inductor" (opt-in, any device): `torch.compile` of the reference functions (`inductor.py`).
Results are within one FP8/INT step of the reference where summation order differs (see tests).
With "native" and "triton" a group's bytes depend on that group only (not on its neighbours, its
position in a batch or tile, or the thread count), so slicing a message never changes them; the
eager reference inherits this from torch's matmul (tested on CPU; cuBLAS picks kernels by shape).
backend="auto" picks "native" on CPU and "triton" on CUDA. `TACO_CODEC_BACKEND` overrides the auto
choice for every device: "eager" (reference only), "native" ("compile" is its old name), "triton",
or "auto".
"""

from __future__ import annotations

import importlib.util
import os

import torch

from taco.codec import backend as kb
from taco.codec.backend import KernelBackend

from . import inductor, native

__all__ = ["auto_order", "resolve_auto", "triton_available"]


def triton_available() -> bool:
    """Whether triton can be imported (the kernels also need CUDA or TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


class _LazyTriton(KernelBackend):
    """Registers "triton" without importing triton until a codec asks for it."""

    name = "triton"

    def _real(self) -> KernelBackend:
        from . import triton_taco

        real = triton_taco.TritonBackend()
        kb.register(real)  # later selections get the real one directly
        return real

    def supports(self, codec, device: torch.device) -> bool:
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not (interpret and device.type == "cpu"):
            return False
        return self._real().supports(codec, device)


def resolve_auto(choice: str, triton_ok: bool, interpret: bool = False) -> dict[str, list[str]]:
    """The auto order per device for a TACO_CODEC_BACKEND value (a pure function, for tests).

    Default ("auto"): "native" on CPU (built in about a second once per machine, then loaded in
    milliseconds) and "triton" on CUDA. "eager" keeps the reference everywhere.
    """
    choice = kb.ALIASES.get(choice.strip().lower(), choice.strip().lower()) or "auto"
    if choice not in ("auto", "eager", "native", "triton"):
        raise ValueError(f"TACO_CODEC_BACKEND={choice!r}: use auto, eager, native or triton")
    cuda = ["triton"] if triton_ok and choice in ("auto", "triton") else []
    cpu = ["native"] if choice in ("auto", "native") else []
    if choice == "triton" and interpret and triton_ok:
        cpu = ["triton"]
    return {"cpu": cpu, "cuda": cuda}


def _register() -> None:
    kb.register(native.NativeBackend())
    kb.register(inductor.BACKEND)
    if triton_available():
        kb.register(_LazyTriton())
    order = resolve_auto(
        os.environ.get("TACO_CODEC_BACKEND", "auto"),
        triton_available(),
        os.environ.get("TRITON_INTERPRET") == "1",
    )
    for dev, o in order.items():
        kb.set_auto_order(dev, o)


_register()


def auto_order(device_type: str) -> list[str]:
    """The backends backend="auto" tries on `device_type` (set at import, see module docstring)."""
    return kb.auto_order(device_type)
