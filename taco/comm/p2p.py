"""Compressed point-to-point transfers for pipeline parallelism: encode -> send -> decode.

Why this file exists: PP stages exchange activations and activation gradients with send/recv
(docs/design.md 1.5); the payload goes through the same codecs and policy as TP collectives. `dst` and
`src` are global ranks, as in torch.distributed. Both ends must name the same codec (or policy
site) and the receiver's `like` must match the sender's shape and dtype: with the size check on
(CPU by default, `CommPolicy.check_sizes`) a mismatch raises ValueError on the receiver instead
of aborting the process, at the cost of a 24-byte header message.

Forms (docs/design.md 1.3 "Non-blocking pipeline transfers"): `isend`/`irecv` return a `Handle`
(the send is encoded and posted, the receive posted, on return; `wait()` finishes the transfer
and decodes); `send_recv` is one exchange with a neighbour that sends to this rank at the same
time (1F1B's `send_forward_recv_backward`); `send`/`recv` are `isend`/`irecv` then `wait()`.

Every transfer is posted through `torch.distributed.batch_isend_irecv`, a lone one too, because
of NCCL's semantics: a send completes only once its receiver has posted the matching receive
(above NCCL's small eager buffer), a rank's point-to-point operations run one after another on
the communicator's stream, and only the operations of one batch (one NCCL group) run together.
Posting `isend` then `irecv` to one peer on both neighbours therefore deadlocks on NCCL (each
receive waits behind its own send), and single and batched operations may even travel on
different communicators (PyTorch's per-pair communicator of a lazily initialised group), so one
form is used for all. Ordering assumptions, which the pipeline schedules meet:
- messages between two ranks in one direction match in the order they are posted;
- a rank's batches complete in the order they are posted, a batch when all of its transfers have;
- `send_recv` meets the peer's mirrored `send_recv` (that rank sends what this one receives and
  receives what this one sends). Without the size check it is one batch [send, receive]; with it,
  one batch of both headers, then (each header checked) one batch of both payloads, so neither
  payload waits for a header the peer can only send later. A lone send (header and payload in one
  batch) meets a lone receive (header, then payload once checked).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ..codec import CodecSpec
from .call import DEFAULT_CODEC, Call, Group, PolicyOrTaco, tensor_bytes
from .handles import Handle, Steps
from .policy import CommPolicy

Transfer = tuple[str, torch.Tensor, int]
"""("send" | "recv", tensor, global peer rank)"""


def _header(call: Call, nbytes: int) -> torch.Tensor:
    crc = zlib.crc32(call.describe().encode())
    return torch.tensor([call.x.numel(), nbytes, crc], dtype=torch.int64, device=call.x.device)


def _nbytes(call: Call) -> int:
    x = call.x
    return call.codec.nbytes(x.numel(), x.dtype) if call.codec is not None and x.numel() else tensor_bytes(x)


def post(transfers: list[Transfer], group: Group) -> list[dist.Work]:
    """Post `transfers` as one batch (`dist.batch_isend_irecv`: one NCCL group, whose sends and
    receives progress together); the returned works complete together."""
    if not transfers:
        return []
    ops = [
        dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group)
        for kind, t, peer in transfers
    ]
    return dist.batch_isend_irecv(ops)


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


class _Outgoing:
    """The sending half of a transfer: header (with the size check) and payload, encoded at once."""

    def __init__(self, call: Call, dst: int) -> None:
        x = call.x
        self.call, self.dst = call, dst
        nbytes = _nbytes(call)
        call.account(tensor_bytes(x), nbytes)
        self.header = _header(call, nbytes) if call.wants_check() else None
        self.payload: torch.Tensor | None = None  # nothing travels for an empty message
        self.buf = self.ctx = None
        if nbytes and call.codec is None:
            self.payload = x.contiguous()  # sent from x itself (a copy only when x is not contiguous)
        elif nbytes:
            self.ctx = call.ctx(tensor_bytes(x))
            self.buf = self.payload = self.ctx.take("p2p.send", nbytes, x.device)
            with call.clock("encode_s"):
                call.codec.encode(x, out=self.buf)

    def headers(self) -> list[Transfer]:
        return [] if self.header is None else [("send", self.header, self.dst)]

    def payloads(self) -> list[Transfer]:
        return [] if self.payload is None else [("send", self.payload, self.dst)]

    def done(self) -> torch.Tensor:
        """After the payload's batch has completed: release the send buffer."""
        if self.buf is not None:
            self.ctx.give("p2p.send", self.buf)
        return self.call.x


