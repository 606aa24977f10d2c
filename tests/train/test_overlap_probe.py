"""`parallel.tp_overlap = "auto"`: the probe times split and whole steps in A B / B A pairs and
keeps the split only where its gain clears the margin by the medians and by the pairs' lower bound;
in the trainer, the probe's steps keep the unsplit run's losses (codec none)."""

from __future__ import annotations

import json

import pytest

from taco.train.adaptive.observers import StepEnd
from taco.train.adaptive.overlap import OverlapProbe
from taco.train.launch import launch
from tests.helpers.runs import losses, tiny


class _Stage:
    """What the probe drives: the piece count the next steps run with, and a step clock that
    charges `cost(pieces, step)` seconds for a step run with that count."""

    def __init__(self, cost) -> None:
        self.pieces, self.cost, self.ran = 0, cost, []

    def set_pieces(self, k: int) -> None:
        self.pieces = k

    def drive(self, probe: OverlapProbe, steps: int) -> list[dict]:
        records = []
        for step in range(1, steps + 1):
            self.ran.append(self.pieces)
            rec: dict = {}
            probe.on_step_end(StepEnd(step, self.cost(self.pieces, step), rec))
            records.append(rec)
        return records


def _probe(stage: _Stage, start: int = 3, pairs: int = 6) -> OverlapProbe:
    return OverlapProbe(stage.set_pieces, 2, start=start, pairs=pairs, device="cpu")


def test_the_split_is_kept_where_it_pays_and_each_probe_step_is_charged_to_its_mode():
    stage = _Stage(lambda k, step: (0.8 if k == 2 else 1.0) + 0.01 * (step % 3))  # split: 20% faster
    probe = _probe(stage)
    records = stage.drive(probe, 20)
    assert stage.ran[:3] == [2, 2, 2]  # before the probe: split, the mode asked for
    # 6 pairs in A B / B A order: (split, whole), (whole, split), ...
    assert stage.ran[3:15] == [2, 1, 1, 2, 2, 1, 1, 2, 2, 1, 1, 2]
    assert [r.get("tp_overlap_pieces") for r in records[3:15]] == stage.ran[3:15]
    assert "tp_overlap_pieces" not in records[2] and "tp_overlap_pieces" not in records[15]
    assert stage.ran[15:] == [2] * 5 and probe.decision is not None
    d = probe.summary()
    assert d["kept"] is True and d["pieces"] == 2 and d["pairs"] == 6
    assert d["split_step_s"] < d["whole_step_s"] and d["gain_low_s"] > 0.02 * d["whole_step_s"]


def test_a_split_that_is_slower_is_turned_off_for_the_rest_of_the_run():
    stage = _Stage(lambda k, step: 1.05 if k == 2 else 1.0)  # a fast link: only the split's cost
    probe = _probe(stage)
    stage.drive(probe, 30)
    assert probe.summary()["kept"] is False and stage.ran[15:] == [1] * 15


def test_a_gain_inside_the_margin_or_the_pairs_spread_keeps_the_run_whole():
    # 1% faster: under the 2% margin
    stage = _Stage(lambda k, step: 0.99 if k == 2 else 1.0)
    stage.drive(probe := _probe(stage), 16)
    assert probe.summary()["kept"] is False
    # 10% faster by the median, but one pair has the split 10% slower: with 6 pairs the lower bound
    # is the smallest gain, so the evidence does not clear the margin
    stage = _Stage(lambda k, step: (1.2 if step == 4 else 0.9) if k == 2 else 1.0)
    stage.drive(probe := _probe(stage), 16)
    assert stage.ran[3] == 2 and probe.summary()["kept"] is False
    assert probe.summary()["split_step_s"] == pytest.approx(0.9)


def test_the_probe_starts_after_its_start_steps_and_decides_once():
    stage = _Stage(lambda k, step: 0.5 if k == 2 else 1.0)
    probe = _probe(stage, start=0, pairs=1)
    stage.drive(probe, 6)
    assert stage.ran == [2, 1, 2, 2, 2, 2] and probe.summary()["kept"] is True
    with pytest.raises(ValueError, match="pieces"):
        OverlapProbe(stage.set_pieces, 1, start=0, pairs=1, device="cpu")


def test_auto_overlap_in_the_trainer_keeps_the_unsplit_losses_and_records_its_decision(corpus, tmp_path):
    every = ["--compression.tp_codec=none", "--train.log_interval=1", "--train.steps=18"]
    auto = ["--parallel.tp_overlap=auto", "--parallel.tp_overlap_probe_pairs=4"]
    launch(tiny(corpus, tmp_path / "plain", *every))
    launch(tiny(corpus, tmp_path / "auto", *every, *auto))
    got, ref = losses(tmp_path / "auto"), losses(tmp_path / "plain")
    assert got.keys() == ref.keys() and max(abs(got[s] - ref[s]) / abs(ref[s]) for s in got) <= 1e-5
    decision = json.loads((tmp_path / "auto" / "summary.json").read_text())["tp_overlap"]
    assert decision["pairs"] == 4 and decision["kept"] in (True, False)
    assert decision["pieces"] == (2 if decision["kept"] else 1)
    recs = [json.loads(x) for x in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    probed = [r["tp_overlap_pieces"] for r in recs if "tp_overlap_pieces" in r]
    assert probed == [2, 1, 1, 2, 2, 1, 1, 2]  # steps 4-11, in A B / B A order


def test_auto_overlap_is_checked_like_batch_split(corpus, tmp_path):
    with pytest.raises(ValueError, match="must divide the micro-batch"):
        tiny(corpus, tmp_path / "x", "--parallel.tp_overlap=auto", "--parallel.tp_overlap_chunks=3")
    with pytest.raises(ValueError, match="tp_overlap_probe_pairs"):
        tiny(corpus, tmp_path / "x", "--parallel.tp_overlap=auto", "--parallel.tp_overlap_probe_pairs=0")
