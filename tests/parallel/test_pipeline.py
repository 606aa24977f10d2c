"""Pipeline parallelism: stage cuts, schedules (deadlock freedom without processes), and one
training step of 1F1B and GPipe against the single-process reference, plain and compressed."""

from __future__ import annotations

import math

import pytest
import torch

from taco.codec import build_codec
from taco.parallel import PipelineStage, stage_layers
from taco.parallel.pipeline import SCHEDULES, Action, exchanges, one_f_one_b_actions, schedule_actions
from taco.parallel.tags import is_pp_copy
from tests.helpers.dist import run_distributed
from tests.helpers.runs import parallel_step, tiny_model

_PEER = {"send_fwd": 1, "recv_fwd": -1, "send_bwd": -1, "recv_bwd": 1}
_MATCH = {"send_fwd": "recv_fwd", "recv_fwd": "send_fwd", "send_bwd": "recv_bwd", "recv_bwd": "send_bwd"}


def simulate(plans: list[list[Action]]) -> bool:
    """Run per-stage action lists with blocking rendezvous send/recv (the strictest semantics):
    a transfer completes only when both neighbours stand at the matching action. True if all
    finish; asserts that matched transfers carry the same micro-batch (in-order pairing)."""
    pos = [0] * len(plans)

    def head(p: int) -> Action | None:
        while pos[p] < len(plans[p]) and plans[p][pos[p]][0] in ("fwd", "bwd"):
            pos[p] += 1  # compute never blocks
        return plans[p][pos[p]] if pos[p] < len(plans[p]) else None

    moved = True
    while moved:
        moved = False
        for p in range(len(plans)):
            a = head(p)
            if a is None:
                continue
            q = p + _PEER[a[0]]
            b = head(q)
            if b is not None and b[0] == _MATCH[a[0]]:
                assert b[1] == a[1], (p, a, q, b)
                pos[p] += 1
                pos[q] += 1
                moved = True
    return all(pos[p] == len(plans[p]) for p in range(len(plans)))


def simulate_exchanges(plans: list[list[Action]]) -> bool:
    """`simulate` with the engine's overlap_p2p: the send and receive of each exchange (`exchanges`)
    are posted at once (one batch) and either may complete first; nothing after the batch is
    posted before both have."""
    done = [[False] * len(plan) for plan in plans]
    fused = [exchanges(plans, p) for p in range(len(plans))]

    def posted(p: int) -> list[int]:
        plan, i = plans[p], 0
        while i < len(plan) and (done[p][i] or plan[i][0] in ("fwd", "bwd")):
            i += 1
        if i == len(plan):
            return []
        if i - 1 in fused[p] and not done[p][i]:  # the second half of a batch whose first is done
            return [i]
        return [i, i + 1] if i in fused[p] else [i]

    moved = True
    while moved:
        moved = False
        for p in range(len(plans)):
            for i in posted(p):
                a = plans[p][i]
                q = p + _PEER[a[0]]
                for j in posted(q) if 0 <= q < len(plans) else []:
                    if plans[q][j][0] == _MATCH[a[0]] and not done[p][i]:
                        assert plans[q][j][1] == a[1], (p, a, q, plans[q][j])
                        done[p][i] = done[q][j] = moved = True
    return all(all(d or a[0] in ("fwd", "bwd") for d, a in zip(dp, plan)) for dp, plan in zip(done, plans))


def test_1f1b_with_exchanges_runs_every_transfer_without_deadlock():
    for n_stages in range(1, 7):
        for n_micro in range(1, 9):
            plans = [one_f_one_b_actions(s, n_stages, n_micro) for s in range(n_stages)]
            assert simulate_exchanges(plans), (n_stages, n_micro)
            pairs = 0
            for p, plan in enumerate(plans):
                for i in exchanges(plans, p):  # mirrored: the neighbour runs the matching pair as one too
                    (a, ka), (b, kb) = plan[i], plan[i + 1]
                    q = p + _PEER[a]
                    j = min(plans[q].index((_MATCH[a], ka)), plans[q].index((_MATCH[b], kb)))
                    assert j in exchanges(plans, q), (n_stages, n_micro, p, i)
                    pairs += 1
            assert pairs >= 2 * (n_stages - 2) * max(0, n_micro - n_stages), (n_stages, n_micro, pairs)
            if 1 < n_stages < n_micro:  # the steady state has exchanges
                assert pairs > 0, (n_stages, n_micro)


def test_stages_are_balanced_contiguous_and_cover_every_layer():
    for n_layer in range(1, 9):
        for pp in range(1, n_layer + 1):
            parts = [stage_layers(n_layer, pp, s) for s in range(pp)]
            assert [i for r in parts for i in r] == list(range(n_layer))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(ValueError, match=r"parallel.pp = 3 is larger than the number of layers \(2\)"):
        stage_layers(2, 3, 0)


def test_stage_keeps_its_layers_embedding_and_head():
    stages = []
    for s in range(2):
        torch.manual_seed(0)  # every rank builds the same full model, then keeps its stage
        stages.append(PipelineStage(tiny_model("gpt", 3), s, 2))
    first, last = stages
    names0 = {n.split(".")[2] for n, _ in first.named_parameters() if ".layers." in n}
    names1 = {n.split(".")[2] for n, _ in last.named_parameters() if ".layers." in n}
    assert names0 == {"0", "1"} and names1 == {"2"}
    assert first.model.tok_emb is not None and first.model.lm_head is None
    assert last.model.tok_emb is None and last.model.lm_head is not None
    assert torch.equal(first.tied_weight, last.tied_weight)  # tied copies start equal
    assert is_pp_copy(last.tied_weight)


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedules_run_every_microbatch_once_without_deadlock(name):
    for n_stages in range(1, 7):
        for n_micro in range(1, 9):
            plans = [schedule_actions(name, s, n_stages, n_micro) for s in range(n_stages)]
            for plan in plans:
                for kind in ("fwd", "bwd"):
                    assert sorted(k for a, k in plan if a == kind) == list(range(n_micro))
                assert plan.index(("fwd", n_micro - 1)) < plan.index(("bwd", n_micro - 1))
                assert [k for a, k in plan if a == "bwd"][-1] == n_micro - 1  # DDP syncs in this one
            assert simulate(plans), (name, n_stages, n_micro)


