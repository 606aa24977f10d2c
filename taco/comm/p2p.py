"""Compressed point-to-point transfers for pipeline parallelism: encode -> send -> decode.

Why this file exists: PP stages exchange activations and activation gradients with send/recv
(docs/design.md 1.5); the payload goes through the same codecs and policy as TP collectives. `dst` and
`src` are global ranks, as in torch.distributed. Both ends must name the same codec (or policy
site) and the receiver's `like` must match the sender's shape and dtype: with the size check on
(CPU by default, `CommPolicy.check_sizes`) a mismatch raises ValueError on the receiver instead
of aborting the process, at the cost of a 24-byte header message.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .collectives import DEFAULT_CODEC, Group, _bytes, _Call, _PolicyOrTaco
from .policy import CodecSpec, CommPolicy


def _header(call: _Call, nbytes: int) -> torch.Tensor:
    crc = zlib.crc32(call.describe().encode())
    return torch.tensor([call.x.numel(), nbytes, crc], dtype=torch.int64, device=call.x.device)


def _nbytes(call: _Call) -> int:
    x = call.x
    return call.codec.nbytes(x.numel(), x.dtype) if call.codec is not None and x.numel() else _bytes(x)


def send(
    x: torch.Tensor,
    dst: int,
    group: Group = None,
    codec: CodecSpec | _PolicyOrTaco = DEFAULT_CODEC,
    *,
    site: str | None = None,
    policy: CommPolicy | None = None,
) -> None:
    """Send x to global rank `dst`: encode into one uint8 buffer and send it (blocking)."""
    call = _Call("send", x, group, codec, site, policy)
    nbytes = _nbytes(call)
    call.account(_bytes(x), nbytes)
    with call.clock("comm_s"):
        if call.wants_check():
            dist.send(_header(call, nbytes), dst, group=group)
        if call.codec is None:
            dist.send(x.contiguous(), dst, group=group)
            return
    if x.numel() == 0:
        return
    ctx = call.ctx(_bytes(x))
    buf = ctx.take("p2p.send", nbytes, x.device)
    with call.clock("encode_s"):
        call.codec.encode(x, out=buf)
    with call.clock("comm_s"):
        dist.send(buf, dst, group=group)
    ctx.give("p2p.send", buf)


def recv(
    like: torch.Tensor,
    src: int,
    group: Group = None,
    codec: CodecSpec | _PolicyOrTaco = DEFAULT_CODEC,
    *,
    site: str | None = None,
    policy: CommPolicy | None = None,
) -> torch.Tensor:
    """Receive from global rank `src` a tensor shaped like `like` (shape, dtype, device); decode it."""
    call = _Call("recv", like, group, codec, site, policy)
    nbytes = _nbytes(call)
    call.account(_bytes(like), nbytes)
    with call.clock("comm_s"):
        if call.wants_check():
            got = torch.empty(3, dtype=torch.int64, device=like.device)
            dist.recv(got, src, group=group)
            if not torch.equal(got, _header(call, nbytes)):
                numel, size = int(got[0]), int(got[1])
                if size:  # drain the payload so that the sender does not block, then fail
                    dist.recv(torch.empty(size, dtype=torch.uint8, device=like.device), src, group=group)
                raise ValueError(
                    f"taco.comm.recv from rank {src}: the sender sent {numel} elements in {size} bytes, "
                    f"this rank expects {like.numel()} elements in {nbytes} bytes "
                    f"({call.describe()}); shapes, dtypes or codecs differ"
                )
        if call.codec is None:
            out = torch.empty_like(like, memory_format=torch.contiguous_format)
            dist.recv(out, src, group=group)
    if call.codec is not None:
        if like.numel() == 0:
            return torch.empty_like(like, memory_format=torch.contiguous_format)
        ctx = call.ctx(_bytes(like))
        buf = ctx.take("p2p.recv", nbytes, like.device)
        with call.clock("comm_s"):
            dist.recv(buf, src, group=group)
        with call.clock("decode_s"):
            out = call.codec.decode(call.codec.wrap(buf, like.shape, like.dtype))
        ctx.give("p2p.recv", buf)
    if call.check:
        call.site.note_result(out)
    return out