class _Incoming:
    """The receiving half: the expected header, then a payload buffer (or, after a header that
    does not match, a drain for the sender's payload, so that the sender completes)."""

    def __init__(self, call: Call, src: int) -> None:
        like = call.x
        self.call, self.src = call, src
        self.nbytes = _nbytes(call)
        call.account(tensor_bytes(like), self.nbytes)
        check = call.wants_check()
        self.got = torch.empty(3, dtype=torch.int64, device=like.device) if check else None
        self.error: ValueError | None = None
        self.out = self.buf = self.ctx = None
        self.drain: torch.Tensor | None = None

    def headers(self) -> list[Transfer]:
        return [] if self.got is None else [("recv", self.got, self.src)]

    def check(self) -> None:
        """Compare the received header with the expected one (after the header's batch)."""
        call = self.call
        if self.got is None or torch.equal(self.got, _header(call, self.nbytes)):
            return
        numel, size = int(self.got[0]), int(self.got[1])
        if size:
            self.drain = torch.empty(size, dtype=torch.uint8, device=call.x.device)
        self.error = ValueError(
            f"taco.comm.recv from rank {self.src}: the sender sent {numel} elements in {size} bytes, "
            f"this rank expects {call.x.numel()} elements in {self.nbytes} bytes "
            f"({call.describe()}); shapes, dtypes or codecs differ"
        )

    def payloads(self) -> list[Transfer]:
        if self.error is not None:
            return [] if self.drain is None else [("recv", self.drain, self.src)]
        like, call = self.call.x, self.call
        if not self.nbytes:
            return []
        if call.codec is None:
            self.out = torch.empty_like(like, memory_format=torch.contiguous_format)
            return [("recv", self.out, self.src)]
        self.ctx = call.ctx(tensor_bytes(like))
        self.buf = self.ctx.take("p2p.recv", self.nbytes, like.device)
        return [("recv", self.buf, self.src)]

    def done(self) -> torch.Tensor:
        """After the payload's batch has completed: the decoded tensor (or the header's error)."""
        if self.error is not None:
            raise self.error
        call, like = self.call, self.call.x
        if self.buf is not None:
            with call.clock("decode_s"):
                self.out = call.codec.decode(call.codec.wrap(self.buf, like.shape, like.dtype))
            self.ctx.give("p2p.recv", self.buf)
        if self.out is None:  # an empty message: nothing travelled
            self.out = torch.empty_like(like, memory_format=torch.contiguous_format)
        return self.out


def _send_steps(out: _Outgoing, group: Group) -> Steps:
    with out.call.clock("comm_s"):
        works = post(out.headers() + out.payloads(), group)
    yield
    with out.call.clock("comm_s"):
        _wait(works)
    return out.done()


def _recv_steps(inc: _Incoming, group: Group) -> Steps:
    first = inc.headers()  # with the size check, the payload is posted once the header is checked
    with inc.call.clock("comm_s"):
        works = post(first or inc.payloads(), group)
    yield
    with inc.call.clock("comm_s"):
        _wait(works)
        if first:
            inc.check()
            _wait(post(inc.payloads(), group))
    return inc.done()


def _exchange_steps(out: _Outgoing, inc: _Incoming, group: Group) -> Steps:
    headers = out.headers() + inc.headers()
    with out.call.clock("comm_s"):
        works = post(headers or out.payloads() + inc.payloads(), group)
    yield
    with inc.call.clock("comm_s"):
        _wait(works)
        if headers:  # both headers have arrived: both payloads, in one batch
            inc.check()
            _wait(post(out.payloads() + inc.payloads(), group))
    out.done()
    return inc.done()


def isend(
    x: torch.Tensor,
    dst: int,
    group: Group = None,
    codec: CodecSpec | PolicyOrTaco = DEFAULT_CODEC,
    *,
    site: str | None = None,
    policy: CommPolicy | None = None,
) -> Handle:
    """Encode x and post its send to global rank `dst`; `wait()` completes it and returns x.

    x must not be modified before `wait()` when the codec is None (it is sent from x itself)."""
    call = Call("send", x, group, codec, site, policy)
    return Handle.start(_send_steps(_Outgoing(call, dst), group))


def irecv(
    like: torch.Tensor,
    src: int,
    group: Group = None,
    codec: CodecSpec | PolicyOrTaco = DEFAULT_CODEC,
    *,
    site: str | None = None,
    policy: CommPolicy | None = None,
) -> Handle:
    """Post a receive from global rank `src` of a tensor shaped like `like`; `wait()` returns it
    decoded (shape, dtype and device of `like`)."""
    call = Call("recv", like, group, codec, site, policy)
    return call.run(_recv_steps(_Incoming(call, src), group), async_op=True)


def send_recv(
    x: torch.Tensor,
    dst: int,
    like: torch.Tensor,
    src: int,
    group: Group = None,
    *,
    send_codec: CodecSpec | PolicyOrTaco = DEFAULT_CODEC,
    recv_codec: CodecSpec | PolicyOrTaco = DEFAULT_CODEC,
    send_site: str | None = None,
    recv_site: str | None = None,
    policy: CommPolicy | None = None,
) -> Handle:
    """Send x to `dst` and receive a tensor like `like` from `src` as one exchange (posted
    together through `dist.batch_isend_irecv`); `wait()` returns the received tensor once both
    are done. The peers call it mirrored (the rank `dst` calls `send_recv` with this rank as its
    source); they may reach it in either order, on NCCL too (module docstring)."""
    sent = _Outgoing(Call("send", x, group, send_codec, send_site, policy), dst)
    call = Call("recv", like, group, recv_codec, recv_site, policy)
    return call.run(_exchange_steps(sent, _Incoming(call, src), group), async_op=True)


def send(
    x: torch.Tensor,
    dst: int,
    group: Group = None,
    codec: CodecSpec | PolicyOrTaco = DEFAULT_CODEC,
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
    codec: CodecSpec | PolicyOrTaco = DEFAULT_CODEC,
    *,
    site: str | None = None,
    policy: CommPolicy | None = None,
) -> torch.Tensor:
    """Receive from global rank `src` a tensor shaped like `like` (shape, dtype, device); decode it."""
    return irecv(like, src, group, codec, site=site, policy=policy).wait()