def test_1f1b_bounds_microbatches_in_flight_and_naive_ordering_would_deadlock():
    for s in range(4):
        live = peak = 0
        for kind, _ in one_f_one_b_actions(s, 4, 8):
            live += (kind == "fwd") - (kind == "bwd")
            peak = max(peak, live)
        assert peak == 4 - s
    # the simulator is strict: sending first on every stage (no even/odd order) deadlocks
    naive = []
    for s in range(2):
        plan = one_f_one_b_actions(s, 2, 4)
        for i in range(len(plan) - 1):
            if plan[i][0].startswith("recv") and plan[i + 1][0].startswith("send"):
                plan[i], plan[i + 1] = plan[i + 1], plan[i]
        naive.append(plan)
    assert not simulate(naive)


def _two_stages(rank: int, world: int) -> list[dict]:
    return [
        parallel_step(rank, world, "gpt", 1, 2, 1, schedule="1f1b", n_micro=4),
        parallel_step(rank, world, "gpt", 1, 2, 1, schedule="gpipe", n_micro=4),
        parallel_step(rank, world, "qwen", 1, 2, 1, n_micro=4, codecs={"pp": "taco"}, tol=None),
        parallel_step(rank, world, "gpt", 1, 2, 1, n_micro=4, codecs={"pp": "int4-hadamard"}, tol=None),
    ]


def test_pp2_1f1b_matches_gpipe_and_reference_and_codecs_compress():
    for one_f, gpipe, taco, int4 in run_distributed(_two_stages, 2):
        assert one_f["checked"] > 0 and gpipe["checked"] > 0  # each matched the reference
        assert math.isclose(one_f["loss"], gpipe["loss"], rel_tol=1e-6)
        torch.testing.assert_close(one_f["grad_digest"], gpipe["grad_digest"], rtol=1e-5, atol=1e-6)
        for run, err in ((taco, 0.05), (int4, 0.3)):
            assert math.isfinite(run["loss"]) and abs(run["loss"] - run["ref_loss"]) < 0.02
            assert run["grad_err"] < err, run["grad_err"]
            assert 0 < run["pp_wire"] < 0.6 * run["pp_raw"]


def _four_stages(rank: int, world: int) -> list[dict]:
    return [parallel_step(rank, world, "gpt", 1, 4, 1, schedule=s, n_micro=6, n_layer=5) for s in SCHEDULES]


@pytest.mark.slow
def test_pp4_uneven_stages_tied_embedding_group_matches_reference():
    for one_f, gpipe in run_distributed(_four_stages, 4, timeout=240):
        assert one_f["checked"] > 0 and math.isclose(one_f["loss"], gpipe["loss"], rel_tol=1e-6)


def _overlap_on_off(rank: int, world: int, pp: int, n_layer: int) -> list[tuple[dict, dict]]:
    runs = []
    for codec in (None, "taco"):
        kw = dict(n_micro=2 * pp, n_layer=n_layer, codecs={"pp": codec} if codec else None, tol=None)
        on = parallel_step(rank, world, "gpt", 1, pp, 1, overlap_p2p=True, **kw)
        off = parallel_step(rank, world, "gpt", 1, pp, 1, overlap_p2p=False, **kw)
        runs.append((on, off))
    return runs


def _assert_overlap_identical(results: list) -> None:
    for runs in results:
        for on, off in runs:
            assert on["loss"] == off["loss"], (on["loss"], off["loss"])
            assert on["grad_sha"] == off["grad_sha"]  # bit-identical gradients
            assert on["pp_wire"] == off["pp_wire"] and on["pp_raw"] == off["pp_raw"]
        assert runs[1][0]["pp_wire"] < runs[1][0]["pp_raw"]  # the codec run compressed


def test_pp2_overlapped_p2p_is_bit_identical_to_blocking():
    _assert_overlap_identical(run_distributed(_overlap_on_off, 2, 2, 3))


@pytest.mark.slow
def test_pp4_overlapped_p2p_is_bit_identical_to_blocking():
    _assert_overlap_identical(run_distributed(_overlap_on_off, 4, 4, 5, timeout=240))


def test_send_recv_exchanges_both_ways_in_any_order():
    run_distributed(_exchange, 2)


def _exchange(rank: int, world: int) -> None:
    from taco import comm
    from tests.helpers.dist import assert_equal

    torch.manual_seed(rank)
    mine, peer = torch.randn(300), 1 - rank
    torch.manual_seed(peer)
    theirs = torch.randn(300)
    for codec in (None, "int8-hadamard"):
        # both ranks send first: blocking send/recv could deadlock on a rendezvous, this cannot
        got = comm.send_recv(mine, peer, torch.empty(300), peer, send_codec=codec, recv_codec=codec).wait()
        want = theirs if codec is None else build_codec(codec).roundtrip(theirs)
        assert_equal(got, want, f"send_recv codec {codec}")
        h = comm.irecv(torch.empty(300), peer, codec=codec)
        sent = comm.isend(mine, peer, codec=codec)
        assert_equal(h.wait(), want, f"isend/irecv codec {codec}")  # the receive first (p2p.py)
        sent.wait()
