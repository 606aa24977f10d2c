"""The reference criteria of the kernel tests: wire parts, code and scale tolerances, and
`check_pair`, a backend's encode and decode of every codec family against `functional`."""

from __future__ import annotations

import math

import torch

import taco
from taco.codec import functional as Fn
from taco.codec.formats import unpack_int4
from taco.codec.hadamard import hadamard_matrix

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def sample(ng: int, g: int, seed: int = 0) -> torch.Tensor:
    """Groups of mixed magnitudes plus one NaN group, one Inf group and one zero group."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ng, g, generator=gen) * torch.logspace(-3, 3, g)[torch.randperm(g, generator=gen)]
    x[1, 5], x[2, 7], x[3] = math.nan, math.inf, 0.0
    return x


def code_index(bits: torch.Tensor) -> torch.Tensor:
    b = bits.view(torch.uint8).to(torch.int32)
    return torch.where(b >= 128, -(b & 0x7F), b & 0x7F)


def check_codes(ref: torch.Tensor, got: torch.Tensor, fp8: torch.dtype | None) -> float:
    """Assert the criterion of the module docstring; returns the fraction of differing codes."""
    if fp8 is None:  # int codes (int8, or their uint8 wire bytes)
        d = (ref.view(torch.int8).to(torch.int32) - got.view(torch.int8).to(torch.int32)).abs()
        assert d.max().item() <= 1
        return (d > 0).float().mean().item()
    vr, vg = ref.view(fp8).float(), got.view(fp8).float()
    both_nan = vr.isnan() & vg.isnan()
    assert torch.equal(vr.isnan(), vg.isnan())
    steps = (code_index(ref) - code_index(got)).abs()
    tiny = (vr - vg).abs() <= 1e-5 * FMAX[fp8]
    ok = both_nan | (steps <= 1) | tiny
    assert ok.all(), f"{(~ok).sum().item()} codes differ by more than one step"
    frac = ((steps > 0) & ~both_nan).float().mean().item()
    assert frac < 1e-3
    return frac


U = 2.0**-24  # fp32's unit roundoff


OUT_U = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # output dtype's roundoff


def rotation_rtol(g: int) -> float:
    """Bound on |ref - kernel| of a rotated value, relative to its group's 2-norm (module docstring)."""
    return (math.log2(g) + g + 6) * U


def scale_rtol(g: int) -> float:
    """Bound on the relative difference of a rotated group's absmax scale (module docstring)."""
    return (math.log2(g) + g + 7) * U * math.sqrt(g)


def dsum_rtol(g: int, terms: int) -> float:
    """Bound on a decode-sum-encode sum's difference, relative to the tensor's absmax: each decoded
    term within rotation_rtol(g) of its group's 2-norm (<= sqrt(g) times the absmax: the terms here
    are of the sum's order), and the terms - 1 additions within an ulp each."""
    return terms * rotation_rtol(g) * math.sqrt(g) + terms * U


def check_rotated(ref: torch.Tensor, got: torch.Tensor, g: int, out_u: float = 0.0) -> None:
    """Equal NaN pattern; elsewhere, per group of g values, |ref - got| <= rotation_rtol(g) ||ref||_2
    + 2 out_u absmax (out_u: the unit roundoff of the output dtype both sides rounded to)."""
    assert torch.equal(ref.isnan(), got.isnan())
    r = ref.nan_to_num(0.0, 0.0, 0.0).double().reshape(-1)
    d = (r - got.nan_to_num(0.0, 0.0, 0.0).double().reshape(-1)).abs()
    pad = -r.numel() % g
    r, d = torch.nn.functional.pad(r, (0, pad)).view(-1, g), torch.nn.functional.pad(d, (0, pad)).view(-1, g)
    tol = rotation_rtol(g) * r.norm(dim=1, keepdim=True) + 2 * out_u * r.abs().amax(1, keepdim=True)
    assert (d <= tol).all(), (d / r.norm(dim=1, keepdim=True).clamp_min(1e-300)).max().item()


