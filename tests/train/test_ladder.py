"""The ladder controller: moves along the ladder by the telemetry's merged readings, hysteresis,
the guard's collapse to "none", the auto policy's plain sites, ladder.json on resume, and ranks
that never diverge (gloo)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from taco.codec import build_codec, parse_ladder
from taco.comm import CommPolicy
from taco.train.adaptive import LadderController, StepEnd, build_wing
from taco.train.adaptive.ladder import LADDER_FILE, cos_db
from taco.train.build import build_policy
from taco.train.config import load_config
from tests.helpers.dist import run_distributed

DEMO = "ladder(int4-hadamard,int5-hadamard,int6-hadamard,taco,none)"
RUNGS = parse_ladder(DEMO).with_options({})


class _Telemetry:
    """What the controller reads of `FidelityTelemetry`: the merged readings of its latest step."""

    def __init__(self) -> None:
        self.last_step, self.readings, self.cosines, self.specs, self.switched = 0, {}, {}, {}, {}

    def check(self, step: int, sites: dict[str, float], policy: CommPolicy, made: float = 0.0) -> None:
        self.last_step, self.switched = step, {}
        self.readings = {s: (db, 0.0, made) for s, db in sites.items()}
        self.cosines = {s: 1.0 - 10 ** (-db / 10) for s, db in sites.items()}  # cos_db(cos) == db
        self.specs = {s: _codec(policy, s, full=True) for s in sites}


def _controller(tmp_path, *flags, auto=None, resume=False):
    c = load_config(None, [f"--compression.tp_codec={DEMO}", *flags]).compression
    policy = CommPolicy(codec=build_codec(DEMO))
    tel = _Telemetry()
    ctl = LadderController(policy, RUNGS, tel, c, out_dir=tmp_path, resume=resume, log=True, auto=auto)
    return ctl, tel, policy


def _step(ctl, tel, policy, step, sites, made=0.0):
    tel.check(step, sites, policy, made)
    rec: dict = {}
    ctl.on_step_end(StepEnd(step, 0.1, rec))
    return rec


def _codec(policy, site, full=False):
    c = policy.codec_for(site, 1 << 20, torch.bfloat16)
    spec = c.spec if c is not None else "none"
    return spec if full else spec.split("(")[0]


def test_a_site_moves_down_after_confirmed_room_and_up_at_once_never_back(tmp_path):
    ctl, tel, policy = _controller(tmp_path)  # fwd target 24 dB, margin 6, confirm 2
    assert _codec(policy, "a.fwd") == "int6-hadamard"  # the middle rung
    assert "ladder_moves" not in _step(ctl, tel, policy, 10, {"a.fwd": 32.0})  # one check: not yet
    rec = _step(ctl, tel, policy, 20, {"a.fwd": 32.0})
    (move,) = rec["ladder_moves"]
    assert (move["step"], move["site"], move["direction"]) == (20, "a.fwd", "fwd")
    assert move["frm"].startswith("int6-hadamard") and move["to"].startswith("int5-hadamard")
    assert move["measure_db"] == 32.0 and _codec(policy, "a.fwd") == "int5-hadamard"
    (move,) = _step(ctl, tel, policy, 30, {"a.fwd": 23.0})["ladder_moves"]  # under target: up at once
    assert move["to"].startswith("int6-hadamard")
    for step in range(40, 200, 10):  # room to spare again, but int5 failed once: it stays on int6
        assert "ladder_moves" not in _step(ctl, tel, policy, step, {"a.fwd": 40.0})
    assert ctl.sites["a.fwd"].moves == 2 and _codec(policy, "a.fwd") == "int6-hadamard"
    assert abs(_step(ctl, tel, policy, 200, {"a.fwd": 40.0})["ladder_bytes_per_elem"] - 0.78125) < 1e-6


def test_backward_sites_move_by_their_cosine_and_moves_are_capped(tmp_path):
    flags = ("--compression.ladder_max_moves=1", "--compression.ladder_bwd_cos=0.99")
    ctl, tel, policy = _controller(tmp_path, *flags)
    target = cos_db(0.99)
    assert abs(ctl.target("b.bwd") - target) < 1e-9 and ctl.target("b.fwd") == 24.0
    for step in (10, 20, 30, 40, 50):
        _step(ctl, tel, policy, step, {"b.bwd": target + 30})
    assert _codec(policy, "b.bwd") == "int5-hadamard" and ctl.sites["b.bwd"].moves == 1  # capped at one


@pytest.mark.parametrize("kind", ["nan", "drop"])
def test_a_collapsing_site_goes_to_none_and_stays_logged(tmp_path, kind, caplog):
    ctl, tel, policy = _controller(tmp_path)
    _step(ctl, tel, policy, 10, {"a.fwd": 30.0})
    if kind == "nan":
        rec = _step(ctl, tel, policy, 20, {"a.fwd": 30.0}, made=5)
    else:
        rec = _step(ctl, tel, policy, 20, {"a.fwd": 30.0 - 16})  # > ladder_drop_db below its last
    (move,) = rec["ladder_moves"]
    assert move["to"] == "none" and move["why"].startswith("collapse") and _codec(policy, "a.fwd") == "none"
    assert "ladder: step 20 site 'a.fwd': collapse" in caplog.text
    assert "ladder_moves" not in _step(ctl, tel, policy, 30, {"a.fwd": 80.0})


def test_a_site_the_auto_policy_left_plain_is_never_touched(tmp_path):
    auto = SimpleNamespace(choice={"a.fwd": False, "b.fwd": True})
    ctl, tel, policy = _controller(tmp_path, auto=auto)
    for step in (10, 20):
        _step(ctl, tel, policy, step, {"a.fwd": 40.0, "b.fwd": 40.0})
    assert "a.fwd" not in ctl.sites and _codec(policy, "b.fwd") == "int5-hadamard"
    policy.set_site_codec("b.fwd", RUNGS.rungs[2])  # another observer (auto re-enabling) sets a rung
    _step(ctl, tel, policy, 30, {"b.fwd": 28.0})
    assert ctl.sites["b.fwd"].rung == 2  # the ladder follows the site's codec


def test_state_is_saved_and_a_resumed_run_reinstalls_it(tmp_path):
    ctl, tel, policy = _controller(tmp_path)
    for step in (10, 20, 30):
        _step(ctl, tel, policy, step, {"a.fwd": 32.0, "b.bwd": 40.0, "c.fwd": 23.0 if step == 10 else 27.0})
    doc = json.loads((tmp_path / LADDER_FILE).read_text())
    assert doc["sites"]["a.fwd"]["rung"] == 1 and doc["sites"]["c.fwd"]["rung"] == 3
    assert [d["site"] for d in doc["decisions"]] == ["c.fwd", "a.fwd", "b.bwd"]
    fresh, _, p2 = _controller(tmp_path)  # not resuming: the file is ignored
    assert not fresh.sites and _codec(p2, "a.fwd") == "int6-hadamard"
    again, _, p3 = _controller(tmp_path, resume=True)
    assert {s: _codec(p3, s) for s in ("a.fwd", "b.bwd", "c.fwd")} == {
        "a.fwd": "int5-hadamard", "b.bwd": "int5-hadamard", "c.fwd": "taco"}  # fmt: skip
    assert again.sites["c.fwd"].floor == 3 and len(again.decisions) == 3
    assert "c.fwd" in again.format_table() and again.summary()["sites"]["a.fwd"]["moves"] == 1


def test_a_runs_codecs_at_a_step_are_read_back_from_its_ladder_json(tmp_path):
    ctl, tel, policy = _controller(tmp_path)
    for step in (10, 20, 30):
        _step(ctl, tel, policy, step, {"a.fwd": 32.0, "b.bwd": 40.0, "c.fwd": 23.0 if step == 10 else 27.0})
    doc = json.loads((tmp_path / LADDER_FILE).read_text())
    moved = [(d["step"], d["site"], d["to"]) for d in doc["decisions"]]
    assert [m[:2] for m in moved] == [(10, "c.fwd"), (20, "a.fwd"), (20, "b.bwd")]
    at = {k: LadderController.codecs_at(doc, k) for k in (1, 9, 10, 19, 20, 300)}
    start = RUNGS.rungs[RUNGS.start]
    assert at[1] == at[9] == {"a.fwd": start, "b.bwd": start, "c.fwd": start}  # the start rung from step 1
    assert at[10] == at[19] == {**at[1], "c.fwd": moved[0][2]}  # a move of step k: the codecs from step k + 1
    assert at[20] == at[300] == {**at[10], "a.fwd": moved[1][2], "b.bwd": moved[2][2]}
    assert at[300] == {s: ctl.ladder.rungs[st.rung] for s, st in ctl.sites.items()}  # the run's end state
    with pytest.raises(ValueError, match="not a ladder.json"):
        LadderController.codecs_at({"sites": {}}, 1)


def test_a_calibrated_codec_is_the_start_rung(tmp_path):
    ctl, tel, policy = _controller(tmp_path)
    policy.set_site_codec("a.fwd", "int4-hadamard")  # as calibration installs its choice
    policy.set_site_codec("b.fwd", "int8-hadamard")  # not on the ladder: the rung of at least its bytes
    _step(ctl, tel, policy, 10, {"a.fwd": 25.0, "b.fwd": 25.0})
    assert ctl.sites["a.fwd"].rung == 0 and RUNGS.rungs[ctl.sites["b.fwd"].rung].startswith("taco")


def _rank(rank: int, world: int, steps: int) -> list:
    """One rank: a real policy and wing; rank 0 sends Gaussian messages, rank 1 Student-t ones (at
    int5-hadamard rank 0 reads under the fwd target, rank 1 over it): only merged readings agree."""
    cfg = load_config(None, [
        f"--compression.tp_codec={DEMO}", "--compression.telemetry_every=1",
        "--compression.ladder_fwd_sqnr_db=27.5", "--compression.ladder_down_margin_db=5",
        "--compression.ladder_confirm_checks=1", f"--train.out_dir={torch.__file__}.unused",
    ])  # fmt: skip
    policy = build_policy(cfg)
    wing = build_wing(cfg, policy, tp_group=None, device=torch.device("cpu"), decides=rank == 0,
                      captures=False, log=False)  # fmt: skip
    out, local = [], []
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(100 * rank + step)
        wing.begin_step(step)
        for site in ("a.fwd", "b.bwd"):
            if rank == 0:
                x = torch.randn(64, 256, generator=g)
            else:
                x = torch.distributions.StudentT(2.0).sample((64, 256))
            x = x.bfloat16()
            codec = policy.codec_for(site, x.numel(), x.dtype)
            policy.observer(site, "all_reduce", x, codec)
            if codec is not None and codec.spec.startswith("int5"):
                local.append(wing.fidelity.probe._pending[site][0].item())
        rec: dict = {}
        wing.end_step(StepEnd(step, 0.1, rec))
        out.append(policy.site_codecs())
    return [out, local, wing.ladder.decisions]


def test_ranks_decide_the_same_at_every_step_without_a_collective_of_their_own():
    r0, r1 = run_distributed(_rank, 2, 6)
    assert r0[0] == r1[0], (r0[0], r1[0])  # the same codec at every site after every step
    assert r0[2] == r1[2] and r0[2], r0[2]
    # alone, the ranks would disagree: int5's SQNR is under the target on rank 0, over it on rank 1
    assert r0[1] and r1[1] and max(r0[1]) < 27.5 < min(r1[1]), (r0[1], r1[1])
    assert r0[0][-1]["a.fwd"].startswith("int6-hadamard")  # the worst rank's reading moved it back up
    assert not any(math.isnan(d["measure_db"]) for d in r0[2])


def test_a_ladder_config_checks_its_rungs_and_makes_the_guard_send_collapses_to_none(tmp_path):
    from taco.codec import list_codecs
    from taco.train.config.loading import check_codecs

    cfg = load_config(None, [f"--compression.tp_codec={DEMO}", f"--train.out_dir={tmp_path}"])
    check_codecs(cfg, list_codecs())
    with pytest.raises(ValueError, match="nosuch"):
        load_config(None, ["--compression.tp_codec=ladder(taco,nosuch)"])
    with pytest.raises(ValueError, match="telemetry_every"):
        load_config(None, [f"--compression.tp_codec={DEMO}", "--compression.telemetry_every=0"])
    wing = build_wing(cfg, build_policy(cfg), tp_group=None, device=torch.device("cpu"), decides=True,
                      captures=False, log=False)  # fmt: skip
    guard = wing.fidelity.guard
    assert wing.ladder is not None and guard.fallback == "none" and guard.floor_db == -math.inf
    assert wing.on_step_end.index(wing.ladder) > wing.on_step_end.index(wing.fidelity)  # reads its step
