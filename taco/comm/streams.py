"""Where a compressed call's codec kernels and transfers run on CUDA: a side stream per (device,
communicator), ordered against the caller's stream by events.

Why this file exists: the stream rules of docs/design.md 1.3 "Streams (CUDA)" in one place,
used by every compressed algorithm (`compressed.py`) and by the buffer cache's reuse rule
(`buffers.py`: a buffer is reused only on the lane, i.e. the communicator, that gave it back).
Nothing here runs on CPU: gloo calls run on the host in order and every `Lane` method is a no-op.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def communicator(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The process group a call runs on (None: the default group)."""
    return group if group is not None else dist.group.WORLD


def _cuda_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)


_SIDE: dict[tuple[torch.device, dist.ProcessGroup], Any] = {}
_SIDE_LOCK = threading.Lock()  # the asynchronous DP hook's worker thread picks streams too


def side_stream(
    device: torch.device,
    group: dist.ProcessGroup | None,
    new_stream: Callable[[torch.device], Any] = _cuda_stream,
) -> Any:
    """The codec side stream of (device, communicator), made by `new_stream` on first use
    (docs/design.md 1.3 "Streams (CUDA)").

    One per communicator, not per device: the TP collectives (autograd thread) and the DP hook's
    (its worker thread, on its own copy of the DP group) then never share an in-order queue, so
    DP traffic does not wait in TP's critical path in whatever order each rank's host issued it,
    and no wait cycle can close across the two communicators. A communicator's calls are issued
    in the same order on every rank (the collective contract), and so run on its stream."""
    key = (torch.device(device), communicator(group))
    with _SIDE_LOCK:
        stream = _SIDE.get(key)
        if stream is None:
            stream = _SIDE[key] = new_stream(key[0])
    return stream


class Lane:
    """Where one call's codec kernels and transfers run (docs/design.md 1.3 "Streams (CUDA)", 2.3).

    CUDA: the side stream of (device, the call's communicator), which first waits for the
    caller's stream (the input is ready) and, at `join`, is waited on by it (the output is
    ready); no host sync. Tensors made on one stream and used on the other are `record_stream`ed
    so the caching allocator does not reuse them early. CPU (gloo): the host, in order; every
    method is a no-op.
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None) -> None:
        self.side = self.caller = None
        if device.type == "cuda":
            self.caller = torch.cuda.current_stream(device)
            self.side = side_stream(device, group)
            self.side.wait_stream(self.caller)

    def run(self) -> contextlib.AbstractContextManager:
        """Context in which the call's kernels, buffers and transfers are issued."""
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def used_here(self, *tensors: torch.Tensor) -> None:
        """Tensors of the caller's stream that the side stream reads or writes."""
        if self.side is not None:
            for t in tensors:
                t.record_stream(self.side)

    def join(self, *results: torch.Tensor) -> None:
        """Order the caller's stream after the side stream; `results` (made on the side stream)
        are then used on the caller's."""
        if self.side is not None:
            self.caller.wait_stream(self.side)
            for t in results:
                t.record_stream(self.caller)
