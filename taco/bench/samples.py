"""The inputs and outputs the codec benchmarks share: synthetic tensor families, captured tensors
read from a folder, and results as strict JSON (`taco bench codec` and its `--frontier`)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

HIDDEN = 1024  # row width of the synthetic [tokens, hidden] tensors


# -- data -----------------------------------------------------------------------------------------
def _shape(n: int) -> tuple[int, int]:
    h = min(HIDDEN, n)
    return (max(1, n // h), h)


def synthetic(family: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """One synthetic fp32 tensor of about n elements, [n / 1024, 1024] (TP activations' layout)."""
    shape = _shape(n)
    x = torch.randn(shape, generator=gen)
    if family == "gaussian":
        return x
    if family == "student-t3":  # heavy tails: t = z / sqrt(chi2_3 / 3)
        chi2 = torch.randn((3, *shape), generator=gen).square().sum(0)
        return x / (chi2 / 3).sqrt()
    if family == "channel-outliers":  # a few hidden channels 100x larger (LLM activations)
        cols = torch.randperm(shape[1], generator=gen)[: max(1, shape[1] // 256)]
        x[:, cols] *= 100.0
        return x
    if family == "tiny-grad":  # activation gradients ~1e-7 with rare 1e-4 outliers
        x = x * 1e-7
        m = torch.rand(shape, generator=gen) < 1e-3
        return torch.where(m, x * 1e3, x)
    if family == "sparse":  # 90% exact zeros
        return torch.where(torch.rand(shape, generator=gen) < 0.9, torch.zeros_like(x), x)
    raise ValueError(f"unknown family {family!r}: use one of {list(FAMILIES)}")


FAMILIES = ("gaussian", "student-t3", "channel-outliers", "tiny-grad", "sparse")


def load_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Float tensors from .pt / .safetensors files in `folder`: name -> tensor (file stem[/key])."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).iterdir()):
        if f.suffix == ".pt":
            obj = torch.load(f, map_location="cpu", weights_only=True)
        elif f.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(str(f))
        else:
            continue
        items = obj.items() if isinstance(obj, dict) else [("", obj)]
        for key, t in items:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                out[f.stem + (f"/{key}" if key and len(obj) > 1 else "")] = t
    if not out:
        raise ValueError(f"--tensors {folder}: no .pt or .safetensors float tensors found")
    return out



def json_safe(obj: object) -> object:
    """inf/nan -> None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_safe(v) for v in obj]
    return obj
