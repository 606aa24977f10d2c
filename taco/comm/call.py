"""One collective call's resolved arguments, shared by the collectives and point-to-point transfers.

Why this file exists: `collectives.py` (all-reduce, all-gather, reduce-scatter) and `p2p.py`
(send/recv) resolve their arguments the same way: the group's size and rank, the codec (the
argument when given; else the policy's for the site, or "taco" without a policy), the checks
(sizes across ranks, dtype and axis), the site's statistics and the buffers. `Call` does it once
for both, so neither reaches into the other's internals.
"""

from __future__ import annotations

import enum
import functools
import logging
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..codec import Codec, CodecSpec, build_codec
from ..codec.base import FLOAT_DTYPES, check_axis
from .buffers import BufferCache
from .compressed import Ctx, all_gather_into
from .handles import Handle, Steps
from .policy import CommPolicy
from .stats import Clock

log = logging.getLogger("taco.comm")
Group = dist.ProcessGroup | None


class PolicyOrTaco(enum.Enum):
    """Type of the default `codec` argument (a sentinel that is not a codec name)."""

    DEFAULT = "the policy's codec for the site, else 'taco'"

    def __repr__(self) -> str:
        return f"<{self.value}>"


# The default `codec`: with a `policy`, the policy chooses per site; without one, "taco". Any codec
# passed explicitly (a name such as "taco", a Codec, None) is used as given, policy or not.
DEFAULT_CODEC = PolicyOrTaco.DEFAULT
# (site, reason) pairs already logged by calls made without a policy (log de-duplication only;
# calls with a policy de-duplicate in the policy).
_LOGGED_WITHOUT_POLICY: set[tuple[str, str]] = set()


@functools.lru_cache(maxsize=64)
def _named_codec(spec: str) -> Codec | None:
    return build_codec(spec)


