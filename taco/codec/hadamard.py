"""Walsh-Hadamard transform over groups (docs/design.md 1.1 step 2).

The Sylvester matrix H_G has entries +-1 and H_G @ H_G = G * I, so H_G / sqrt(G) is orthonormal
and its own inverse. Groups are rotated by a dense [G, G] matmul: exact +-1 products, fp32
accumulation, and on every backend a single well-optimised kernel.
"""

from __future__ import annotations

import functools

import torch

GROUP_SIZES = (32, 64, 128, 256, 512)


def check_group_size(g: int, allowed: tuple[int, ...] = GROUP_SIZES) -> int:
    """Validate a group size: a power of two in `allowed`."""
    if isinstance(g, bool) or not isinstance(g, int):
        raise TypeError(f"group_size must be an int, got {type(g).__name__}")
    if g not in allowed:
        raise ValueError(f"group_size={g} is not supported: use a power of two in {list(allowed)}")
    return g


@functools.lru_cache(maxsize=64)
def _sylvester_cpu(g: int) -> torch.Tensor:
    h = torch.ones(1, 1, device="cpu")
    while h.shape[0] < g:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


_DEVICE_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def hadamard_matrix(g: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The unnormalised Sylvester Hadamard matrix H_g (fp32, entries +-1), cached per device."""
    if g & (g - 1) or g < 1:
        raise ValueError(f"Hadamard size must be a power of two, got {g}")
    key = (g, str(device))
    h = _DEVICE_CACHE.get(key)
    if h is None:
        h = _sylvester_cpu(g).to(device)
        _DEVICE_CACHE[key] = h
    return h
