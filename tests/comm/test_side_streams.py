"""One codec side stream per (device, communicator): the TP collectives and the asynchronous DP
hook never share an in-order queue, and buffers are reused only on the lane that gave them back.

This machine has no CUDA, so the streams are stand-ins made by an injected factory: the tests
check the keying (`taco.comm.streams.side_stream`) and that a real TP x DP step hands the TP
collectives and the DP hook's reductions (on its worker thread) different communicators, both for
their side stream (`Lane`) and for their buffers (`BufferCache` lanes).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from taco.comm import BufferCache, streams
from taco.comm.streams import communicator, side_stream
from tests.helpers.dist import run_distributed
from tests.helpers.runs import parallel_step

CPU = torch.device("cpu")
GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)  # keys only: nothing runs on them
HOOK_THREAD = "taco-dp-hook"


class _Stream:
    """A stand-in for torch.cuda.Stream: remembers its device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device


def _tp_dp_step(rank: int, world: int) -> dict:
    lanes: list[tuple[str, dist.ProcessGroup]] = []  # (issuing thread, communicator) per compressed call
    takes: list[tuple[str, object]] = []  # (issuing thread, buffer lane) per buffer taken
    real_lane, real_take = streams.Lane.__init__, BufferCache.take

    def lane(self, device, group):
        lanes.append((threading.current_thread().name, communicator(group)))
        real_lane(self, device, group)

    def take(self, role, nbytes, device, lane=None):
        takes.append((threading.current_thread().name, lane))
        return real_take(self, role, nbytes, device, lane)

    streams.Lane.__init__, BufferCache.take = lane, take
    try:
        codecs = {"tp": "taco", "dp": "int8-hadamard"}  # dp=2 x tp=2, the asynchronous DP hook
        parallel_step(rank, world, "gpt", 2, 1, 2, n_micro=1, n_layer=1, codecs=codecs, tol=None)
    finally:
        streams.Lane.__init__, BufferCache.take = real_lane, real_take
    tp = {g for t, g in lanes if t != HOOK_THREAD}
    dp = {g for t, g in lanes if t == HOOK_THREAD}
    assert len(tp) == 1 and len(dp) == 1, f"communicators: TP {tp}, DP hook {dp}"
    (tp_group,), (dp_group,) = tp, dp
    ranks = {"tp": dist.get_process_group_ranks(tp_group), "dp": dist.get_process_group_ranks(dp_group)}
    assert ranks == {"tp": [rank // 2 * 2, rank // 2 * 2 + 1], "dp": [rank % 2, rank % 2 + 2]}, ranks
    assert {lane for _, lane in takes} == {tp_group, dp_group}, "buffers taken on other lanes"
    assert all((lane is dp_group) == (t == HOOK_THREAD) for t, lane in takes)
    # the side streams these calls get: one for TP, another for the DP hook, the same for every call
    tp_streams = {id(side_stream(GPU0, g, _Stream)) for t, g in lanes if t != HOOK_THREAD}
    dp_streams = {id(side_stream(GPU0, g, _Stream)) for t, g in lanes if t == HOOK_THREAD}
    assert len(tp_streams) == len(dp_streams) == 1, (tp_streams, dp_streams)
    assert tp_streams.isdisjoint(dp_streams), "TP and the DP hook share a side stream"
    _keys()
    hook = sum(t == HOOK_THREAD for t, _ in lanes)
    return {"tp_calls": len(lanes) - hook, "dp_calls": hook}


def test_tp_and_the_async_dp_hook_get_distinct_side_streams_and_buffer_lanes():
    for r in run_distributed(_tp_dp_step, 4):
        assert r["tp_calls"] > 0 and r["dp_calls"] > 0, r


def _keys() -> None:
    """`side_stream`: one stream per (device, communicator), whatever the ranks or the thread."""
    everyone = list(range(dist.get_world_size()))
    a, b = dist.new_group(everyone), dist.new_group(everyone)  # two communicators over the same ranks
    s = side_stream(GPU0, a, _Stream)
    assert side_stream(GPU0, a, _Stream) is s, "a communicator keeps its stream"
    assert side_stream(GPU0, b, _Stream) is not s, "another communicator, same ranks: another stream"
    assert side_stream(GPU1, a, _Stream) is not s and side_stream(GPU1, a, _Stream).device == GPU1
    assert side_stream(GPU0, None, _Stream) is side_stream(GPU0, dist.group.WORLD, _Stream)
    c, got = dist.new_group(everyone), []
    threads = [threading.Thread(target=lambda: got.append(side_stream(GPU0, c, _Stream))) for _ in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] is got[1], "two threads asking at once get one stream"


def test_buffers_are_reused_only_on_the_lane_that_gave_them_back():
    c = BufferCache()
    a = c.take("send", 1000, CPU, lane="tp")
    c.give("send", a)
    b = c.take("send", 1000, CPU, lane="dp")  # another lane: a new buffer, not tp's
    assert b.data_ptr() != a.data_ptr() and c.allocated_bytes == 2048
    c.give("send", b)
    assert c.take("send", 1000, CPU, lane="tp").data_ptr() == a.data_ptr() and c.allocated_bytes == 2048