class Call:
    """One call's resolved arguments: group facts, codec, statistics and buffers."""

    def __init__(
        self,
        op: str,
        x: torch.Tensor,
        group: Group,
        codec: CodecSpec | PolicyOrTaco,
        site: str | None,
        policy: CommPolicy | None,
    ) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"taco.comm.{op}: expected a torch.Tensor, got {type(x).__name__}")
        if policy is not None and not isinstance(policy, CommPolicy):
            raise TypeError(f"policy must be a taco.comm.CommPolicy, got {type(policy).__name__}")
        self.op, self.x, self.group, self.policy = op, x, group, policy
        self.name = site or op
        if isinstance(codec, PolicyOrTaco):
            self.codec = policy.codec_for(site, x.numel(), x.dtype) if policy else _named_codec("taco")
        else:
            self.codec = _named_codec(codec) if isinstance(codec, str) else build_codec(codec)
        if self.codec is not None and not x.is_floating_point():
            raise TypeError(
                f"taco.comm.{op} (site {self.name!r}): codec {self.codec.spec!r} compresses float "
                f"tensors, got {x.dtype}; send integer/bool/complex tensors uncompressed with "
                "codec='none' (or a policy override for this site)"
            )
        if self.codec is not None:
            check_axis(self.codec, x.shape)  # before any communication, like every argument check
        replay = policy is not None and policy.recompute  # activation recompute: counted apart
        if policy is not None and policy.observer is not None and not replay:
            policy.observer(self.name, op, x, self.codec)
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"taco.comm.{op}: this rank is not a member of the given group")
        stats = None if policy is None else policy.recompute_stats if replay else policy.stats
        self.site = stats.site(self.name) if stats is not None else None
        if self.site is not None:
            self.site.calls += 1
        # sampled NaN/Inf check of the result, decided now (async results arrive out of order)
        self.check = self.site is not None and not replay and self.site.due(policy.nonfinite_check_every)
        self.clock = stats.clock(self.site, x.device) if stats is not None else Clock(None, False, x.device)
        if self.codec is not None and x.dtype not in FLOAT_DTYPES:
            self.fallback(f"dtype {x.dtype} is not supported by the codecs")
        elif self.codec is not None and x.layout != torch.strided:
            self.fallback(f"layout {x.layout} is not supported by the codecs")

    def fallback(self, reason: str) -> None:
        """Use the plain collective for this call; log once per (site, reason)."""
        self.codec = None
        if self.site is not None:
            self.site.fallbacks += 1
        key = (self.name, reason)
        if self.policy is not None:
            first = self.policy.log_once(key)
        else:
            first = key not in _LOGGED_WITHOUT_POLICY
            _LOGGED_WITHOUT_POLICY.add(key)
        if first:
            log.warning("taco.comm.%s site %r: %s; using the plain collective", self.op, self.name, reason)

    def check_same(self, extra: str = "") -> None:
        """Raise ValueError on every rank if the operation, shape, dtype, codec or `extra` (dim,
        slices) differ (`CommPolicy.check_sizes`): ranks in different collectives would hang."""
        if not self.wants_check() or self.world == 1:
            return
        desc = f"{self.op} {self.describe(extra)}"  # the operation too: all_gather vs reduce_scatter
        mine = torch.tensor([zlib.crc32(desc.encode())], dtype=torch.int64, device=self.x.device)
        every = torch.empty(self.world, dtype=torch.int64, device=self.x.device)
        all_gather_into(every, mine, group=self.group)
        if bool((every != every[0]).any()):
            descs: list = [None] * self.world
            dist.all_gather_object(descs, desc, group=self.group)
            lines = "; ".join(f"rank {i}: {d}" for i, d in enumerate(descs))
            raise ValueError(
                f"taco.comm.{self.op}: ranks disagree on the message ({lines}); every rank of the "
                "group must make the same collective call (operation, shape, dtype, codec, dim) in "
                "the same order"
            )

    def wants_check(self) -> bool:
        if self.policy is not None:
            return self.policy.wants_size_check(self.x.device)
        return self.x.device.type != "cuda"

    def describe(self, extra: str = "") -> str:
        codec = self.codec.spec if self.codec is not None else "none"
        return f"shape={tuple(self.x.shape)} dtype={self.x.dtype} codec={codec}{extra}"

    def account(self, raw: int, wire: int | None = None) -> None:
        """Add raw bytes, and wire bytes (default: raw for the plain path; the compressed path
        counts what it sends as it sends it)."""
        if self.site is not None:
            self.site.raw_bytes += raw
            self.site.wire_bytes += wire if wire is not None else raw if self.codec is None else 0

    def ctx(self, message_bytes: int) -> Ctx:
        """The compressed path's context; `message_bytes` (the larger of the call's input and
        output) sets the buffer cache's automatic cap. Calls without a policy reuse nothing."""
        buffers = self.policy.buffers if self.policy is not None else BufferCache(max_cached_bytes=0)
        buffers.note_message(message_bytes)
        return Ctx(self.group, self.world, self.rank, self.codec, self.name, self.site, self.clock, buffers)

    def run(self, steps: Steps | torch.Tensor, async_op: bool) -> torch.Tensor | Handle:
        """Start the steps (or wrap a ready result); the handle, or its result when not async."""
        h = Handle(result=steps) if isinstance(steps, torch.Tensor) else Handle.start(steps)
        if self.check:
            h.then(self.site.note_result)
        return h if async_op else h.wait()

    def issue(self, start: Callable[[], dist.Work], result: torch.Tensor) -> Steps:
        """Steps of a plain collective: issue asynchronously, then wait."""
        with self.clock("comm_s"):
            work = start()
        yield
        with self.clock("comm_s"):
            work.wait()
        return result




def tensor_bytes(x: torch.Tensor) -> int:
    """The bytes of x's elements (what a plain collective moves per copy of x)."""
    return x.numel() * x.element_size()