def check_close(ref: torch.Tensor, got: torch.Tensor, rtol: float = 1e-6) -> None:
    """Equal NaN pattern; elsewhere |ref - got| <= rtol * absmax of the row (group)."""
    assert torch.equal(ref.isnan(), got.isnan())
    r, g = ref.nan_to_num(0.0, 0.0, 0.0).float(), got.nan_to_num(0.0, 0.0, 0.0).float()
    scale = r.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert ((r - g).abs() <= rtol * scale).all(), ((r - g).abs() / scale).max().item()


CASES = [  # (codec name, options, reference encode, its trailing arguments) for one group size
    ("taco", {"fmt": "e4m3"}, "taco", (E4M3, 448.0, 1e-6, 448.0)),
    ("taco", {"fmt": "e5m2"}, "taco", (E5M2, 57344.0, 1e-6, 57344.0)),
    ("fp8-group", {"fmt": "e4m3"}, "fp8", (E4M3, 448.0)),
    ("fp8-group", {"fmt": "e5m2"}, "fp8", (E5M2, 57344.0)),
    ("taco-1s", {"fmt": "e4m3"}, "fp8", (E4M3, 448.0)),
    ("int8-group", {}, "int", (127,)),
    ("int8-hadamard", {}, "int", (127,)),
    ("int4-hadamard", {}, "int", (7,)),
]


def wire_parts(codec, buf: torch.Tensor, ng: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(codes [ng, G] as the reference returns them, scales [ng, 1] each) of one wire chunk."""
    payload, scales = codec._split(buf)
    if codec.bits == 4:
        payload = unpack_int4(payload)
    return payload.reshape(ng, codec.group_size), [s.reshape(ng, 1) for s in scales]


def check_pair(backend: str, g: int, ng: int, seed: int = 0) -> dict[str, float]:
    """A backend's wire-level encode and decode of every codec family against `functional`."""
    x, h, fracs = sample(ng, g, seed), hadamard_matrix(g), {}
    for name, opts, fam, args in CASES:
        c = taco.get_codec(name, group_size=g, backend=backend, **opts)
        assert c.kernel(x.device).name == backend
        hh = h if c.rotate else None
        enc = getattr(Fn, f"{fam}_encode")
        ref = enc(x, *((hh,) if fam != "taco" else (h,)), *args)
        buf = torch.empty(c.nbytes(x.numel()), dtype=torch.uint8)
        c.kernel(x.device).encode(c, x.view(-1), buf)
        q, scales = wire_parts(c, buf, ng)
        if backend == "native":  # the reference's bytes, bit for bit
            assert torch.equal(q.view(torch.uint8), ref[0].view(torch.uint8)), f"{name} {opts} codes"
            for sr, sg in zip(ref[1:], scales):
                assert torch.equal(sr.view(torch.int32), sg.view(torch.int32)), f"{name} {opts} scales"
        for sr, sg in zip(ref[1:], scales):
            check_close(sr, sg, scale_rtol(g))
        fp8 = opts.get("fmt") and {"e4m3": E4M3, "e5m2": E5M2}[opts["fmt"]]
        fracs[f"{name}-{opts}"] = check_codes(ref[0], q, fp8 or None)
        if name in ("fp8-group", "int8-group"):  # no summation anywhere: bit-exact
            assert torch.equal(ref[0].view(torch.uint8), q.view(torch.uint8))
        # the backend's decode of the reference bytes against the reference decode
        ref_buf = torch.empty_like(buf)
        eager = taco.get_codec(name, group_size=g, backend="eager", **opts)
        eager.kernel(x.device).encode(c, x.view(-1), ref_buf)
        dec = getattr(Fn, f"{fam}_decode")
        rq, rs = wire_parts(c, ref_buf, ng)
        dargs = (h, fp8) if fam == "taco" else (hh, fp8) if fam == "fp8" else (hh,)
        y_ref = dec(rq.view(torch.int8) if fam == "int" else rq, *rs, *dargs)
        y = torch.empty(x.numel())
        c.kernel(x.device).decode(c, ref_buf, y)
        if backend == "native":
            assert torch.equal(y_ref.nan_to_num(7.0), y.view(ng, g).nan_to_num(7.0)), f"{name} {opts} decode"
        check_rotated(y_ref, y.view(ng, g), g)
    return fracs


FMAX = {E4M3: 448.0, E5M2: 57344.0}
