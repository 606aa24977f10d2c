"""Alpha-beta cost model of a training step whose TP collectives may be compressed (docs/design.md 1.3-1.5).

Why this file exists: the emulated runs of `cluster.py` measure one small CPU box; this model,
validated on them (predicted vs measured step time), carries the same mechanism to GPU clusters
(`gpu_projection.py` applies it there under stated assumptions).

Ingredients, each a measured or stated number:
- `Link(bandwidth, alpha)`: time(m bytes) = alpha + m / bandwidth per hop. `shared=True` is a bus
  that every rank's bytes cross one after another (the emulated `lo` under `tc`): it serialises
  the N ranks' traffic, so a collective's time uses the sum of all ranks' bytes.
- `CodecCost`: wire bytes per element and encode/decode elements/s (measured: `taco bench codec`,
  or inside training by `cluster_analysis.py`; on GPUs an assumption, e.g. a fraction of HBM
  bandwidth).
- compute: seconds per step measured (emulation) or FLOPs / achieved FLOP/s (projection).

Collectives (N ranks, message of n elements, M = n * elem_bytes, C = n * codec bytes/elem):
plain all-reduce is a ring: 2(N-1) hops, 2(N-1)/N M bytes per rank; compressed all-reduce is
two-shot: all-to-all + all-gather (N hops), 2(N-1)/N C bytes per rank, n elements encoded and
(2N-1)/N n decoded (N-1 received chunks + the N gathered chunks); on two ranks the gather
all-reduce that "auto" takes there: one all-gather (N-1 hops) of (N-1) C bytes, n encoded, N n
decoded. Reduce-scatter / all-gather (sequence parallelism) move (N-1)/N of the bytes each.
Coding and wire overlap across k slices: time = max(wire, code) + min(wire, code) / k (k = 1: they
add).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from taco.comm.policy import resolve_all_reduce_algo

__all__ = ["CodecCost", "CollectiveTime", "Link", "Message", "collective_time", "gbit", "ideal_speedup",
           "ideal_overlap_speedup", "overlapped_step", "step_time_measured_compute"]  # fmt: skip

# ----------------------------------------------------------------------------- building blocks


@dataclass(frozen=True)
class Link:
    """One direction of a link: a hop of m bytes takes alpha + m / bandwidth seconds."""

    name: str
    bandwidth: float
    """bytes/s per rank and direction (`shared`: of the whole medium)"""
    alpha: float = 0.0
    """seconds per hop (latency and per-message software cost)"""
    shared: bool = False
    """every rank's bytes cross one medium in turn (the emulated lo): bytes of all ranks add up"""
    burst: float = 0.0
    """bytes a token bucket (the emulated tc tbf) passes at once after an idle gap, credited once
    per collective: the compute before it refills the bucket (0 for real links)"""
    wait: float = 0.0
    """seconds per collective of fixed cost that data in flight can hide: the ranks waiting for each
    other (skew) and software latency, measured on the uncapped emulation. The rank that arrives
    first sends its first-phase bytes meanwhile, so only the wait beyond their time shows."""

    def transfer(self, per_rank_bytes: float, world: int, hops: int, first_bytes: float = 0.0) -> float:
        """Seconds for `hops` latency terms plus `per_rank_bytes` from each of `world` ranks;
        `first_bytes`: what one rank can send before it needs anything from the others."""
        total = per_rank_bytes * (world if self.shared else 1)
        wire = hops * self.alpha + max(0.0, total - self.burst) / self.bandwidth
        return wire + max(0.0, self.wait - first_bytes / self.bandwidth)


def gbit(rate_gbit_s: float) -> float:
    """Bytes/s of a link rated in Gbit/s."""
    return rate_gbit_s * 1e9 / 8


@dataclass(frozen=True)
class CodecCost:
    """A codec as the model sees it: wire bytes per element and elements/s of encode and decode."""

    name: str
    bytes_per_elem: float
    encode_rate: float
    """elements/s"""
    decode_rate: float
    """elements/s, including the fp32 sum where the collective reduces"""


@dataclass(frozen=True)
class CollectiveTime:
    wire_s: float
    code_s: float
    total_s: float


OPS = ("all_reduce", "reduce_scatter", "all_gather", "send")


def _gather(op: str, world: int, algo: str) -> bool:
    """Whether a compressed all-reduce runs as the gather all-reduce (`taco.comm.all_reduce` algo)."""
    return op == "all_reduce" and resolve_all_reduce_algo(algo, world) == "gather"


def _traffic(op: str, world: int, algo: str = "auto") -> tuple[float, int, float, float]:
    """(per-rank bytes, hops, encoded elements, decoded elements), per byte/element of the message.

    The message is the full tensor of n elements (all-reduce input, reduce-scatter input,
    all-gather output, or the p2p tensor); these are the compressed algorithms' counts, and the
    plain ones use the same bytes with the ring's hop count (see `collective_time`).
    """
    n = world
    if _gather(op, n, algo):  # one all-gather of every rank's encoded message, N decoded
        return n - 1.0, n - 1, 1.0, float(n)
    if op == "all_reduce":
        return 2 * (n - 1) / n, n, 1.0, (2 * n - 1) / n
    if op == "reduce_scatter":
        return (n - 1) / n, 1, (n - 1) / n, (n - 1) / n
    if op == "all_gather":
        return (n - 1) / n, n - 1, 1 / n, 1.0
    if op == "send":
        return 1.0, 1, 1.0, 1.0
    raise ValueError(f"unknown collective {op!r}: use one of {', '.join(OPS)}")


