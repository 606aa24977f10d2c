"""A bounded cache of the uint8 send/receive buffers of compressed calls.

Why this file exists: every compressed call needs encode/transfer buffers of about 1.5x its
message. Keeping one set per call site never frees anything: at 40 layers x 4 sites of a large
TP message that is ~10 GB per GPU that activations cannot use. This cache shares idle buffers
between all sites of a policy (sites of one model mostly send the same sizes, one after the
other) and bounds the idle bytes it keeps, so the extra memory of the calls is about the calls
in flight plus a cap, whatever the number of sites.

CUDA ordering assumption: a call gives a buffer back after the host has enqueued its last use
(after `work.wait()`, which orders the current stream after the transfer) and the next call
that takes it enqueues its own uses later on the same current stream, so the stream orders the
two uses without a host sync. Compressed calls take, use and give their buffers inside their
`Lane` (`streams.py`), i.e. on the codec side stream of their (device, communicator), and
pass that communicator as the buffer's `lane`: a buffer given back on one lane is only taken
again on the same lane, so one stream orders every use of it (two communicators' streams never
share one); a buffer dropped from the cache goes back to torch's caching allocator, which is
stream-ordered in the same way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable

import torch

AUTO_CAP_FACTOR = 4
"""without a fixed cap, idle buffers may hold this many times the largest message (or request)"""
SMALL_BYTES = 4096
"""requests up to this size round up to 512-byte multiples"""
_Key = tuple[str, int, str, Hashable]
"""(role, size class, device, lane)"""


def bucket_bytes(nbytes: int) -> int:
    """The size class a request of `nbytes` is served from (the bytes actually allocated).

    Up to 4 KiB: a multiple of 512 bytes. Above: 4 classes per power of two (5/8, 6/8, 7/8, 8/8
    of the next power of two), so a buffer is less than 25% larger than the request and messages
    of slightly different sizes (ragged slices, sites of similar shapes) reuse the same buffers.
    """
    if nbytes < 0:
        raise ValueError(f"buffer size must be >= 0, got {nbytes}")
    if nbytes <= SMALL_BYTES:
        return max(512, -(-nbytes // 512) * 512)
    step = 1 << ((nbytes - 1).bit_length() - 3)
    return -(-nbytes // step) * step


class BufferCache:
    """uint8 buffers reused across calls and sites, keyed by (role, size class, device, lane).

    `take(role, nbytes, device)` returns an `nbytes` view of a buffer of `bucket_bytes(nbytes)`;
    `give(role, view)` returns it once its transfers are waited on. A taken buffer is not in the
    free list until given back, so two calls in flight never share one. Given-back (idle)
    buffers are kept up to `cap` bytes: when a give pushes the idle bytes over it, the least
    recently given idle buffers are dropped (the one just given last of all).

    max_cached_bytes: None = `AUTO_CAP_FACTOR` x the largest message noted (`note_message`) or,
    without messages, the largest request; an int = a fixed cap in bytes (0: nothing is reused).

    Counters (bytes of the size classes, i.e. what is allocated): `allocated_bytes` (ever
    allocated), `in_use_bytes` (taken, not given back), `cached_bytes` (idle), and the
    high-water marks `held_high_water` (in use + idle) and `cached_high_water` (idle).
    """

    def __init__(self, max_cached_bytes: int | None = None) -> None:
        cap = max_cached_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"max_cached_bytes must be None or an int >= 0, got {max_cached_bytes!r}")
        self.max_cached_bytes = max_cached_bytes
        self.allocated_bytes = 0
        self.in_use_bytes = 0
        self.cached_bytes = 0
        self.held_high_water = 0
        self.cached_high_water = 0
        self.largest_request = 0
        """largest size class taken"""
        self.largest_message = 0
        """largest message (bytes) a call noted with `note_message`"""
        self._free: dict[_Key, list[torch.Tensor]] = {}
        # idle buffers, least recently given first: id(buffer) -> (key, buffer)
        self._lru: OrderedDict[int, tuple[_Key, torch.Tensor]] = OrderedDict()
        # taken views: id(view) -> (key, buffer, view); holding the view keeps its id unique
        self._taken: dict[int, tuple[_Key, torch.Tensor, torch.Tensor]] = {}
        # take/give may come from two threads (the asynchronous DDP hook's worker shares a policy)
        self._lock = threading.Lock()

    @property
    def cap(self) -> int:
        """The most idle bytes kept now (the auto cap grows with the messages seen)."""
        if self.max_cached_bytes is not None:
            return self.max_cached_bytes
        return AUTO_CAP_FACTOR * max(self.largest_message, self.largest_request)

    def note_message(self, nbytes: int) -> None:
        """Record a call's message size (the larger of its input and output bytes) for the auto cap."""
        self.largest_message = max(self.largest_message, nbytes)

    def take(self, role: str, nbytes: int, device: torch.device, lane: Hashable = None) -> torch.Tensor:
        """A contiguous uint8 tensor of `nbytes` on `device`, not used by any other caller until given.

        `lane`: what orders the buffer's uses on the device (compressed calls: their communicator,
        whose side stream runs them); only a buffer given back on the same lane is reused."""
        with self._lock:
            size = bucket_bytes(nbytes)
            key = (role, size, str(torch.device(device)), lane)
            self.largest_request = max(self.largest_request, size)
            free = self._free.get(key)
            if free:
                buf = free.pop()
                del self._lru[id(buf)]
                self.cached_bytes -= size
            else:
                buf = torch.empty(size, dtype=torch.uint8, device=device)
                self.allocated_bytes += size
            view = buf[:nbytes]
            self._taken[id(view)] = (key, buf, view)
            self.in_use_bytes += size
            self.held_high_water = max(self.held_high_water, self.in_use_bytes + self.cached_bytes)
            return view

    def give(self, role: str, view: torch.Tensor) -> None:
        """Return a tensor `take(role, ...)` returned; it may be dropped to respect the cap."""
        with self._lock:
            entry = self._taken.get(id(view))
            if entry is None or entry[2] is not view:
                raise ValueError("BufferCache.give: not a buffer taken from this cache (or given twice)")
            key, buf, _ = entry
            if key[0] != role:
                raise ValueError(f"BufferCache.give: buffer taken as {key[0]!r}, given back as {role!r}")
            del self._taken[id(view)]
            size = key[1]
            self.in_use_bytes -= size
            self._free.setdefault(key, []).append(buf)
            self._lru[id(buf)] = (key, buf)
            self.cached_bytes += size
            cap = self.cap
            while self.cached_bytes > cap:
                _, (old_key, old) = self._lru.popitem(last=False)
                free = self._free[old_key]
                free.pop(next(i for i, b in enumerate(free) if b is old))
                self.cached_bytes -= old_key[1]
            self.cached_high_water = max(self.cached_high_water, self.cached_bytes)

    def describe(self) -> str:
        """One line for `CommStats.summary()`: high-water marks and the cap, in MiB."""
        mib = 1 << 20
        cap = f"cap {self.cap / mib:.2f} MiB"
        if self.max_cached_bytes is None:
            cap += f", auto {AUTO_CAP_FACTOR} x largest message"
        return (
            f"buffers: high-water {self.held_high_water / mib:.2f} MiB held, "
            f"{self.cached_high_water / mib:.2f} MiB cached ({cap})"
        )

    def __repr__(self) -> str:
        return (
            f"BufferCache(in_use={self.in_use_bytes}, cached={self.cached_bytes}, cap={self.cap}, "
            f"held_high_water={self.held_high_water})"
        )
