"""Overlap rows of `taco bench cluster`: "CODEC+overlap" runs CODEC with
`parallel.tp_overlap = "batch-split"` (and "none+overlap" is the uncompressed overlap control);
"CODEC+overlap-auto" runs it with `parallel.tp_overlap = "auto"` (the split kept only where the
run's probe measures that it pays); "CODEC+chunked" runs it with `parallel.tp_overlap = "chunked"`
(the SP rings; the sweep needs `--set parallel.sp=true`, so that every row runs the same
sequence-parallel collectives).

Why this file exists: the overlap rows are a label suffix, not a codec, so the bench's planning,
codec-rate and model steps strip it here and set the parallel option; their ideal is the overlap
bound 1 / max(1 - f, f / r) (`cost_model.ideal_overlap_speedup`) instead of the codec bound
1 / (1 - f + f / r), and their modeled step is `cost_model.overlapped_step` (docs/cluster.md).
"""

from __future__ import annotations

from typing import Any

from . import cost_model as cm

SUFFIX = "+overlap"
SUFFIXES = {SUFFIX: "batch-split", "+overlap-auto": "auto", "+chunked": "chunked"}
"""label suffix -> the `parallel.tp_overlap` mode of that row"""


def mode(label: str) -> str | None:
    """The overlap mode a label asks for ("batch-split", "auto", "chunked"), or None."""
    return next((m for suffix, m in SUFFIXES.items() if label.endswith(suffix)), None)


def split_label(label: str) -> tuple[str, bool]:
    """("int6-hadamard", True) for "int6-hadamard+overlap", "+overlap-auto" or "+chunked"; (label,
    False) for any other label."""
    for suffix in SUFFIXES:
        if label.endswith(suffix):
            return label[: -len(suffix)] or "none", True
    return label, False


def configure(cfg: Any, label: str) -> None:
    """Set `cfg.parallel.tp_overlap` for an overlap row; other rows keep the sweep's config
    (`--set parallel.tp_overlap=batch-split` overlaps every run)."""
    m = mode(label)
    if m is None:
        return
    if m == "chunked" and not cfg.parallel.sp:
        raise ValueError(
            f"{label!r} runs the chunked sequence-parallel rings: sweep with --set parallel.sp=true "
            "so that every row runs the same sequence-parallel collectives"
        )
    cfg.parallel.tp_overlap = type(cfg.parallel.tp_overlap).parse(m, "tp_overlap")


def pieces(label: str, batch_pieces: int, world: int) -> int:
    """How many pieces the cost model overlaps for the row: `parallel.tp_overlap_chunks` for
    batch-split (and auto, modeled as kept), the TP size for the chunked rings (a ring of `world`
    steps), 1 without overlap."""
    return {"batch-split": batch_pieces, "auto": batch_pieces, "chunked": world}.get(mode(label) or "", 1)


def ideal(label: str, f: float, r: float) -> float:
    """The row's ideal speedup: the overlap bound for an overlap row, else the codec bound."""
    return cm.ideal_overlap_speedup(f, r) if split_label(label)[1] else cm.ideal_speedup(f, r)