def collective_time(
    op: str,
    numel: int,
    elem_bytes: float,
    world: int,
    link: Link,
    codec: CodecCost | None = None,
    slices: int = 1,
    algo: str = "auto",
) -> CollectiveTime:
    """Time of one collective of `numel` elements of `elem_bytes` each over `world` ranks.

    codec None: the plain collective (ring all-reduce: 2(N-1) hops); otherwise the compressed
    algorithm of docs/design.md 1.3 (all-reduce: `algo` as `taco.comm.all_reduce` takes it) with
    `slices` pipelined slices overlapping coding and wire.
    """
    if world < 1 or slices < 1:
        raise ValueError(f"world and slices must be >= 1, got world={world}, slices={slices}")
    if world == 1 and op != "send" or numel == 0:
        return CollectiveTime(0.0, 0.0, 0.0)
    per_byte, hops, enc, dec = _traffic(op, world, algo)
    # What one rank can send before it needs the others' data (hides `link.wait`): one ring step's
    # chunk for the plain ring collectives; the all-to-all half of the two-shot all-reduce, or all
    # of a gather all-reduce (two ranks) / compressed reduce-scatter / all-gather / send.
    if codec is None:
        steps = 2 * (world - 1) if op == "all_reduce" else (world - 1 if op != "send" else 1)
        per_rank = per_byte * numel * elem_bytes
        wire = link.transfer(per_rank, world, steps, per_rank / steps)
        return CollectiveTime(wire, 0.0, wire)
    per_rank = per_byte * numel * codec.bytes_per_elem
    first = per_rank / 2 if op == "all_reduce" and not _gather(op, world, algo) else per_rank
    wire = link.transfer(per_rank, world, hops, first)
    code = enc * numel / codec.encode_rate + dec * numel / codec.decode_rate
    total = max(wire, code) + min(wire, code) / slices
    return CollectiveTime(wire, code, total)


def ideal_speedup(f: float, r: float) -> float:
    """Amdahl's bound: a step whose share f is communication that shrinks r times, coding free."""
    if not 0.0 <= f <= 1.0 or r <= 0:
        raise ValueError(f"need 0 <= f <= 1 and r > 0, got f={f}, r={r}")
    return 1.0 / (1.0 - f + f / r)


def ideal_overlap_speedup(f: float, r: float) -> float:
    """The bound with the remaining transfer also hidden under compute: 1 / max(1 - f, f / r)."""
    if not 0.0 <= f <= 1.0 or r <= 0:
        raise ValueError(f"need 0 <= f <= 1 and r > 0, got f={f}, r={r}")
    return 1.0 / max(1.0 - f, f / r)


def overlapped_step(busy_s: float, wire_s: float, pieces: int) -> float:
    """Step seconds with batch-split overlap (docs/design.md 1.3 "Overlap across pieces"): `busy_s`
    is what the host or compute stream does (compute and any coding that runs there), `wire_s` the
    transfers. k pieces taking turns form a two-stage pipeline, one piece's transfer under another
    piece's compute: max(busy, wire) + min(busy, wire) / k (k = 1: they add)."""
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    return max(busy_s, wire_s) + min(busy_s, wire_s) / pieces


# ----------------------------------------------------------------------------- emulated step


@dataclass(frozen=True)
class Message:
    """One collective of a step: op, elements and bytes per element of its input dtype."""

    op: str
    numel: int
    elem_bytes: float


def step_time_measured_compute(
    compute_s: float,
    messages: list[Message],
    world: int,
    link: Link,
    codec: CodecCost | Mapping[float, CodecCost] | None = None,
    slices: int = 1,
    algo: str = "auto",
    pieces: int = 1,
) -> tuple[float, float]:
    """(step seconds, communication seconds) of a step whose non-communication time is measured;
    `pieces` > 1: with batch-split overlap of that many pieces (`overlapped_step`).

    Used to validate the model on the emulated runs: compute_s comes from the uncapped run,
    the messages from the run's site statistics, the link from a probe of the capped lo.
    `codec` may map a message's bytes per element (2: bf16, 4: fp32) to that input's coding cost.
    """
    comm = wire = 0.0
    for m in messages:
        c = codec.get(m.elem_bytes) if isinstance(codec, Mapping) else codec
        t = collective_time(m.op, m.numel, m.elem_bytes, world, link, c, slices, algo)
        comm, wire = comm + t.total_s, wire + t.wire_s
    if pieces > 1:  # the wire hides under the other pieces' compute; coding stays on the host
        return overlapped_step(compute_s + comm - wire, wire, pieces), comm
    return compute_s + comm, comm
