"""The Triton backend issues one kernel launch per phase per slice of a compressed collective.

The kernels are stubbed (benchmarks/host_overhead_stub.py: each launch is recorded with its grid,
nothing runs) and the transfers are no-ops, so any world size can be played in one process: the
two-shot all-reduce makes one encode launch (the N-1 destination chunks on grid axis 1), one
decode-sum-encode and one decode (the N chunks on grid axis 1) per slice, for every N, ragged
messages included. Same bytes as the per-chunk launches: tests/kernels/test_kernels.py and
`test_chunked_launch_matches_per_chunk` below.
"""

from __future__ import annotations

import collections
import os
import re

import pytest
import torch

import taco
from taco.comm.compressed import group_unit, slice_ranges
from taco.kernels import triton_available

pytest.importorskip("triton", reason="needs triton (the gpu extra)")
from taco.kernels.triton_taco import progression  # noqa: E402 - needs triton

pytestmark = pytest.mark.skipif(
    not triton_available() or os.environ.get("TRITON_INTERPRET") != "1", reason="needs triton's interpreter"
)


def _two_shot(world: int, rank: int, numel: int, slices: int, codec: str = "taco"):
    from benchmarks.host_overhead_stub import launches, policy

    pol = policy(codec)
    x = torch.randn(numel).bfloat16()
    log = launches(x, world, rank, slices, pol)
    unit = group_unit(pol._default)
    return log, slice_ranges(numel, world, slices, unit)


@pytest.mark.parametrize("world", range(2, 9))
@pytest.mark.parametrize("slices", [1, 4])
def test_two_shot_slice_takes_three_launches(world, slices):
    numel = 128 * 64 * world  # evenly divided: every rank reduces a part of every slice
    for rank in (0, world - 1):
        log, parts = _two_shot(world, rank, numel, slices)
        assert len(parts) == slices
        chunks = {"_encode_kernel": world - 1, "_decode_sum_encode_kernel": 1, "_decode_kernel": world}
        assert collections.Counter(name for name, _ in log) == dict.fromkeys(chunks, slices), log
        for name, grid in log:  # the chunks of a phase on grid axis 1
            assert grid[1] == chunks[name], (name, grid)


@pytest.mark.parametrize("world", [3, 5, 8])
def test_ragged_messages_stay_at_three_launches_per_slice(world):
    """A message that does not divide: the last non-empty chunk is shorter (some ranks own
    nothing); the shorter chunk rides in the same launch as the full ones."""
    numel = 128 * 7 * world + 333
    for rank in range(world):
        log, parts = _two_shot(world, rank, numel, 4, codec="int6-hadamard(group_size=64)")
        assert len(log) <= 3 * len(parts), (rank, log)
        assert sum(name == "_decode_kernel" for name, _ in log) == len(parts)
        assert sum(name == "_encode_kernel" for name, _ in log) == len(parts)


def test_progression_rebuilds_the_spans_or_declines():
    c = taco.get_codec("taco")
    nb = c.nbytes
    # chunks 0, 2, 3 of 512 elements (own chunk 1 skipped), the last one ragged
    spans = [(0, 512, 0), (1024, 512, 1088), (1536, 77, 2176)]
    assert progression(spans, 128, nb) == (3, 0, 512, 1, 0, 1088, 512, 1613)
    assert progression([(256, 512, 32)], 128, nb) == (1, 256, 0, 1, 32, 0, 512, 768)
    assert progression([(0, 512, 0), (1024, 512, 1090)], 128, nb) is None  # byte stride not 16-aligned
    assert progression([(0, 512, 0), (512, 512, 528)], 128, nb) is None  # chunks overlap on the wire
    assert progression([(0, 100, 0), (512, 512, 1088)], 128, nb) is None  # a short chunk first
    assert progression([(64, 512, 0)], 128, nb) is None  # not on a group boundary
    assert progression([(0, 512, 0), (512, 512, 1088), (1536, 512, 2176), (2560, 512, 3264)], 128, nb) is None


