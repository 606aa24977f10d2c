"""Walsh-Hadamard transform over groups (docs/design.md 1.1 step 2).

The Sylvester matrix H_G has entries +-1 and H_G @ H_G = G * I, so H_G / sqrt(G) is orthonormal
and its own inverse. The reference rotates groups with the fast Walsh-Hadamard transform (`fwht`):
log2(G) stages of add/sub pairs in one fixed order, then one correctly rounded division by
fp32(sqrt(G)). Every step is an elementwise IEEE fp32 operation on whole [ng, G] tensors, so a group's
rotation depends on the group alone: not on the number of groups, the thread count, the CPU's vector
width or the device (a dense matmul's summation order depends on the BLAS blocking, hence on all of
those; docs/design.md "Same bytes everywhere"). The stages are those of the native C kernels, operand
for operand, so the two give the same bits.

Randomized Hadamard (the intB-hadamard codecs' `signs` option, QuaRot arXiv 2404.00456): each group
is multiplied by a fixed +-1 diagonal D before the rotation and after the inverse. D is not drawn
from an RNG but computed from the position i in the group, identically in every backend:
s_i = (-1)^popcount(lo & hi), lo = i mod 2^m, hi = (i >> m) mod 2^m, m = floor(log2(G) / 2) (a
Maiorana-McFarland bent function). So D 1 has a flat Hadamard spectrum, |H_G D 1| = sqrt(G) for
even log2 G and at most sqrt(2 G) for odd (the least possible): a constant group, or any Walsh
function, which the plain rotation maps onto one coefficient, is spread over all of them.
Sign flips are exact, so D H and H D as matrices give the same products as flipping first.
"""

from __future__ import annotations

import functools
import math

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


_DEVICE_CACHE: dict[tuple, torch.Tensor] = {}


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


@functools.lru_cache(maxsize=64)
def _signs_cpu(g: int) -> torch.Tensor:
    m = (g.bit_length() - 1) // 2
    i = torch.arange(g, device="cpu")
    v = (i & ((1 << m) - 1)) & ((i >> m) & ((1 << m) - 1))
    parity = torch.zeros_like(v)
    for b in range(m):
        parity ^= (v >> b) & 1
    return (1 - 2 * parity).float()


def sign_flips(g: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The randomized Hadamard's diagonal D of group size g: fp32 +-1 (see the module docstring)."""
    hadamard_matrix(g)  # validates g
    key = ("signs", g, str(device))
    d = _DEVICE_CACHE.get(key)
    if d is None:
        d = _DEVICE_CACHE[key] = _signs_cpu(g).to(device)
    return d


def signed_hadamard(g: int, device: torch.device | str = "cpu", decode: bool = False) -> torch.Tensor:
    """D H_g (rows flipped: x @ D H = (x D) @ H, the encode rotation) or H_g D (columns flipped: the
    decode rotation, y @ H D = (y @ H) D), cached per device."""
    key = ("signed", g, str(device), decode)
    h = _DEVICE_CACHE.get(key)
    if h is None:
        d, hm = _signs_cpu(g), _sylvester_cpu(g)
        h = _DEVICE_CACHE[key] = (hm * d[None, :] if decode else d[:, None] * hm).contiguous().to(device)
    return h


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x [ng, G] fp32 -> x @ H_G (unnormalised) in log2(G) butterfly stages; stage k pairs the elements
    whose indices differ in bit k (k = 0, 1, ..: stride 1 first), a the lower and b the upper, into
    (a + b, a - b), as the native kernels' strides h = 1, 2, 4, ... do. Elementwise fp32 adds only: the
    same bits on every device, ISA and batch size.

    Written in constant geometry: each stage reads the adjacent pairs (2i, 2i + 1) and writes a + b to
    i and a - b to i + G/2, which moves the index's bit 0 to the top; after log2(G) stages every
    element is back in place (out-of-place, so torch.compile traces it too)."""
    n, g = x.shape
    for _ in range(g.bit_length() - 1):
        v = x.reshape(n, g // 2, 2)
        a, b = v[..., 0], v[..., 1]
        x = torch.cat((a + b, a - b), dim=1)
    return x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [ng, G] fp32 -> x @ H_G / sqrt(G): the butterflies, then one true division by fp32(sqrt(G)).

    The divisor is a device tensor, not a Python scalar: CUDA turns division by a host scalar into a
    product with its reciprocal, which rounds differently from the kernels' correctly rounded division."""
    g = x.shape[1]
    return fwht(x) / _root(g, x.device)


def _root(g: int, device: torch.device) -> torch.Tensor:
    key = ("root", g, str(device))
    r = _DEVICE_CACHE.get(key)
    if r is None:
        r = _DEVICE_CACHE[key] = torch.tensor([math.sqrt(g)], dtype=torch.float32, device=device)
    return r


def flip(x: torch.Tensor, flips: torch.Tensor, where: torch.Tensor | bool = True) -> torch.Tensor:
    """x times the diagonal D (`sign_flips`) as the kernels do it, 0 - x (so zeros stay +0); only in the
    rows where `where` holds (a [ng, 1] bool tensor, or True for all)."""
    return torch.where((flips < 0) & where, 0.0 - x, x)
