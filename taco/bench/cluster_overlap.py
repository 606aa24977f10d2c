"""Batch-split overlap rows of `taco bench cluster`: "CODEC+overlap" runs CODEC with
`parallel.tp_overlap = "batch-split"` (and "none+overlap" is the uncompressed overlap control).

Why this file exists: the overlap rows are a label suffix, not a codec, so the bench's planning,
codec-rate and model steps strip it here and set the parallel option; their ideal is the overlap
bound 1 / max(1 - f, f / r) (`cost_model.ideal_overlap_speedup`) instead of the codec bound
1 / (1 - f + f / r), and their modeled step is `cost_model.overlapped_step` (docs/cluster.md).
"""

from __future__ import annotations

from typing import Any

from . import cost_model as cm

SUFFIX = "+overlap"


def split_label(label: str) -> tuple[str, bool]:
    """("int6-hadamard", True) for "int6-hadamard+overlap"; (label, False) for any other label."""
    if label.endswith(SUFFIX):
        return label[: -len(SUFFIX)] or "none", True
    return label, False


def configure(cfg: Any, label: str) -> None:
    """Set `cfg.parallel.tp_overlap` to batch-split for an overlap row; other rows keep the sweep's
    config (`--set parallel.tp_overlap=batch-split` overlaps every run)."""
    if split_label(label)[1]:
        cfg.parallel.tp_overlap = type(cfg.parallel.tp_overlap).parse("batch-split", "tp_overlap")


def ideal(label: str, f: float, r: float) -> float:
    """The row's ideal speedup: the overlap bound for an overlap row, else the codec bound."""
    return cm.ideal_overlap_speedup(f, r) if split_label(label)[1] else cm.ideal_speedup(f, r)
