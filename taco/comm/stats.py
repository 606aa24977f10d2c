"""Per-site communication statistics: bytes each call site sent, and where its time went.

Why this file exists: whether compression pays off is decided per call site (docs/design.md 1.4):
bytes saved against codec time, fallbacks, non-finite results. The numbers live in a `CommStats`
owned by a `CommPolicy` (no global state), keyed by site name (`layers.3.mlp.down.fwd`), or by
the operation name for calls without a site. NaN/Inf results are looked for in a sample of the
calls (`CommPolicy.nonfinite_check_every`), and the summary says how many were checked.

Timing never adds device syncs on CUDA unless `CommStats(timing=True)`; on CPU every op is
synchronous, so wall-clock phases are exact and timing is on by default.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass
class SiteStats:
    """Counters of one call site (bytes are per rank: what this rank put on the wire)."""

    calls: int = 0
    """calls of the site (compressed or plain)"""
    raw_bytes: int = 0
    """bytes the plain collective in the input dtype would send from this rank for this operation"""
    wire_bytes: int = 0
    """bytes this rank actually sent (for recv: the bytes that arrived)"""
    encode_s: float = 0.0
    decode_s: float = 0.0
    """decode time, including the fused decode-sum-encode of all-reduce (its re-encode of the
    sum too) and the fused decode-sum of reduce-scatter"""
    comm_s: float = 0.0
    """time issuing transfers and blocked waiting for them"""
    fallbacks: int = 0
    """calls that wanted a codec but ran the plain collective (see the `taco.comm` log)"""
    checked: int = 0
    """calls whose floating-point result was checked for NaN/Inf: with a policy, one call in
    `CommPolicy.nonfinite_check_every` (calls 1, k+1, 2k+1, ... of the site), compressed or
    plain; results without elements or not floating-point are never checked"""
    _nonfinite: int = 0
    _pending: torch.Tensor | None = field(default=None, repr=False)

    @property
    def nonfinite(self) -> int:
        """Checked calls whose result held NaN/Inf (at least one element), out of `checked`.

        A sampled count: with k > 1 a zero says the checked calls were finite, not every call.
        On CUDA the flags of checked calls are summed on the device and read here (one host
        sync per read), never per call.
        """
        if self._pending is not None:
            self._nonfinite += int(self._pending.item())
            self._pending = None
        return self._nonfinite

    @property
    def ratio(self) -> float:
        """raw_bytes / wire_bytes: the wire saving of this site (1.0 for plain traffic)."""
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0

    def due(self, every: int) -> bool:
        """Whether the current (the `calls`-th) call of the site is checked: calls 1, 1+every, ..."""
        return every > 0 and (self.calls - 1) % every == 0

    def note_result(self, y: torch.Tensor) -> None:
        """Check one call's result for NaN/Inf: one reduction (`aminmax`, NaN-propagating) reading
        y once, no full-size temporary, no host sync on CUDA (the flag is summed on the device)."""
        if y.numel() == 0 or not y.is_floating_point() or y.layout != torch.strided:
            return
        self.checked += 1
        lo, hi = torch.aminmax(y)
        bad = torch.logical_not(torch.logical_and(torch.isfinite(lo), torch.isfinite(hi)))
        if y.device.type == "cpu":
            self._nonfinite += int(bad)
        else:
            bad = bad.to(torch.int64)
            self._pending = bad if self._pending is None else self._pending.add_(bad)

    def add(self, other: SiteStats) -> None:
        for f in fields(self):
            if not f.name.startswith("_"):
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self._nonfinite += other.nonfinite


class Clock:
    """`with clock("encode_s"):` adds the block's wall time to a SiteStats field when enabled."""

    def __init__(self, site: SiteStats | None, enabled: bool, device: torch.device) -> None:
        self.site = site if enabled else None
        self.sync = enabled and device.type == "cuda"

    def __call__(self, what: str) -> Any:
        return nullcontext() if self.site is None else _Timed(self, what)


def sync_device(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU, where every op is synchronous);
    for timing outside the hot path only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timed:
    def __init__(self, clock: Clock, what: str) -> None:
        self.clock, self.what = clock, what

    def __enter__(self) -> None:
        if self.clock.sync:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.clock.sync:
            torch.cuda.synchronize()
        site = self.clock.site
        setattr(site, self.what, getattr(site, self.what) + time.perf_counter() - self.t0)


class CommStats:
    """Statistics of every site of one policy: `stats["layers.0.attn.out.fwd"].wire_bytes`."""

    def __init__(self, timing: bool | None = None) -> None:
        self.timing = timing
        """True: time phases (syncing CUDA around each); False: never; None: CPU only"""
        self.sites: dict[str, SiteStats] = {}
        self.buffers: Any = None
        """the owning policy's `BufferCache` (set by `CommPolicy`): its line ends the summary"""

    def site(self, name: str) -> SiteStats:
        s = self.sites.get(name)
        if s is None:
            s = self.sites[name] = SiteStats()
        return s

    def __getitem__(self, name: str) -> SiteStats:
        return self.sites[name]

    def __contains__(self, name: object) -> bool:
        return name in self.sites

    def __iter__(self) -> Iterator[str]:
        return iter(self.sites)

    def clock(self, site: SiteStats, device: torch.device) -> Clock:
        on = self.timing if self.timing is not None else device.type != "cuda"
        return Clock(site, on, device)

    def total(self) -> SiteStats:
        t = SiteStats()
        for s in self.sites.values():
            t.add(s)
        return t

    def reset(self) -> None:
        self.sites.clear()

    def summary(self) -> str:
        """A fixed-width table, one row per site and a total row, then the buffer line.

        `checked` and `nonfin` are the calls whose result was checked for NaN/Inf and those
        that held one (see `SiteStats.checked`); the last line is `BufferCache.describe()`:
        "buffers: high-water X MiB held, Y MiB cached (cap Z MiB[, auto 4 x largest message])".
        """
        head = ("site", "calls", "raw MB", "wire MB", "ratio")
        head += ("enc ms", "dec ms", "comm ms", "fallback", "checked", "nonfin")
        rows = [(name, s) for name, s in sorted(self.sites.items())] + [("total", self.total())]
        width = max([len(head[0])] + [len(n) for n, _ in rows])
        lines = [f"{head[0]:<{width}} " + " ".join(f"{h:>8}" for h in head[1:])]
        for name, s in rows:
            vals = (
                f"{s.calls:>8d}",
                f"{s.raw_bytes / 1e6:>8.3f}",
                f"{s.wire_bytes / 1e6:>8.3f}",
                f"{s.ratio:>8.2f}",
                f"{s.encode_s * 1e3:>8.1f}",
                f"{s.decode_s * 1e3:>8.1f}",
                f"{s.comm_s * 1e3:>8.1f}",
                f"{s.fallbacks:>8d}",
                f"{s.checked:>8d}",
                f"{s.nonfinite:>8d}",
            )
            lines.append(f"{name:<{width}} " + " ".join(vals))
        if self.buffers is not None:
            lines.append(self.buffers.describe())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CommStats({len(self.sites)} sites, timing={self.timing})"
