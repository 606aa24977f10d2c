"""The compressed collectives' real device path in one process, with loopback stand-ins for the transfers.

Why this file exists: on a machine with one GPU no NCCL group of two ranks can be made, yet the
compressed path's CUDA machinery (the codec side stream `Lane`, the events that order it after the
caller's stream and the caller after it, `record_stream` of tensors that cross streams, the buffer
cache reused by back-to-back calls) is what goes wrong first on a GPU (docs/design.md 1.3
"Streams (CUDA)"). Here one process plays rank `rank` of a `world`-rank group: the group queries are
patched and the two transfers the compressed path makes are replaced by stand-ins that behave like
NCCL's: each runs on its own "comm" stream after an event of the issuing stream, holds its tensors
with `record_stream`, starts after a sleep kernel (so a consumer that does not wait reads stale
bytes), and its `Work.wait()` orders the waiting stream after it without blocking the host.

Loopback semantics (what the result must be, computed exactly in the test):
- all-gather: every rank sent what this rank sent (all ranks hold this rank's input);
- all-to-all: the part received from rank j is the part this rank addressed to j (rank j's
  piece for us equals our piece for j); the splits must be symmetric.
So a two-shot all-reduce of x returns, in every chunk, the sum of x's N chunks; the gather all-reduce
N * x; reduce-scatter the sum of the N pieces; all-gather N copies of x. Each result's SQNR against that
exact value must be within 1 dB of the eager reference codec's on the CPU under the same stand-ins.
On CPU (the default suite) the harness runs the native kernels against the eager reference, which
keeps it honest; on CUDA (benchmarks/gpu_check.sh) the Triton kernels with real streams.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import taco
from taco import comm
from taco.codec.specs import parse_spec
from taco.comm import call, compressed

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SPECS = ["taco", "int8-hadamard", "int6-hadamard", "int4-hadamard(signs=true)"]


class _Work:
    def __init__(self, done: torch.cuda.Event | None) -> None:
        self.done = done

    def wait(self) -> bool:
        if self.done is not None:  # like NCCL's work: the waiting stream waits, the host does not
            torch.cuda.current_stream().wait_event(self.done)
        return True


class Loopback:
    """Play rank `rank` of `world` in this process; transfers are local copies (module docstring)."""

    def __init__(self, world: int, rank: int, device: torch.device, delay_us: float = 200.0) -> None:
        self.world, self.rank, self.device = world, rank, device
        self.comm_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.delay_cycles = int(delay_us * 1.5e3)  # ~1.5 GHz: the order of magnitude is what matters
        self.calls = 0

    def _transfer(self, copy, *tensors: torch.Tensor) -> _Work:
        self.calls += 1
        if self.comm_stream is None:
            copy()
            return _Work(None)
        self.comm_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.comm_stream):
            for t in tensors:
                t.record_stream(self.comm_stream)
            torch.cuda._sleep(self.delay_cycles)
            copy()
            done = torch.cuda.Event()
            done.record(self.comm_stream)
        return _Work(done)

    def all_gather_into(self, out, inp, group=None, async_op=False):
        n = inp.numel()
        assert out.numel() == n * self.world, (out.numel(), n, self.world)
        every = lambda: out.view(self.world, n).copy_(inp.view(1, n).expand(self.world, n))  # noqa: E731
        work = self._transfer(every, out, inp)
        return work if async_op else work.wait()

    def all_to_all_single(self, out, inp, out_splits=None, in_splits=None, group=None, async_op=False):
        assert list(out_splits) == list(in_splits), "loopback all-to-all needs symmetric splits"
        work = self._transfer(lambda: out.copy_(inp), out, inp)
        return work if async_op else work.wait()

    def __enter__(self) -> Loopback:
        self._stack = ExitStack()
        patches = [
            mock.patch.object(dist, "get_world_size", lambda group=None: self.world),
            mock.patch.object(dist, "get_rank", lambda group=None: self.rank),
            mock.patch.object(dist, "all_to_all_single", self.all_to_all_single),
            mock.patch.object(compressed, "all_gather_into", self.all_gather_into),
            mock.patch.object(call, "all_gather_into", self.all_gather_into),  # the size check
        ]
        for p in patches:
            self._stack.enter_context(p)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double().cpu(), got.double().cpu()
    err = (ref - got).pow(2).sum().item()
    return math.inf if err == 0 else 10 * math.log10(ref.pow(2).sum().item() / err)


def codec_for(spec: str, device: torch.device):
    """The codec under test: Triton on CUDA, native on CPU; the reference: eager on the CPU."""
    name, opts = parse_spec(spec)
    backend = "triton" if device.type == "cuda" else "native"
    return taco.get_codec(name, **opts, backend=backend), taco.get_codec(name, **opts, backend="eager")


def busy_input(src: torch.Tensor) -> torch.Tensor:
    """`src` copied on the caller's stream behind a sleep kernel: a side stream that does not wait
    for the caller's stream reads the copy before it is written."""
    if src.device.type == "cuda":
        torch.cuda._sleep(300_000)
    return src.clone()


