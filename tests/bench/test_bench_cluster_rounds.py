"""`taco bench cluster`'s rounds: the runs of a round share one set of rank processes and take turns."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os

import pytest

from taco.bench import cluster, cluster_rounds
from taco.bench.cluster_noise import CONTROL
from taco.bench.cluster_records import RunRecord
from taco.bench.ranks import pin_cores, spawn_ranks
from taco.train.config import load_config
from taco.train.data import resolve_data_dir


class _Fake:
    """Stands in for a trainer: counts its steps, and logs every step it takes into `log`."""

    log: list[str] = []

    def __init__(self, spec):
        self.name, self.n, self.steps = spec["codec"], spec["steps"], []

    @property
    def done(self):
        return len(self.steps) >= self.n

    def step(self):
        self.steps.append(1)
        _Fake.log.append(self.name)

    def finish(self, rank):
        return dict(steps=len(self.steps))


def test_runs_take_turns_of_block_steps_in_alternating_order(monkeypatch):
    monkeypatch.setattr(cluster_rounds, "TimedRun", _Fake)
    _Fake.log = []
    specs = [dict(codec="a", steps=5), dict(codec="b", steps=5), dict(codec="c", steps=3)]
    out = cluster_rounds.train_round(specs, 2, 0)
    assert out == [dict(steps=5), dict(steps=5), dict(steps=3)]  # every run to its own end
    turns = "".join(_Fake.log)
    assert turns == "aabbcc" + "cbbaa" + "ab"  # the second block reversed; c had one step left
    with pytest.raises(ValueError, match="block-steps"):
        cluster_rounds.train_round(specs, 0, 0)


def test_a_round_shares_its_processes_only_between_like_runs():
    spec = dict(threads=1, backend="eager", timeout=60, config={})
    with pytest.raises(ValueError, match="share 'threads'"):
        cluster_rounds.rank_round(0, 1, 0, dict(runs=[spec, dict(spec, threads=2)], block=1))


def test_a_real_round_trains_each_run_as_alone(corpus, tmp_path):
    """Two ranks, the baseline, its A/A control and taco in one round: each run's losses are those of
    the same run trained alone (the turns do not leak state between trainers), bytes per step are
    the codec's."""
    path, cache = corpus
    cfg = load_config(None, [
        "--model.n_layer=1", "--model.n_head=2", "--model.hidden=32", "--model.seq_len=16",
        "--data.dataset=text", f"--data.path={path}", f"--data.cache_dir={cache}", "--data.vocab_size=300",
        "--train.batch_size=2", "--train.steps=4", "--train.eval_steps=1", f"--train.out_dir={tmp_path}",
        "--parallel.tp=2",
    ])  # fmt: skip
    data_dir = resolve_data_dir(cfg.data, prepare=True)
    args = argparse.Namespace(comm=["bf16"], codecs=["taco"], threads=1, backend="eager", warmup=1,
                              timeout=120, repeats=2)  # fmt: skip
    specs = cluster.plan_runs(cfg, args, data_dir)
    assert [s["codec"] for s in specs] == ["none", CONTROL, "taco"]
    together = spawn_ranks(cluster_rounds.rank_round, 2, dict(runs=specs, block=3))
    alone = spawn_ranks(cluster_rounds.rank_round, 2, dict(runs=specs[2:], block=3))
    runs = [RunRecord.from_json(dict(r, mode="bf16", codec=s["codec"], rate_mbit=None, world=2))
            for s, r in zip(specs, together)]  # fmt: skip
    assert [len(r.steps) for r in runs] == [4, 4, 4]
    assert [s.loss for s in runs[0].steps] == [s.loss for s in runs[1].steps]  # A and A' are one job
    assert [s["loss"] for s in alone[0]["steps"]] == [s.loss for s in runs[2].steps]
    assert alone[0]["val_loss"] == runs[2].val_loss
    plain, taco = runs[0].steps[-1], runs[2].steps[-1]
    assert plain.wire_bytes == plain.raw_bytes > 0 and 0 < taco.wire_bytes < 0.6 * taco.raw_bytes


def _pinned(rank: int, world: int) -> tuple[list[int], list[int]]:
    """In a fresh process: the share `pin_cores` returns and the affinity the process has after it."""
    share = pin_cores(rank, world)
    return sorted(share), sorted(os.sched_getaffinity(0))


def test_pinned_ranks_get_disjoint_shares_of_the_cores():
    """--pin-cores: rank r runs on the r-th share of the usable cores, the shares disjoint and covering
    them; with more ranks than cores nothing is pinned (a share per rank is impossible)."""
    cores = sorted(os.sched_getaffinity(0))
    n = len(cores)
    with mp.get_context("spawn").Pool(2, maxtasksperchild=1) as pool:  # a fresh process per call
        got = pool.starmap(_pinned, [(r, n) for r in range(n)] + [(0, n + 1)])
    shares = [share for share, now in got[:n]]
    assert all(share == now for share, now in got[:n])  # the process runs where pin_cores says
    assert shares == [[c] for c in cores]  # one core each, in rank order: disjoint, covering
    assert got[n] == (cores, cores)  # more ranks than cores: unchanged


def test_uncapped_rounds_train_at_least_uncapped_steps():
    """--uncapped-steps lengthens every run of the uncapped rounds to at least N steps (never
    shortens one), on a copy: the capped rounds keep the config's steps."""
    rounds = [[dict(codec="none", config=dict(train=dict(steps=40))),
               dict(codec="taco", config=dict(train=dict(steps=400)))]]  # fmt: skip
    longer = cluster.with_min_steps(rounds, 160)
    assert [s["config"]["train"]["steps"] for s in longer[0]] == [160, 400]
    assert [s["config"]["train"]["steps"] for s in rounds[0]] == [40, 400]
    assert cluster.with_min_steps(rounds, 0) == rounds
