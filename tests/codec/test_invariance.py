"""Same bytes everywhere (docs/design.md): a group's code is a pure function of the group and the
codec's settings, whatever its neighbours, the thread count or the CPU ISA torch dispatches to.

Each ATen CPU capability the machine offers (default, avx2, avx512; read once at import, so one
subprocess per capability) runs every codec x backend (eager, native, auto; Triton under the
interpreter with `-m slow`) on 48 groups built from an integer hash (exact float64 steps, one
rounding to fp32: no torch.randn, whose values depend on the capability), among them a zero group, a
NaN group, a group near fp32's max and a subnormal one. Inside a subprocess: each group encodes to
the same bytes alone and with 0..47 neighbours, and a 1100-group tensor to the same bytes with 1, 2
and 3 threads, its first 48 groups those encoded alone. Across subprocesses: every capability gives
the same digest of all those bytes and decoded values, and eager, native and auto give the same one.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

G = 128
NG = 48
ROOT = Path(__file__).resolve().parents[2]


def capabilities() -> list[str]:
    """The ATEN_CPU_CAPABILITY values this machine can run (default always)."""
    top = torch.backends.cpu.get_cpu_capability()
    return ["default"] + {"AVX2": ["avx2"], "AVX512": ["avx2", "avx512"]}.get(top, [])


def hashed(ng: int, seed: int = 0) -> torch.Tensor:
    """[ng, G] fp32 groups from an integer hash: magnitudes 2^-20..2^20 by group, group 5 zero, group
    11 with a NaN, group 17 near fp32's max (same signs), group 23 subnormal, group 29 alternating
    +-1e37. Integer and exact float64 steps, then one rounding to fp32: the same on every ISA."""
    i = torch.arange(ng * G, dtype=torch.int64) + seed * 1_000_003
    h = (i * 2654435761) % 2**32
    h = ((h ^ (h >> 15)) * 2246822519) % 2**32
    u = (h.double() / 2**32 - 0.5).view(ng, G)  # exact: 32-bit integers over a power of two
    k = torch.arange(ng, dtype=torch.int64)
    x = u * torch.pow(2.0, ((k * 7) % 41 - 20).double()).view(-1, 1)
    x[5 % ng] = 0.0
    if ng > 29:
        x[17] = (u[17].abs() + 1.0) * 2.0**126  # [2^126, 1.5 * 2^127): butterflies overflow unscaled
        x[23] = u[23] * 2.0**-135
        x[29] = torch.where(torch.arange(G) % 2 == 0, 1e37, -1e37).double() * (1 + u[29].abs())
    x = x.float()
    x[11 % ng, 3] = float("nan")  # set in fp32: a converted NaN's sign bit depends on the ISA path
    return x


def bf16_of(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by integer steps (round to nearest even; NaN kept quiet): torch's conversion gives
    a NaN's sign bit differently under different capabilities, which the codes would carry."""
    b = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = torch.where(x.isnan(), (b >> 16) | 0x40, r)
    return (r - ((r >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def _codecs() -> list[tuple[str, object]]:
    import taco
    from taco.codec.mx import MX_CODECS
    from taco.codec.specs import parse_spec

    # the hardware block formats keep their own layouts (fixed blocks, packed fp6/fp4) and have their
    # own invariance tests (tests/codec/test_codec_mx.py: an MX block's code is a function of the block)
    names = [n for n in taco.list_codecs() if n not in ("none", "fp8-tensor", *MX_CODECS)]
    names += ["int6-hadamard(signs=True)", "int6-hadamard(signs=auto)", "taco/bf16", "taco-1s/e8m0",
              "int5-hadamard/e8m0", "int6-hadamard(signs=auto)/bf16"]  # fmt: skip
    out = []
    for name in names:
        spec, _, sfmt = name.partition("/")
        base, opts = parse_spec(spec)
        out.append((name, lambda backend, b=base, o=opts, s=sfmt: taco.get_codec(
            b, backend=backend, group_size=G, **o, **({"scale_fmt": s} if s else {}))))  # fmt: skip
    return out


def _group(data: torch.Tensor, codec, ng: int, k: int) -> bytes:
    pb, sb = G * codec.bits // 8, codec.scale_bytes
    p = ng * pb
    parts = [data[k * pb : (k + 1) * pb]]
    parts += [data[p + sb * (ng * i + k) : p + sb * (ng * i + k + 1)] for i in range(codec.n_scales)]
    return torch.cat(parts).numpy().tobytes()


def _values(y: torch.Tensor) -> bytes:
    return y.float().nan_to_num(7.0).view(torch.int32).numpy().tobytes()  # NaN signs aside


def worker(backends: list[str]) -> dict[str, str]:
    """Run in a subprocess: check everything within this capability, return {codec/backend: digest}."""
    x48, big = hashed(NG), hashed(1100, seed=1)
    big[:NG] = x48
    flat = big.reshape(-1)[:-37]  # ragged: the last group cut short
    out, before = {}, torch.get_num_threads()
    for name, make in _codecs():
        for backend in backends:
            c = make(backend)
            what = f"{name} {backend}"
            alone = [_group(c.encode(x48[k]).data, c, 1, k=0) for k in range(NG)]
            for n in range(1, NG + 1):
                p = c.encode(x48[:n].reshape(-1))
                for k in range(n):
                    assert _group(p.data, c, n, k) == alone[k], f"{what}: group {k} of {n}: bytes"
            y48 = c.decode(c.encode(x48.reshape(-1))).view(NG, G)
            for k in range(NG):
                assert _values(c.decode(c.encode(x48[k]))) == _values(y48[k]), f"{what}: group {k}: values"
            runs = []
            try:
                for nt in (1, 2, 3):
                    torch.set_num_threads(nt)
                    p = c.encode(flat)
                    runs.append((nt, p.data.clone(), _values(c.decode(p))))
            finally:
                torch.set_num_threads(before)
            for nt, data, vals in runs[1:]:
                assert torch.equal(data, runs[0][1]) and vals == runs[0][2], f"{what}: {nt} threads"
            ng = c.groups(flat.numel())
            for k in range(NG):
                assert _group(runs[0][1], c, ng, k) == alone[k], f"{what}: group {k} of {ng}: bytes"
            bf = c.encode(bf16_of(flat))
            digest = hashlib.sha256(b"".join(alone) + runs[0][1].numpy().tobytes() + runs[0][2])
            digest.update(bf.data.numpy().tobytes() + _values(c.decode(bf)))
            out[f"{name}/{backend}"] = digest.hexdigest()
    return out


def run_capability(cap: str, backends: list[str], timeout: float = 600) -> dict[str, str]:
    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, PYTHONPATH=str(ROOT))
    if "triton" in backends:
        env["TRITON_INTERPRET"] = "1"
    code = (
        "import json, sys, torch; from tests.codec import test_invariance as t; "
        f"assert torch.backends.cpu.get_cpu_capability().lower() == {cap!r}, "
        "torch.backends.cpu.get_cpu_capability(); "
        f"print('DIGESTS ' + json.dumps(t.worker({backends!r})))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=timeout)  # fmt: skip
    assert r.returncode == 0, f"ATEN_CPU_CAPABILITY={cap}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("DIGESTS ")][-1]
    return json.loads(line[len("DIGESTS ") :])


def test_codes_are_a_function_of_the_group_under_every_capability():
    from taco.kernels import native

    backends = ["eager", "auto"] + (["native"] if native.library() is not None else [])
    caps = capabilities()
    results = {cap: run_capability(cap, backends) for cap in caps}
    first = results[caps[0]]
    for cap in caps[1:]:
        differ = sorted(k for k in first if results[cap][k] != first[k])
        assert not differ, f"{cap} encodes differently from {caps[0]}: {differ}"
    differ = sorted({k.split("/")[0] for k in first if first[k] != first[k.rsplit("/", 1)[0] + "/eager"]})
    assert not differ, f"backends disagree with the eager reference on {differ}"
    print(f"capabilities {caps}: {len(first)} codec/backend digests, all equal")


@pytest.mark.slow
def test_triton_codes_are_a_function_of_the_group_under_every_capability():
    """The Triton kernels under the interpreter (minutes): invariant within and across capabilities
    (their bytes may differ from eager's within the tolerances of tests/kernels/test_kernels.py)."""
    from taco.kernels import triton_available

    if not triton_available():
        pytest.skip("triton not installed")
    caps = capabilities()
    results = {cap: run_capability(cap, ["triton"], timeout=3000) for cap in caps}
    for cap in caps[1:]:
        assert results[cap] == results[caps[0]], f"{cap} encodes differently from {caps[0]}"