def run_op(op: str, x: torch.Tensor, codec, world: int, rank: int, policy=None, **kw) -> torch.Tensor:
    with Loopback(world, rank, x.device):
        if op == "all_reduce":
            h = comm.all_reduce(busy_input(x), codec=codec, async_op=True, policy=policy, **kw)
            return h.wait()
        if op == "reduce_scatter":
            return comm.reduce_scatter(busy_input(x), codec=codec, dim=kw.get("dim", 0))
        return comm.all_gather(busy_input(x), codec=codec, dim=kw.get("dim", 0))


def exact(op: str, x: torch.Tensor, world: int, algo: str = "two_shot", dim: int = 0) -> torch.Tensor:
    xf = x.double()
    if op == "all_reduce":
        if algo == "gather":
            return xf * world
        total = xf.reshape(world, -1).sum(0)
        return total.repeat(world).view(x.shape)
    if op == "reduce_scatter":
        return sum(xf.chunk(world, dim=dim))
    return torch.cat([xf] * world, dim=dim)


CASES = [  # (op, world, rank, extra keyword arguments)
    ("all_reduce", 4, 1, {"algo": "two_shot", "slices": 1}),
    ("all_reduce", 4, 3, {"algo": "two_shot", "slices": 3}),
    ("all_reduce", 8, 5, {"algo": "two_shot", "slices": 2}),
    ("all_reduce", 2, 0, {"algo": "gather", "slices": 2}),
    ("reduce_scatter", 4, 2, {"dim": 0}),
    ("all_gather", 4, 1, {"dim": 0}),
    ("all_gather", 2, 1, {"dim": 1}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-N{c[1]}-{c[3]}")
def test_loopback_collective_matches_reference(device, spec, case):
    op, world, rank, kw = case
    dev = torch.device(device)
    codec, ref_codec = codec_for(spec, dev)
    torch.manual_seed(world * 10 + rank)
    x = (torch.randn(16, 8 * world, 96) * torch.linspace(0.1, 3, 96)).to(torch.bfloat16)
    want = exact(op, x, world, kw.get("algo", "two_shot"), kw.get("dim", 0))
    ref = run_op(op, x, ref_codec, world, rank, **kw)
    got = run_op(op, x.to(dev), codec, world, rank, **kw)
    assert got.device.type == dev.type and got.dtype == x.dtype and got.shape == want.shape
    floor, mine = sqnr_db(want, ref), sqnr_db(want, got)
    assert mine >= floor - 1.0, f"{op} {spec} on {device}: {mine:.2f} dB against the reference's {floor:.2f}"


@pytest.mark.parametrize("device", DEVICES)
def test_loopback_back_to_back_calls_reuse_buffers_safely(device):
    """Four all-reduces in flight at once through one policy (its buffer cache hands each call's
    buffers to the next as soon as they are given back); every input freed right after its call and
    its memory overwritten: results must still be each input's own."""
    dev = torch.device(device)
    codec, _ = codec_for("int6-hadamard", dev)
    policy = comm.CommPolicy(codec=codec, check_sizes=False)
    world, rank = 4, 2
    srcs = [torch.randn(64, 1024).to(torch.bfloat16) * (k + 1) for k in range(4)]
    with Loopback(world, rank, dev) as lb:
        handles = []
        for s in srcs:
            x = busy_input(s.to(dev))
            handles.append(comm.all_reduce(x, policy=policy, async_op=True, algo="two_shot", slices=2))
            del x
            torch.full((64 * 1024,), float("nan"), dtype=torch.bfloat16, device=dev)  # reuse freed memory
        outs = [h.wait() for h in handles]
        assert lb.calls == 4 * 2 * 2  # per slice one all-to-all and one all-gather
    for s, out in zip(srcs, outs):
        want = exact("all_reduce", s, world)
        assert torch.isfinite(out).all()
        assert sqnr_db(want, out) > 25.0


@pytest.mark.parametrize("device", DEVICES)
def test_loopback_sees_a_missing_wait(device):
    """The harness can fail: a consumer that reads a transfer's output without `wait()` reads the
    stale buffer on CUDA (the transfer sleeps first); on the CPU the copy is synchronous."""
    dev = torch.device(device)
    with Loopback(2, 0, dev, delay_us=20_000) as lb:  # 20 ms: longer than any host-side hiccup
        inp = torch.ones(1 << 16, device=dev)
        out = torch.zeros(2 << 16, device=dev)
        out.sum()  # load the reduction kernel before the race is set up (lazy module loading)
        work = lb.all_gather_into(out, inp, async_op=True)
        early = out.sum()  # no wait: on CUDA this runs before the delayed copy
        work.wait()
        late = out.sum()
    assert late.item() == 2 << 16
    if dev.type == "cuda":
        assert early.item() == 0
