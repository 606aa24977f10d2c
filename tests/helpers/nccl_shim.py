"""NCCL's point-to-point semantics inside gloo test ranks, so that a transfer order that would
deadlock on GPUs deadlocks (and is reported) on the CPU too.

Why this file exists: gloo's sends do not wait for their receiver, and its operations to one peer
do not queue behind each other, so orders of send/recv that hang on NCCL finish under gloo.
`NcclP2P` replaces torch.distributed's point-to-point entry points (`isend`, `irecv`, `send`,
`recv`, `P2POp`, `batch_isend_irecv`) inside one rank with ones that behave as NCCL's do:
- one in-order queue per (group, peer), as NCCL runs a pair's operations on one stream: an
  operation posted on its own starts only once every earlier one to that peer has completed; the
  operations of one `batch_isend_irecv` (one NCCL group) start together, and the batch completes
  when all of them have;
- a receive is posted when it starts; a send completes only once the matching receive (the next
  one of that direction, in posting order) has been posted: a rendezvous, as NCCL's sends above
  its small eager buffer;
- a send that finds no posted receive, or a transfer that does not complete, within `timeout`
  seconds fails with `Deadlock`, raised by `wait()` on its unit and on every later unit of its
  queue: NCCL would hang there.
The data travel over gloo as before; the rendezvous goes through the default group's store (one
key per posted receive). Use it as a context manager inside a rank body (`tests/helpers/dist.py`); every
rank that takes part in the transfers must use it.
"""

from __future__ import annotations

import datetime
import itertools
import queue
import threading
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_INSTANCES = itertools.count()  # every rank makes its shims in the same order: the same store prefix


class Deadlock(RuntimeError):
    """A send whose receiver never posted the matching receive: a hang on NCCL."""


class _Op:
    """Stands in for `dist.P2POp` (same positional arguments) while the shim is active."""

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> None:
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


class _Transfer:
    """One send or receive of a unit; `seq` numbers the transfers of its direction (src, dst, tag)."""

    def __init__(self, kind: str, tensor: torch.Tensor, peer: int, group: Any, tag: int, seq: int) -> None:
        self.kind, self.tensor, self.peer, self.group = kind, tensor, peer, group
        self.tag, self.seq = tag, seq


class _Unit:
    """One queue entry: the transfers posted together, and when they have all completed."""

    def __init__(self, transfers: list[_Transfer]) -> None:
        self.transfers = transfers
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Work:
    """What the shim's isend/irecv/batch_isend_irecv return: `wait()` blocks until the whole unit
    (the batch) has completed, as NCCL's coalesced work does."""

    def __init__(self, unit: _Unit) -> None:
        self.unit = unit

    def wait(self, timeout: Any = None) -> bool:
        self.unit.done.wait()
        if self.unit.error is not None:
            raise self.unit.error
        return True

    def is_completed(self) -> bool:
        return self.unit.done.is_set()


