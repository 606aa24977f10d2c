"""Pipeline transfers under NCCL's point-to-point semantics (tests/helpers/nccl_shim.py): sends that wait
for their receiver, a pair's operations in one queue, only a batch's operations together.

The exchange that posts a send and then a receive to one peer deadlocks there (the shim reports
it after its timeout), `taco.comm.send_recv` does not, and the real `PipelineEngine` runs 1F1B
(with and without exchanges, with and without the size check's headers), GPipe, pp=4 and dp x pp
to the end, with the same losses and gradients as without the shim.
"""

from __future__ import annotations

import time

import torch

from taco import comm
from taco.codec import build_codec
from taco.parallel.pipeline import exchanges, schedule_actions
from tests.helpers.dist import assert_equal, run_distributed
from tests.helpers.nccl_shim import Deadlock, NcclP2P
from tests.helpers.runs import parallel_step

EXCHANGE = ("recv", "send")  # a batch of one receive and one send: `send_recv`


def _ungrouped_send_recv(x: torch.Tensor, peer: int, like: torch.Tensor) -> torch.Tensor:
    """What `send_recv` did before its transfers were batched: isend, then irecv, then wait."""
    sent = comm.isend(x, peer, codec=None)
    got = comm.irecv(like, peer, codec=None)
    try:
        return got.wait()
    finally:
        sent.wait()


def _exchanges(rank: int, world: int) -> dict:
    peer = 1 - rank
    mine, theirs = (torch.randn(300, generator=torch.Generator().manual_seed(r)) for r in (rank, peer))
    t0 = time.monotonic()
    with NcclP2P(timeout=3):
        try:
            _ungrouped_send_recv(mine, peer, torch.empty(300))
            raise AssertionError("isend then irecv to one peer on both ranks finished under the shim")
        except Deadlock as e:
            deadlock = str(e)
    waited = time.monotonic() - t0
    with NcclP2P(timeout=30) as shim:
        for codec in (None, "int8-hadamard"):
            for check in (False, True):
                policy = comm.CommPolicy(codec=codec or "none", check_sizes=check)
                got = comm.send_recv(mine, peer, torch.empty(300), peer, policy=policy).wait()
                want = theirs if codec is None else build_codec(codec).roundtrip(theirs)
                assert_equal(got, want, f"send_recv codec {codec} check {check}")
        # sizes that differ: a clear error on the receiver (rank 1), no hang, the channel still usable
        n_out, n_in = (7, 4) if rank == 0 else (4, 8)
        plain = dict(send_codec=None, recv_codec=None)
        try:
            comm.send_recv(torch.ones(n_out), peer, torch.empty(n_in), peer, **plain).wait()
            mismatch = None
        except ValueError as e:
            mismatch = str(e)
        assert (mismatch is not None) == (rank == 1), f"rank {rank}: mismatch error {mismatch!r}"
        got = comm.send_recv(mine, peer, torch.empty(300), peer, **plain).wait()
        assert_equal(got, theirs, "send_recv after a mismatch")
    return {"deadlock": deadlock, "waited": waited, "mismatch": mismatch, "batches": dict(shim.batches)}


def test_ungrouped_exchange_deadlocks_under_nccl_semantics_and_send_recv_does_not():
    res = run_distributed(_exchanges, 2, timeout=90)
    for r in res:
        assert "found no posted receive" in r["deadlock"] and r["waited"] < 30, r
        assert r["batches"][EXCHANGE] >= 6, r["batches"]  # every send_recv went as one batch
    assert "the sender sent 7 elements" in res[1]["mismatch"]


def _runs(rank: int, world: int, dp: int, pp: int, configs: list[dict]) -> list[dict]:
    out = []
    for kw in configs:  # each run under the shim, then again under gloo's own semantics
        with NcclP2P(timeout=60) as shim:
            run = parallel_step(rank, world, "gpt", dp, pp, 1, **kw)
        again = parallel_step(rank, world, "gpt", dp, pp, 1, **kw)
        run["exchanges"] = shim.batches[EXCHANGE]
        if kw.get("overlap_p2p", True):  # the engine's exchanges on this stage (rank = dp_rank * pp + stage)
            plans = [schedule_actions(kw.get("schedule", "1f1b"), s, pp, kw["n_micro"]) for s in range(pp)]
            run["expected"] = len(exchanges(plans, rank % pp)) * (2 if kw.get("check_sizes") else 1)
        else:
            run["expected"] = 0
        run["same"] = run["grad_sha"] == again["grad_sha"] and run["loss"] == again["loss"]
        run["same"] &= all(run[f"{a}_wire"] == again[f"{a}_wire"] for a in ("pp", "dp"))
        out.append(run)
    return out


def _check(results: list[list[dict]], configs: list[dict]) -> None:
    for rank_runs in results:
        for run, kw in zip(rank_runs, configs):
            assert run["same"], (kw, "results differ from the run without the shim")
            if kw.get("tol", 1e-4) is not None:
                assert run["checked"] > 0, kw  # every gradient matched the unsharded reference
            # each exchange one batch of a send and a receive (two with the size check's headers)
            assert run["exchanges"] == run["expected"], (kw, run["exchanges"], run["expected"])


PP2 = [
    dict(n_micro=4),
    dict(n_micro=4, overlap_p2p=False),
    dict(n_micro=4, schedule="gpipe"),
    dict(n_micro=4, codecs={"pp": "taco"}, check_sizes=True, tol=None),  # headers, then payloads
    dict(n_micro=1, check_sizes=True),  # stage 0's send and receive are not mirrored on stage 1
    dict(n_micro=2, schedule="gpipe", check_sizes=True),
]


def test_pp2_1f1b_and_gpipe_finish_under_nccl_semantics():
    _check(run_distributed(_runs, 2, 1, 2, PP2, timeout=240), PP2)


PP4 = [
    dict(n_micro=6, n_layer=5),
    dict(n_micro=6, n_layer=5, codecs={"pp": "int8-hadamard"}, check_sizes=True, tol=None),
    dict(n_micro=3, n_layer=5, check_sizes=True),  # exchanges near the ends not mirrored
]


def test_pp4_1f1b_finishes_under_nccl_semantics():
    _check(run_distributed(_runs, 4, 1, 4, PP4, timeout=300), PP4)


DP_PP = [
    dict(n_micro=2),
    dict(n_micro=2, codecs={"dp": "int8-hadamard", "pp": "taco"}, check_sizes=True, tol=None),
]


def test_dp2_pp2_1f1b_with_the_async_dp_hook_finishes_under_nccl_semantics():
    _check(run_distributed(_runs, 4, 2, 2, DP_PP, timeout=300), DP_PP)
