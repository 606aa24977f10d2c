"""Compressed collectives on stock torch.distributed (docs/design.md 1.3; gloo on CPU, NCCL on GPU).

    y = taco.comm.all_reduce(x, group, codec="taco")              # two-shot, fp32 sums
    y = taco.comm.all_gather(x, group, dim=0)                     # concatenation along dim
    y = taco.comm.reduce_scatter(x, group, dim=0)                 # sum, then this rank's slice
    taco.comm.send(x, dst); y = taco.comm.recv(like, src)         # pipeline activations
    h = taco.comm.send_recv(x, dst, like, src); y = h.wait()       # both posted, then waited
    policy = taco.comm.CommPolicy(overrides={"layers.*.mlp.down.fwd": "none"}, min_bytes=1 << 16)
    y = taco.comm.all_reduce(x, group, site="layers.0.attn.out.fwd", policy=policy)
    print(policy.stats.summary())   # per site; NaN/Inf checked counts; buffer high-water line

codec=None/"none" is the plain torch.distributed collective, bit-identical. A policy's buffers are
shared by its sites and capped (`CommPolicy.max_cached_bytes`); results are checked for NaN/Inf on
a sample of the calls (`CommPolicy.nonfinite_check_every`).
"""

from .buffers import BufferCache, bucket_bytes
from .collectives import DEFAULT_CODEC, all_gather, all_reduce, reduce_scatter, start_all_reduce
from .handles import Handle
from .p2p import irecv, isend, recv, send, send_recv
from .policy import CommPolicy
from .stats import CommStats, SiteStats

__all__ = [
    "DEFAULT_CODEC",
    "BufferCache",
    "CommPolicy",
    "CommStats",
    "Handle",
    "SiteStats",
    "all_gather",
    "all_reduce",
    "bucket_bytes",
    "irecv",
    "isend",
    "recv",
    "reduce_scatter",
    "send",
    "send_recv",
    "start_all_reduce",
]
