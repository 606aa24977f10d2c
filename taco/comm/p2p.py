"""Compressed point-to-point transfers for pipeline parallelism: encode -> send -> decode.

Why this file exists: PP stages exchange activations and activation gradients with send/recv
(docs/design.md 1.5); the payload goes through the same codecs and policy as TP collectives. `dst` and
`src` are global ranks, as in torch.distributed. Both ends must name the same codec (or policy
site) and the receiver's `like` must match the sender's shape and dtype: with the size check on
(CPU by default, `CommPolicy.check_sizes`) a mismatch raises ValueError on the receiver instead
of aborting the process, at the cost of a 24-byte header message.

Non-blocking forms (docs/design.md 1.3): `isend`/`irecv` return a `Handle` (the send is encoded and
posted, the receive posted, on return; `wait()` finishes the transfer and decodes), and
`send_recv` posts a send and a receive together (like `torch.distributed.batch_isend_irecv`), for
neighbours that exchange in both directions at once (1F1B's `send_forward_recv_backward`).
`send`/`recv` are these followed by `wait()`.
Ordering assumptions: messages between two ranks in one direction match in the order they are
posted; with the size check a receive posts its payload only once the header has arrived (in
`wait()`), so a rank must not block on its own send to a peer before waiting on its receive from
that peer (`send_recv` waits on the receive first).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .collectives import DEFAULT_CODEC, Group, _bytes, _Call, _PolicyOrTaco
from .handles import Handle, Steps
from .policy import CodecSpec, CommPolicy


def _header(call: _Call, nbytes: int) -> torch.Tensor:
    crc = zlib.crc32(call.describe().encode())
    return torch.tensor([call.x.numel(), nbytes, crc], dtype=torch.int64, device=call.x.device)


def _nbytes(call: _Call) -> int:
    x = call.x
    return call.codec.nbytes(x.numel(), x.dtype) if call.codec is not None and x.numel() else _bytes(x)


def _send_steps(call: _Call, dst: int, group: Group) -> Steps:
    x = call.x
    nbytes = _nbytes(call)
    call.account(_bytes(x), nbytes)
    works: list[dist.Work] = []
    buf = ctx = None
    with call.clock("comm_s"):
        if call.wants_check():
            works.append(dist.isend(_header(call, nbytes), dst, group=group))
        if call.codec is None:
            works.append(dist.isend(x.contiguous(), dst, group=group))
    if call.codec is not None and x.numel():
        ctx = call.ctx(_bytes(x))
        buf = ctx.take("p2p.send", nbytes, x.device)
        with call.clock("encode_s"):
            call.codec.encode(x, out=buf)
        with call.clock("comm_s"):
            works.append(dist.isend(buf, dst, group=group))
    yield
    with call.clock("comm_s"):
        for w in works:
            w.wait()
    if buf is not None:
        ctx.give("p2p.send", buf)
    return x


def _recv_steps(call: _Call, src: int, group: Group) -> Steps:
    like = call.x
    nbytes = _nbytes(call)
    call.account(_bytes(like), nbytes)
    check = call.wants_check()
    got = torch.empty(3, dtype=torch.int64, device=like.device) if check else None
    out = buf = ctx = None
    with call.clock("comm_s"):
        if check:
            work = dist.irecv(got, src, group=group)  # the payload is posted once it has been checked
        else:
            out, buf, ctx, work = _post_payload(call, src, group, nbytes)
    yield
    with call.clock("comm_s"):
        work.wait()
        if check:
            if not torch.equal(got, _header(call, nbytes)):
                numel, size = int(got[0]), int(got[1])
                if size:  # drain the payload so that the sender does not block, then fail
                    dist.recv(torch.empty(size, dtype=torch.uint8, device=like.device), src, group=group)
                raise ValueError(
                    f"taco.comm.recv from rank {src}: the sender sent {numel} elements in {size} bytes, "
                    f"this rank expects {like.numel()} elements in {nbytes} bytes "
                    f"({call.describe()}); shapes, dtypes or codecs differ"
                )
            out, buf, ctx, work = _post_payload(call, src, group, nbytes)
            work.wait()
    if buf is not None:
        with call.clock("decode_s"):
            out = call.codec.decode(call.codec.wrap(buf, like.shape, like.dtype))
        ctx.give("p2p.recv", buf)
    return out


class _Done:
    """A finished transfer (an empty message): `wait()` returns at once."""

    def wait(self) -> None:
        return None


def _post_payload(call: _Call, src: int, group: Group, nbytes: int) -> tuple:
    """Post the receive of the payload: (plain result or None, codec buffer or None, ctx, work)."""
    like = call.x
    if call.codec is None:
        out = torch.empty_like(like, memory_format=torch.contiguous_format)
        return out, None, None, dist.irecv(out, src, group=group)
    if like.numel() == 0:
        return torch.empty_like(like, memory_format=torch.contiguous_format), None, None, _Done()
    ctx = call.ctx(_bytes(like))
    buf = ctx.take("p2p.recv", nbytes, like.device)
    return None, buf, ctx, dist.irecv(buf, src, group=group)


def isend(
    x: torch.Tensor,
    dst: int,
    group: Group = None,
    codec: CodecSpec | _PolicyOrTaco = DEFAULT_CODEC,
    *,
    site: str | None = None,
    policy: CommPolicy | None = None,
) -> Handle:
    """Encode x and post its send to global rank `dst`; `wait()` completes it and returns x.

    x must not be modified before `wait()` when the codec is None (it is sent from x itself)."""
    call = _Call("send", x, group, codec, site, policy)
    return Handle.start(_send_steps(call, dst, group))


def irecv(
    like: torch.Tensor,
    src: int,
    group: Group = None,
    codec: CodecSpec | _PolicyOrTaco = DEFAULT_CODEC,
    *,
    site: str | None = None,
    policy: CommPolicy | None = None,
) -> Handle:
    """Post a receive from global rank `src` of a tensor shaped like `like`; `wait()` returns it
    decoded (shape, dtype and device of `like`)."""
    call = _Call("recv", like, group, codec, site, policy)
    return call.run(_recv_steps(call, src, group), async_op=True)


def send_recv(
    x: torch.Tensor,
    dst: int,
    like: torch.Tensor,
    src: int,
    group: Group = None,
    *,
    send_codec: CodecSpec | _PolicyOrTaco = DEFAULT_CODEC,
    recv_codec: CodecSpec | _PolicyOrTaco = DEFAULT_CODEC,
    send_site: str | None = None,
    recv_site: str | None = None,
    policy: CommPolicy | None = None,
) -> Handle:
    """Post the send of x to `dst` and the receive (like `like`) from `src` together; `wait()`
    returns the received tensor once both are done. Two neighbours exchanging with each other may
    both call this in any order without deadlock (neither blocks before both are posted)."""
    sent = isend(x, dst, group, send_codec, site=send_site, policy=policy)
    got = irecv(like, src, group, recv_codec, site=recv_site, policy=policy)

    def steps() -> Steps:
        yield
        out = got.wait()  # first: with the size check the payload receive is posted here
        sent.wait()
        return out

    return Handle.start(steps())


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
    isend(x, dst, group, codec, site=site, policy=policy).wait()


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
    return irecv(like, src, group, codec, site=site, policy=policy).wait()
