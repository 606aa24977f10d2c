"""Data parallelism: PyTorch DDP over the DP group, gradient buckets compressed by a comm hook.

Why this file exists: the DP axis of the 3D mesh (docs/design.md 1.5) reuses existing engines, with
our codecs. `wrap_data_parallel` wraps a module (a pipeline stage) in stock
`DistributedDataParallel` over the DP group; with a codec it registers a communication hook that
reduces each gradient bucket SDP4Bit-style (arXiv 2410.15526: Hadamard rotation + 8-bit, or
4-bit, codes): `taco.comm.all_reduce` encodes N chunks -> all-to-all -> fp32 sum -> re-encode ->
all-gather -> decode, so each value is quantized twice whatever N is, and every replica decodes
the same bytes (the replicas stay identical). The mean is taken after the fp32 sum.
Codec "none" keeps DDP's own all-reduce (no hook).

The hook is asynchronous (docs/design.md 1.3): it queues the bucket and returns a pending future,
so backward keeps computing the next buckets' gradients while this one is reduced. One FIFO worker
thread per hook state reduces the buckets in submission order (DDP submits them in the same order
on every rank, so the collectives match) on its own copy of the DP group, so its collectives never
interleave with the main thread's on a shared group. That copy is made collectively, which makes
`wrap_data_parallel` with a codec a collective call: every rank of the default group calls it.
`build_optimizer` optionally shards AdamW's state over the DP group with
`ZeroRedundancyOptimizer` (ZeRO-1); gradients are still all-reduced in full by DDP.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import queue
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from taco import comm
from taco.codec import Codec, CodecSpec, build_codec

from .tags import dp_hook_state, set_dp_hook_state

DP_SITE = "dp.grad"


@dataclass
class DPHookState:
    """What the hook needs: the DP group, its codec, and where statistics go.

    `overlap=True` reduces on the worker thread over `async_group` (a copy of `group`, see
    `copy_group`); False reduces in the calling thread and returns a finished future (the
    synchronous reference, bit-identical: same collective, same codec, same bytes).
    """

    group: dist.ProcessGroup
    codec: Codec | None
    policy: comm.CommPolicy | None = None
    site: str = DP_SITE
    overlap: bool = True
    async_group: dist.ProcessGroup | None = None
    """the worker's copy of `group` (None: `group` itself, when nothing else uses it concurrently)"""
    world: int = field(init=False)
    calls: int = 0
    """buckets reduced so far (one call per bucket per synchronised backward)"""

    def __post_init__(self) -> None:
        self.world = dist.get_world_size(self.group)
        self._queue: queue.SimpleQueue | None = None
        self._streams: dict[torch.device, Any] = {}

    def reduce(self, buf: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """The mean of `buf` over the group: one (compressed) two-shot all-reduce, then / N."""
        out = comm.all_reduce(buf, group, codec=self.codec, site=self.site, policy=self.policy)
        return out.div_(self.world)

    def submit(self, buf: torch.Tensor) -> torch.futures.Future:
        """Queue `buf` for the worker; the returned future completes with its mean.

        CUDA: an event recorded now on the current stream (which produced the bucket) is waited on
        by the worker's stream before it reads `buf`. The future is CUDA-aware (`devices=`): its
        `set_result` on the worker's stream records an event there, and DDP's `wait()` makes the
        consumer's current stream wait on that event (no host sync), so DDP's copy of the result
        into the bucket is ordered after the reduction.
        """
        cuda = buf.device.type == "cuda"
        fut: torch.futures.Future = torch.futures.Future(devices=[buf.device] if cuda else None)
        ready = torch.cuda.current_stream(buf.device).record_event() if cuda else None
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            worker = threading.Thread(target=_worker, args=(self, self._queue), daemon=True)
            worker.name = "taco-dp-hook"
            worker.start()
            self._thread = worker
        self._queue.put((buf, ready, fut))
        return fut

    def close(self) -> None:
        """Finish the buckets already queued and stop the worker (a daemon: it also ends with the
        process)."""
        if self._queue is not None:
            self._queue.put(None)
            self._queue = None
            self._thread.join()


def _worker(state: DPHookState, jobs: queue.SimpleQueue) -> None:
    """Reduce queued buckets in FIFO order; each result or error goes to its future."""
    group = state.async_group if state.async_group is not None else state.group
    while (job := jobs.get()) is not None:
        buf, ready, fut = job
        try:
            if ready is None:
                fut.set_result(state.reduce(buf, group))
                continue
            dev = buf.device
            stream = state._streams.get(dev)
            if stream is None:
                stream = state._streams[dev] = torch.cuda.Stream(device=dev)
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                stream.wait_event(ready)  # the bucket's gradients are written
                buf.record_stream(stream)
                fut.set_result(state.reduce(buf, group))  # records the completion event on `stream`
        except Exception as e:  # noqa: BLE001 - handed to DDP, raised by its wait()
            fut.set_exception(e)


def compressed_allreduce_hook(
    state: DPHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: mean of a flat gradient bucket over the DP group, compressed (two-shot).

    Returns at once with a pending future (`state.overlap`); DDP waits on it at the end of
    backward and copies the result into the bucket.
    """
    state.calls += 1
    buf = bucket.buffer()  # [numel] flat gradients of this bucket (param dtype)
    if state.overlap:
        return state.submit(buf)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(state.reduce(buf, state.group))  # synchronous
    return fut


def copy_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new process group over the same ranks as `group` (for the hook's worker thread).

    Collective over the default group: every rank gathers every rank's member list and creates
    each distinct list's group in the same order (dist.new_group needs every rank to call it).
    """
    mine = dist.get_process_group_ranks(group)
    lists: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(lists, mine)
    made = None
    for ranks in sorted({tuple(r) for r in lists}):
        g = dist.new_group(list(ranks))
        if list(ranks) == mine:
            made = g
    assert made is not None  # this rank's own list is among them
    return made


def wrap_data_parallel(
    module: nn.Module,
    group: dist.ProcessGroup | None,
    codec: CodecSpec = None,
    codec_options: dict[str, Any] | None = None,
    *,
    policy: comm.CommPolicy | None = None,
    bucket_cap_mb: float = 25.0,
    overlap: bool = True,
) -> nn.Module:
    """DDP(module) over `group` (the module itself when the group is None: dp == 1).

    codec: a name ("int8-hadamard", "int4-hadamard", ...), spec or Codec; None/"none" = DDP's
    plain all-reduce. `policy` receives the hook's statistics (site `dp.grad`).
    With a codec this is a collective call (every rank of the default group, once per wrap): the
    asynchronous hook's worker gets its own copy of the DP group (`copy_group`).
    `overlap=False` reduces each bucket synchronously inside the hook (the reference path).
    """
    if group is None or dist.get_world_size(group) == 1:
        return module
    # find_unused_parameters=True for its side effect: DDP then keeps its construction-time
    # bucket layout instead of rebuilding the buckets in gradient-ready order after the first
    # synchronised backward. The rounding of a compressed bucket (and the summation order of a
    # ring all-reduce over > 2 ranks) depends on where each gradient sits in the flat bucket, so
    # a rebuild at a different step would keep a resumed run from reproducing the uninterrupted
    # one (tests/parallel/test_3d.py). Cost: one autograd-graph walk per step and a pass-through node on
    # the outputs. Every parameter must be used by every micro-batch (true of whole stages).
    # the search then finds `_WithPlaceholder`'s empty parameter, instead of warning on every rank
    # that it found no unused parameter (a C++ warning, printed whatever Python's filters say).
    ddp = DistributedDataParallel(
        _WithPlaceholder(module), process_group=group, bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=True,
    )  # fmt: skip
    c = build_codec(codec, codec_options)
    if c is not None:
        copy = copy_group(group) if overlap else None
        state = DPHookState(group, c, policy, overlap=overlap, async_group=copy)
        set_dp_hook_state(ddp, state)
        ddp.register_comm_hook(state, compressed_allreduce_hook)
    return ddp


class _WithPlaceholder(nn.Module):
    """`module` plus one empty parameter that no forward uses (`wrap_data_parallel`): it is neither
    in the optimizer nor in a checkpoint, adds no byte to any bucket, and keeps DDP's unused-parameter
    search (kept for its fixed bucket layout) from warning each rank that it found none."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        like = next(module.parameters(), None)
        kw = {} if like is None else {"device": like.device, "dtype": like.dtype}
        self.placeholder = nn.Parameter(torch.empty(0, **kw))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def close_data_parallel(module: nn.Module) -> None:
    """Stop the asynchronous hook's worker of a `wrap_data_parallel` module (no-op without one).

    Call before destroying the process groups: the worker then sits idle, not inside a collective."""
    state = dp_hook_state(module)
    if state is not None:
        state.close()


def plain_allreduce_bytes(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Bytes one rank sends per synchronised step with DDP's plain ring all-reduce of every
    gradient: 2 (N-1)/N of the gradient bytes (the same accounting as `taco.comm.all_reduce`)."""
    if group is None:
        return 0
    n = dist.get_world_size(group)
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return 2 * (n - 1) * grad_bytes // n


def build_optimizer(
    param_groups: list[dict[str, Any]],
    group: dist.ProcessGroup | None,
    zero: bool = False,
    **adamw: Any,
) -> torch.optim.Optimizer:
    """AdamW, or with `zero=True` and a DP group a ZeroRedundancyOptimizer sharding its state."""
    if zero and group is not None:
        # Imported here: torch.distributed.optim scripts its functional optimizers on import (~1 s).
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            param_groups, optimizer_class=torch.optim.AdamW, process_group=group, **adamw
        )
    return torch.optim.AdamW(param_groups, **adamw)


def _is_zero(opt: torch.optim.Optimizer) -> bool:
    mod = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return mod is not None and isinstance(opt, mod.ZeroRedundancyOptimizer)


def local_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO's local one over its shard, else `opt`."""
    return opt.optim if _is_zero(opt) else opt


def optimizer_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state for a per-rank checkpoint (ZeRO: its own shard only)."""
    return local_optimizer(opt).state_dict()


def load_optimizer_state(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Inverse of `optimizer_state` (the same mesh, so ZeRO's partition is the same)."""
    local_optimizer(opt).load_state_dict(state)
