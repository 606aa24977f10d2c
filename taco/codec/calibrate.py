"""Data-driven reshaping (docs/design.md 1.1): choose the grouping per site from measured error.

TACO's reshaping picks how a tensor is cut into groups before the Hadamard rotation. Here the
choice is (group size G, grouping axis) for a codec, made per communication site from sampled
real tensors: every candidate is run on every sample and scored by its error-bytes product
`NMSE * bytes/elem` (lower is better; NMSE = sum (x - x^)^2 / sum x^2 over all samples), an
operational rate-distortion score in which halving the bytes is worth doubling the error.
`max_bytes_per_elem` and `min_sqnr_db` turn the score into a constrained choice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .base import Codec
from .hadamard import GROUP_SIZES
from .registry import get_codec


@dataclass
class CalibrationChoice:
    """The chosen grouping for one site, with the scores of every candidate measured."""

    codec: str
    group_size: int
    axis: int
    sqnr_db: float
    bytes_per_elem: float
    table: list[dict] = field(default_factory=list)
    spec: str = ""
    """the chosen codec's full spec (`Codec.spec`, every option), as `taco.comm.CommPolicy` takes it"""

    def options(self) -> dict:
        """Keyword options for `taco.get_codec(choice.codec, **choice.options())`."""
        return {"group_size": self.group_size, "axis": self.axis}

    def instantiate(self, **extra):
        """The chosen codec, built (`extra`: more keyword options)."""
        return get_codec(self.codec, **self.options(), **extra)


def default_candidates(codec: str = "taco", axes: Sequence[int] = (-1, 0)) -> list[dict]:
    return [{"codec": codec, "group_size": g, "axis": a} for g in GROUP_SIZES for a in axes]


def calibrate(
    samples: Iterable[torch.Tensor],
    candidates: Sequence[dict | Codec] | None = None,
    *,
    max_bytes_per_elem: float = math.inf,
    min_sqnr_db: float = -math.inf,
) -> CalibrationChoice:
    """Measure each candidate {codec, group_size, axis, ...options} (or a built Codec) on `samples`;
    return the best. Every table row carries the candidate's full `spec` (options such as fmt too).

    1-D samples are flat: every candidate groups them in memory order whatever its axis; on samples
    of 2+ dims an axis out of range raises ValueError (from the codec).
    Raises ValueError if there are no samples or no candidate meets the constraints, and if any
    sample holds NaN or Inf: the scores would be NaN/Inf and the choice arbitrary. Such samples
    are not dropped silently (a NaN in captured activations is worth knowing about): pass only
    finite samples, e.g. `[s for s in samples if s.isfinite().all()]`.
    """
    xs = []
    for i, s in enumerate(samples):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"calibrate: sample {i} is a {type(s).__name__}, expected a torch.Tensor")
        x = s.detach()
        if x.is_floating_point() and x.numel():
            bad = int((~torch.isfinite(x)).sum())  # one host read per sample: calibration is offline
            if bad:
                raise ValueError(
                    f"calibrate: sample {i} (shape {tuple(x.shape)}) holds {bad} non-finite value(s) "
                    f"(NaN/Inf) of {x.numel()}; the choice would be arbitrary. Pass finite samples "
                    "only, e.g. [s for s in samples if s.isfinite().all()]"
                )
        xs.append(x)
    if not xs or all(x.numel() == 0 for x in xs):
        raise ValueError("calibrate needs at least one non-empty sample tensor")
    cands = list(candidates) if candidates is not None else default_candidates()
    if not cands:
        raise ValueError("calibrate needs at least one candidate")
    table = []
    for cand in cands:
        if isinstance(cand, Codec):
            codec, name = cand, cand.name
            opts = {k: getattr(cand, k) for k in ("group_size", "axis") if hasattr(cand, k)}
        else:
            opts = dict(cand)
            name = opts.pop("codec", "taco")
            codec = get_codec(name, **opts)
        err = sig = 0.0
        nbytes = numel = 0
        for x in xs:
            if x.numel() == 0:
                continue
            y = codec.roundtrip(x)
            x64 = x.double()
            err += (x64 - y.double()).square().sum().item()
            sig += x64.square().sum().item()
            nbytes += codec.nbytes(x.numel(), x.dtype)
            numel += x.numel()
        nmse = err / sig if sig > 0 else (0.0 if err == 0 else math.inf)
        bpe = nbytes / numel
        sq = math.inf if nmse == 0 else -10 * math.log10(nmse) if math.isfinite(nmse) else -math.inf
        table.append(
            {
                "codec": name,
                "spec": codec.spec,
                "group_size": opts.get("group_size", 128),
                "axis": opts.get("axis", -1),
                "sqnr_db": sq,
                "bytes_per_elem": bpe,
                "score": nmse * bpe,
            }
        )
    ok = [r for r in table if r["bytes_per_elem"] <= max_bytes_per_elem and r["sqnr_db"] >= min_sqnr_db]
    if not ok:
        raise ValueError(
            f"no candidate meets max_bytes_per_elem={max_bytes_per_elem} and min_sqnr_db={min_sqnr_db}; "
            f"best SQNR measured {max(r['sqnr_db'] for r in table):.1f} dB"
        )
    best = min(ok, key=lambda r: (r["score"], r["bytes_per_elem"]))
    return CalibrationChoice(
        best["codec"], best["group_size"], best["axis"], best["sqnr_db"], best["bytes_per_elem"], table,
        best["spec"],
    )
