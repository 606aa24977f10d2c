"""TACO-TP: compressed communication for tensor-parallel LLM training (arXiv 2604.24088).

Public API (docs/design.md 2.1): `taco.list_codecs()`, `taco.get_codec(name, **options)`, and the
compressed collectives in `taco.comm` (imported lazily, it needs torch.distributed).
"""

from __future__ import annotations

import importlib
from typing import Any

from . import kernels as _kernels  # noqa: F401 - registers the fused backends (auto: native CPU, Triton)
from .codec import Codec, Packed, get_codec, list_codecs

__version__ = "0.1.0"
__all__ = ["Codec", "Packed", "get_codec", "list_codecs", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("comm", "parallel", "models", "train", "bench"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'taco' has no attribute {name!r}")
