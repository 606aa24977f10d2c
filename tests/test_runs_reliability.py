"""A run's failure modes end cleanly: verified checkpoints, one-line rank errors, signals, run folders.

Each test is small (world 2, the tiny TP=2 GPT of test_train, a few steps). The checkpoint tests
share one run (4 steps, checkpoints at steps 2 and 4), copied before being damaged.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch

from taco.train.config import load_config
from tests.test_train import TEXT, tiny_args

ROOT = Path(__file__).resolve().parents[1]
MESH = {"dp": 1, "pp": 1, "tp": 2, "sp": 0}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from taco.train.data import prepare_text

    d = tmp_path_factory.mktemp("corpus")
    (d / "play.txt").write_text(TEXT)
    prepare_text(d / "play.txt", d / "cache", vocab_size=300, progress=lambda *a: None)
    return d / "play.txt", d / "cache"


def test_the_process_group_timeout_is_a_config_field(corpus, tmp_path, monkeypatch):
    from taco.train import launch as launch_mod

    seen = {}
    monkeypatch.setattr(launch_mod.dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    cfg = load_config(None, [*tiny_args(corpus, tmp_path), "--parallel.tp=2", "--parallel.timeout_s=42"])
    launch_mod.init_rank(cfg, 0)
    assert seen["timeout"] == datetime.timedelta(seconds=42)
    # the TP/PP/DP groups too (dist.new_group's default is 30 min, whatever init_process_group got)
    groups = []
    monkeypatch.setattr(launch_mod.dist, "new_group", lambda ranks, **kw: groups.append(kw["timeout"]))
    for name, value in (("is_initialized", True), ("get_world_size", 2), ("get_rank", 0)):
        monkeypatch.setattr(launch_mod.dist, name, lambda v=value: v)
    monkeypatch.setattr("taco.train.trainer.Trainer", lambda *a, **kw: type("T", (), {"fit": dict})())
    launch_mod.run_rank(cfg, tmp_path, torch.device("cpu"))
    assert groups == [datetime.timedelta(seconds=42)]  # the one TP group of a tp=2 mesh
    assert load_config(None, tiny_args(corpus, tmp_path)).parallel.timeout_s <= 120  # a hang ends in ~2 min
    with pytest.raises(ValueError, match="parallel.timeout_s"):
        load_config(None, [*tiny_args(corpus, tmp_path), "--parallel.timeout_s=0"])
