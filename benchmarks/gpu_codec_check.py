"""Step `codec-check` of `benchmarks/gpu_check.py`: every codec the check times, against eager, on the device.

Why this step exists: the bandwidth and replay steps time the Triton kernels of a dozen codec variants;
a timing of a wrong kernel is worthless, so each of them is first checked against the eager reference
(the specification, docs/design.md 1.1) on the same device and inputs, for the three wire-level calls
(encode, decode, decode-sum-encode) in the dtype they are timed in (bf16; the CUDA kernel tests cover
fp32 and fp16), with a ragged tail, a NaN group and a zero group. It runs first and in parallel worker
processes (one codec each), so it is also the compile warm-up: the later steps find the Triton
specializations they need in the shared Triton cache this step fills.

Criteria per codec (docs/design.md 1.1 and 4): the bytes may differ from eager's only where the
rotation's fp32 sums round differently (counted and printed); the round trip's SQNR within 0.05 dB of
eager's; decode of the same bytes within one output ulp (of the message's absmax) of eager's;
decode-sum-encode's SQNR within 0.05 dB; NaN in -> NaN out for that group only; zeros -> exact zeros.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from gpu_common import key, need_codecs, pick_device

# the dtype the later steps time; tests/kernels/test_kernels.py covers fp32/fp16 on CUDA
DTYPES = ("bfloat16",)
# decode of the same bytes, Triton against eager: the rotation's fp32 sums may round differently,
# then the output cast may move by one ulp of the output dtype (relative to the message's absmax)
DECODE_TOL = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 1e-5}


def _sqnr(ref, got) -> float:
    import torch

    err = (ref.double() - got.double()).pow(2).sum()
    sig = ref.double().pow(2).sum()
    return float("inf") if err == 0 else float(10 * torch.log10(sig / err))


def check_codec(spec: str, device: str, n: int) -> tuple[str, list[str], bool]:
    """Check one codec on `device`: (spec, printed lines, ok). Runs in a worker process."""
    import torch

    import taco
    from taco.codec.specs import parse_spec

    name, opts = parse_spec(spec)
    dev = torch.device(device)
    fast = taco.get_codec(name, **opts, backend="triton")
    ref = taco.get_codec(name, **opts, backend="eager")
    g = getattr(fast, "group_size", 32) or 32
    lines, ok = [], True
    gen = torch.Generator(device="cpu").manual_seed(1234)
    base = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))  # heavy-ish tails
    base[g : 2 * g] = 0.0  # a zero group
    for dt_name in DTYPES:
        dt = getattr(torch, dt_name)
        x = base.to(dt).to(dev)
        t0 = time.perf_counter()
        pf, pr = fast.encode(x), ref.encode(x)
        same = (pf.data == pr.data).float().mean().item()
        yf, yr = fast.decode(pf), ref.decode(pr)
        s_f, s_r = _sqnr(x, yf), _sqnr(x, yr)
        cross = ref.decode(pf)  # the same bytes decoded by the reference
        dec_gap = (fast.decode(pf).float() - cross.float()).abs().max().item()
        scale = x.float().abs().max().item()
        zeros = bool((yf[g : 2 * g] == 0).all())
        # decode-sum-encode: 3 received chunks + own, the all-reduce middle step
        m = (n // 4) // g * g
        chunks = [fast.encode(x[k * m : (k + 1) * m]).data for k in range(3)]
        bufs = torch.cat(chunks)
        stride = chunks[0].numel()
        own = x[3 * m : 4 * m]
        sums, codes = {}, {}
        for label, c in (("fast", fast), ("ref", ref)):
            out = torch.empty(c.nbytes(m, dt), dtype=torch.uint8, device=dev)
            sums[label] = torch.empty(m, dtype=torch.float32, device=dev)
            c.decode_sum_encode(bufs, stride, 3, m, dt, own=own, own_index=3, out=out, sum_out=sums[label])
            codes[label] = c.decode(c.wrap(out, (m,), dt)).float()
        sum_db = _sqnr(sums["ref"], sums["fast"])  # the fp32 sums: the same terms in the same order
        dse = {k: _sqnr(sums["ref"], v) for k, v in codes.items()}
        # one NaN in a group: that group decodes to NaN, the others stay finite
        xn = x.clone()
        xn[5] = float("nan")
        yn = fast.decode(fast.encode(xn))
        nan_ok = bool(torch.isnan(yn[:g]).any()) and bool(torch.isfinite(yn[2 * g :]).all())
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt_s = time.perf_counter() - t0
        good = (
            abs(s_f - s_r) <= 0.05
            and dec_gap <= DECODE_TOL[dt_name] * scale
            and abs(dse["fast"] - dse["ref"]) <= 0.05
            and sum_db > 60
            and zeros
            and nan_ok
        )
        ok &= good
        lines.append(
            f"{spec:52s} {dt_name:9s} bytes same {same * 100:7.3f}%  sqnr {s_f:6.2f}/{s_r:6.2f} dB  "
            f"dse {dse['fast']:6.2f}/{dse['ref']:6.2f} dB  sum {min(sum_db, 999):5.1f} dB  "
            f"zeros {'ok' if zeros else 'BAD'}  nan {'ok' if nan_ok else 'BAD'}  {dt_s:5.1f}s"
            + ("" if good else "  FAIL")
        )
    return spec, lines, ok


def cmd_codec_check(args: argparse.Namespace) -> int:
    dev = pick_device(args.dry_run)
    codecs = need_codecs(dev, args.dry_run)
    specs = [c.spec for c in codecs]
    n = 4099 if args.dry_run else (1 << 22) + 3 * 64 + 5  # ragged: a partial last group
    # the dry run uses two workers too, so that the process pool is exercised on the CPU
    workers = min(len(specs), 2) if args.dry_run else max(1, min(len(specs), 8, (os.cpu_count() or 2) // 2))
    print(
        f"{len(specs)} codecs x {len(DTYPES)} dtypes, {n:,} elements, Triton vs eager on {dev.type}, "
        f"{workers} worker process(es); sqnr/dse columns: triton/eager"
    )
    t0 = time.perf_counter()
    results = []
    if workers == 1:
        results = [check_codec(s, dev.type, n) for s in specs]
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            futs = [pool.submit(check_codec, s, dev.type, n) for s in specs]
            results = [f.result() for f in futs]
    bad = []
    for spec, lines, ok in results:
        print("\n".join(lines), flush=True)
        if not ok:
            bad.append(spec)
    secs = time.perf_counter() - t0
    if bad:
        key(f"{len(bad)} of {len(specs)} codecs differ from eager: {', '.join(bad)}")
        return 1
    key(f"{len(specs)} codecs x {len(DTYPES)} dtypes match eager ({secs:.0f} s, {workers} procs)")
    return 0


if __name__ == "__main__":
    sys.exit("run through benchmarks/gpu_check.py codec-check")
