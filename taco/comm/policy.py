"""Which codec each call site uses, and the state a run of collectives keeps between calls.

Why this file exists: TP traffic differs per site (docs/design.md 1.3-1.4): a down-projection gradient
may need "none" while attention outputs take "taco", and messages below a size are cheaper
uncompressed. A `CommPolicy` holds that decision (default codec, fnmatch overrides, `min_bytes`,
`slices`) together with its `CommStats` and a `BufferCache` shared by all its sites; nothing is
global, so two policies can coexist in one process (e.g. a TP policy and a PP policy).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..codec import Codec, CodecSpec, build_codec
from .buffers import BufferCache
from .links import nvlink_class
from .stats import CommStats

DEFAULT_SLICES = 4
MIN_SLICE_BYTES = 1 << 20
ALL_REDUCE_ALGOS = ("auto", "two_shot", "gather")



def resolve_all_reduce_algo(algo: str, world: int) -> str:
    """The compressed all-reduce that `algo` means on `world` ranks: "auto" is "gather" on two ranks
    (the two-shot's bytes in one collective per slice), else "two_shot" (docs/design.md 1.3)."""
    if algo not in ALL_REDUCE_ALGOS:
        raise ValueError(f"all_reduce_algo (algo=) must be one of {ALL_REDUCE_ALGOS}, got {algo!r}")
    return ("gather" if world == 2 else "two_shot") if algo == "auto" else algo


def default_slices(
    nbytes: int, most: int = DEFAULT_SLICES, min_bytes: int = MIN_SLICE_BYTES, device=None, group=None
) -> int:
    """At most `most` slices of at least `min_bytes` each (1 for small messages); one over
    NVLink-class links (`links.nvlink_class`, given the call's device and group)."""
    if device is not None and nvlink_class(device, group):
        return 1
    return max(1, min(most, nbytes // min_bytes))


@dataclass
class CommPolicy:
    """Per-site codec choice for `taco.comm` calls made with `policy=...` and `codec` left default.

    CommPolicy(codec="taco", overrides={"layers.*.mlp.down.fwd": "none"}, min_bytes=1 << 16)
    """

    codec: CodecSpec = "taco"
    """default codec: a name, a spec string "taco(group_size=64)", a Codec, or None/"none"."""
    options: dict[str, Any] = field(default_factory=dict)
    """keyword options of the default codec, e.g. {"group_size": 64, "fmt": "e4m3"}"""
    overrides: dict[str, CodecSpec] = field(default_factory=dict)
    """site glob (fnmatch) -> codec spec; the first matching glob, in insertion order, wins"""
    min_bytes: int = 0
    """messages smaller than this (input bytes) use the plain collective"""
    slices: int = DEFAULT_SLICES
    """most pipelined slices of a compressed all-reduce, each of at least `min_slice_bytes`.
    Measured with `python -m taco.bench.comm` (gloo ranks, 1 thread each, 2-core CPU box;
    speedup over plain bf16, unsliced -> 4 slices): lo capped at 132 Mbit/s, where the codec
    encodes ~50x (41-61x) the link's bf16 element rate: 2 ranks 16 MiB 1.69x -> 1.81x, 64 MiB
    1.71x -> 1.77x; 4 ranks 16 MiB 1.86x -> 1.87x; same link, eager codec (14x): 1.41x -> 1.79x.
    Uncapped lo, where compression loses anyway: 64 MiB 0.56x -> 0.70x but 16 MiB 0.64x -> 0.58x
    and <= 1 MiB 0.38x -> 0.26x (per-collective latency), hence the 1 MiB floor."""
    min_slice_bytes: int = MIN_SLICE_BYTES
    """slices hold at least this many input bytes (smaller messages use fewer slices)"""
    all_reduce_algo: str = "auto"
    """compressed all-reduce (docs/design.md 1.3): "two_shot" (encode -> all-to-all -> decode-sum-
    encode -> all-gather -> decode, sliced), "gather" (encode all -> one all-gather -> decode-sum),
    "auto": "gather" on two ranks (the same bytes in one collective per slice, each element
    quantized once), else "two_shot" (fewer bytes from three ranks on)"""
    check_sizes: bool | None = None
    """exchange shape/dtype/codec before each call and raise ValueError on a mismatch across
    ranks (gloo would abort the process): one extra tiny collective per call, and a host sync
    on CUDA. None: on for CPU tensors, off for CUDA."""
    max_cached_bytes: int | None = None
    """most idle bytes the buffer cache keeps between calls (buffers of the calls in flight come
    on top). None: 4 x the largest message seen, a message being the larger of a compressed
    call's input and output bytes (a call's buffers are about 1.5x that: two calls' worth fit);
    an int: that many bytes; 0: buffers are never reused."""
    nonfinite_check_every: int = 16
    """check the result of every k-th call of each site (calls 1, k+1, 2k+1, ...) for NaN/Inf,
    one extra read of the result per checked call; 1: every call, 0: never (`SiteStats.checked`)"""
    observer: Callable[[str, str, torch.Tensor, Codec | None], None] | None = None
    """called at the start of every call made with this policy, before any communication, as
    `observer(site, op, x, codec)` (site: the site name, or the op name without one; x: the call's
    input, which it must not modify; codec: the one chosen, None for plain). The hook of
    calibration sampling and fidelity telemetry; it runs on the caller's stream and must not sync."""
    stats: CommStats = field(default_factory=CommStats)
    """per-site statistics of the calls made with this policy (its summary ends with the
    buffer cache's high-water line)"""
    recompute_stats: CommStats = field(default_factory=CommStats)
    """per-site statistics of the calls made while `recomputing` (activation recompute re-running a
    block's forward in backward): kept apart, so `stats` counts each site once per step"""
    buffers: BufferCache = field(init=False, repr=False)
    """send/receive buffers reused across calls and sites, capped by `max_cached_bytes`"""
    recompute: bool = field(default=False, init=False)
    """True inside `recomputing()`: calls count into `recompute_stats` and skip `observer`"""

    def __post_init__(self) -> None:
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {self.min_bytes!r}")
        if isinstance(self.slices, bool) or not isinstance(self.slices, int) or self.slices < 1:
            raise ValueError(f"slices must be an int >= 1, got {self.slices!r}")
        if not isinstance(self.min_slice_bytes, int) or self.min_slice_bytes < 1:
            raise ValueError(f"min_slice_bytes must be an int >= 1, got {self.min_slice_bytes!r}")
        resolve_all_reduce_algo(self.all_reduce_algo, 2)  # validates the name
        k = self.nonfinite_check_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"nonfinite_check_every must be an int >= 0, got {k!r}")
        self.buffers = BufferCache(self.max_cached_bytes)  # validates the cap
        self.stats.buffers = self.buffers
        self.recompute_stats.buffers = self.buffers
        # Build every codec now: a typo fails at construction, not at the first call of a site.
        self._default = build_codec(self.codec, self.options)
        self._overrides = [(glob, build_codec(spec)) for glob, spec in self.overrides.items()]
        self._logged: set[tuple[str, str]] = set()
        self._sites: dict[str, Codec | None] = {}

    @property
    def default_codec(self) -> Codec | None:
        """The codec of every site without an override (None: plain collectives)."""
        return self._default

    def set_site_codec(self, site: str, spec: CodecSpec, options: dict[str, Any] | None = None) -> None:
        """Use `spec` at exactly `site` from the next call on, ahead of every glob override.

        How calibration installs its per-site choice and the fidelity guard its fallback; the same
        call must be made on every rank of the site's group (the codec decides the wire format).
        """
        self._sites[site] = build_codec(spec, options)

    def site_codecs(self) -> dict[str, str]:
        """The exact-site codecs set with `set_site_codec` (site -> spec, "none" for plain)."""
        return {s: c.spec if c is not None else "none" for s, c in self._sites.items()}

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Calls made inside count into `recompute_stats`, not `stats`, and are not shown to the
        `observer` (calibration, telemetry and the auto policy see each site once per step). The
        codec of a site is the same as outside, so a recomputed collective returns the same bytes."""
        prev, self.recompute = self.recompute, True
        try:
            yield
        finally:
            self.recompute = prev

    def codec_for(self, site: str | None, numel: int, dtype: torch.dtype) -> Codec | None:
        """The codec for one message of `numel` elements of `dtype` at `site` (None: plain)."""
        codec = self._default
        name = site or ""
        if name in self._sites:
            codec = self._sites[name]
        else:
            for glob, c in self._overrides:
                if fnmatch.fnmatchcase(name, glob):
                    codec = c
                    break
        if codec is not None and numel * dtype.itemsize < self.min_bytes:
            return None
        return codec

    def slices_for(self, nbytes: int, device: torch.device | None = None, group=None) -> int:
        """Slices of a compressed all-reduce of `nbytes` input bytes (same on every rank): one over
        NVLink-class links (`links.nvlink_class`, given the call's device and group)."""
        return default_slices(nbytes, self.slices, self.min_slice_bytes, device, group)

    def wants_size_check(self, device: torch.device) -> bool:
        return self.check_sizes if self.check_sizes is not None else device.type != "cuda"

    def log_once(self, key: tuple[str, str]) -> bool:
        """True the first time (site, reason) is seen by this policy."""
        if key in self._logged:
            return False
        self._logged.add(key)
        return True

    def describe(self) -> str:
        codec = self._default.spec if self._default is not None else "none"
        pairs = [*self._sites.items(), *self._overrides]
        over = ", ".join(f"{g}: {c.spec if c else 'none'}" for g, c in pairs)
        return (
            f"CommPolicy(codec={codec}, overrides={{{over}}}, min_bytes={self.min_bytes}, "
            f"slices={self.slices}, min_slice_bytes={self.min_slice_bytes}, "
            f"all_reduce_algo={self.all_reduce_algo}, "
            f"max_cached_bytes={self.max_cached_bytes}, nonfinite_check_every={self.nonfinite_check_every})"
        )