class NcclP2P:
    """Context manager: torch.distributed's point-to-point calls with NCCL's semantics (module
    docstring). `batches` counts the units posted by their make-up, e.g. ("recv", "send") for a
    batch of one receive and one send."""

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.prefix = f"taco-nccl-shim-{next(_INSTANCES)}"
        self.batches: Counter[tuple[str, ...]] = Counter()
        self._queues: dict[tuple[str, int], queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        self._seq: Counter[tuple[str, int, int, int]] = Counter()
        self._lock = threading.Lock()
        self._real: dict[str, Any] = {}

    # -- the replaced entry points ----------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> _Work:
        return _Work(self._submit([("send", tensor, dst, group, tag)]))

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> _Work:
        return _Work(self._submit([("recv", tensor, src, group, tag)]))

    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
        self.isend(tensor, dst, group, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> int:
        self.irecv(tensor, src, group, tag).wait()
        return src

    def batch_isend_irecv(self, ops: list[_Op]) -> list[_Work]:
        if not ops or not all(isinstance(op, _Op) for op in ops):
            raise ValueError("batch_isend_irecv: expected a non-empty list of P2POp")
        kinds = ["send" if op.op == self.isend else "recv" for op in ops]
        unit = self._submit([(k, op.tensor, op.peer, op.group, op.tag) for k, op in zip(kinds, ops)])
        return [_Work(unit) for _ in ops]

    def __enter__(self) -> NcclP2P:
        self._store = c10d._get_default_store()
        self._rank = dist.get_rank()
        mine = {"isend": self.isend, "irecv": self.irecv, "send": self.send, "recv": self.recv}
        mine |= {"P2POp": _Op, "batch_isend_irecv": self.batch_isend_irecv}
        for name, fn in mine.items():
            self._real[name] = getattr(dist, name)
            setattr(dist, name, fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._real.items():
            setattr(dist, name, fn)
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()

    # -- the model --------------------------------------------------------------------------------
    def _group_name(self, group: Any) -> str:
        return (group if group is not None else c10d._get_default_group()).group_name

    def _key(self, gname: str, src: int, dst: int, tag: int, seq: int) -> str:
        return f"{self.prefix}/{gname}/{src}>{dst}/t{tag}/{seq}"

    def _submit(self, ops: list[tuple[str, torch.Tensor, int, Any, int]]) -> _Unit:
        peers = {(self._group_name(g), peer) for _, _, peer, g, _ in ops}
        if len(peers) != 1:
            raise ValueError(f"the NCCL shim models batches to one peer, got {sorted(peers)}")
        (qkey,) = peers
        with self._lock:  # sequence numbers in posting order: the order gloo matches them in too
            transfers = []
            for kind, t, peer, g, tag in ops:
                src, dst = (self._rank, peer) if kind == "send" else (peer, self._rank)
                direction = (qkey[0], src, dst, tag)
                transfers.append(_Transfer(kind, t, peer, g, tag, self._seq[direction]))
                self._seq[direction] += 1
            unit = _Unit(transfers)
            self.batches[tuple(sorted(kind for kind, *_ in ops))] += 1
            q = self._queues.get(qkey)
            if q is None:
                q = self._queues[qkey] = queue.SimpleQueue()
                name = f"nccl-shim-{qkey}"
                thread = threading.Thread(target=self._worker, args=(q,), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
            q.put(unit)
        return unit

    def _worker(self, q: queue.SimpleQueue) -> None:
        """Run one (group, peer) queue in order; after a deadlock every later unit fails too."""
        broken: BaseException | None = None
        while (unit := q.get()) is not None:
            if broken is None:
                try:
                    self._run(unit)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    broken = e
            unit.error = broken
            unit.done.set()

    def _run(self, unit: _Unit) -> None:
        """Start a unit: post its receives (and announce them), then send once each receiver has
        posted; complete when every transfer has."""
        works = []
        for t in unit.transfers:
            if t.kind == "recv":
                gname = self._group_name(t.group)
                self._store.set(self._key(gname, t.peer, self._rank, t.tag, t.seq), "posted")
                works.append((t, self._real["irecv"](t.tensor, t.peer, group=t.group, tag=t.tag)))
        for t in unit.transfers:
            if t.kind == "send":
                key = self._key(self._group_name(t.group), self._rank, t.peer, t.tag, t.seq)
                try:
                    self._store.wait([key], datetime.timedelta(seconds=self.timeout))
                except Exception as e:  # noqa: BLE001 - the store's timeout error, re-raised as ours
                    raise Deadlock(
                        f"rank {self._rank}: send #{t.seq} to rank {t.peer} found no posted receive "
                        f"within {self.timeout:g} s; on NCCL this transfer would hang"
                    ) from e
                works.append((t, self._real["isend"](t.tensor, t.peer, group=t.group, tag=t.tag)))
        for t, w in works:
            try:
                w.wait(datetime.timedelta(seconds=self.timeout))
            except Exception as e:  # noqa: BLE001 - gloo's timeout error, re-raised as ours
                what = f"send #{t.seq} to" if t.kind == "send" else f"receive #{t.seq} from"
                raise Deadlock(
                    f"rank {self._rank}: {what} rank {t.peer} did not complete within {self.timeout:g} s; "
                    "on NCCL this transfer would hang"
                ) from e