@pytest.mark.parametrize("name", ["taco", "int5-hadamard(group_size=64,signs=auto,scale_fmt=bf16)"])
def test_chunked_launch_matches_per_chunk(name):
    """One launch over the chunks writes the bytes (and decodes the values) of one launch per chunk."""
    spec, _, opts = name.partition("(")
    kw = dict(kv.split("=") for kv in opts.rstrip(")").split(",")) if opts else {}
    kw = {k: int(v) if v.isdigit() else v for k, v in kw.items()}
    codec = taco.get_codec(spec, backend="triton", **kw)
    q, world, own = 4 * codec.group_size, 5, 2
    n = q * (world - 1) + 3 * codec.group_size // 2  # the last chunk ragged
    x = (torch.randn(n) * torch.logspace(-2, 2, n)).bfloat16()
    spans, bo = [], 0
    for j in range(world):
        k = min(q, n - j * q)
        if j != own:
            spans.append((j * q, k, bo))
            bo += -(-codec.nbytes(k) // 16) * 16
    backend = codec.kernel(x.device)
    one, each = torch.zeros(bo, dtype=torch.uint8), torch.zeros(bo, dtype=torch.uint8)
    backend.encode_chunks(codec, x, one, spans)
    for e, k, b in spans:
        backend.encode(codec, x[e : e + k], each[b : b + codec.nbytes(k)])
    assert torch.equal(one, each)
    y1, y2 = torch.zeros(n), torch.zeros(n)
    backend.decode_chunks(codec, one, y1, spans)
    for e, k, b in spans:
        backend.decode(codec, one[b : b + codec.nbytes(k)], y2[e : e + k])
    assert torch.equal(y1, y2)


def test_one_compiled_kernel_per_codec_whatever_the_sizes_and_dtypes():
    """Each launch filed under the cache key it would have on a GPU (benchmarks/gpu_check_compiles.py):
    sizes, offsets, strides, dtypes and the decode-sum-encode's variants are runtime arguments, so
    a codec needs one encode, one decode and one decode-sum-encode kernel in all."""
    from benchmarks.gpu_check_compiles import Keys

    codec = taco.get_codec("int6-hadamard", group_size=64, backend="triton")
    keys = Keys()
    try:
        for n in (64, 1000, 2 * 4096 + 77):
            for dtype in (torch.bfloat16, torch.float32, torch.float16):
                x = torch.randn(n).to(dtype)
                p = codec.encode(x)
                codec.decode(p)
                size = -(-codec.nbytes(n) // 16) * 16
                bufs = torch.zeros(3 * size, dtype=torch.uint8)
                out = torch.empty(codec.nbytes(n), dtype=torch.uint8)
                codec.decode_sum_encode(bufs, size, 3, n, dtype, own=x, own_index=1, out=out)
                codec.decode_sum_encode(bufs, size, 3, n, dtype, sum_out=torch.empty(n, dtype=dtype))
                s = torch.empty(n)
                codec.decode_sum_encode(bufs, size, 2, n, dtype, own=x, own_index=0, out=out, sum_out=s)
    finally:
        keys.close()
    per = collections.Counter(key.split(":")[0] for key in keys.keys)
    assert per == {"_encode_kernel": 1, "_decode_kernel": 1, "_decode_sum_encode_kernel": 1}, per


@pytest.mark.slow
def test_kernel_resources_sm90_no_spills(tmp_path):
    """benchmarks/kernel_resources.py: every shipped variant compiled for sm_90 (ptxas bundled with
    triton, no GPU): no spills, at most 168 registers (three CTAs of 128 threads per SM)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    script = root / "benchmarks" / "kernel_resources.py"
    cmd = [sys.executable, str(script), "--arch", "sm_90", "--json", str(tmp_path / "k.json")]
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
    last = p.stdout.strip().splitlines()[-1]
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    m = re.fullmatch(r"(\d+) kernels, max (\d+) registers, (\d+) bytes spilled", last)
    assert m and int(m[3]) == 0 and int(m[2]) <= 168 and int(m[1]) >= 3, last
