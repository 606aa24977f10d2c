"""One round of `taco bench cluster`: every run of the round side by side in one set of rank processes.

Why this file exists: two runs of the same job in two sets of processes differ by a few percent on
a shared machine (where the ranks land, the box drifting between runs), more than many effects the
bench should see (docs/design.md 3, "noise"). So the runs of a round (each (mode, codec), the
baseline and its A/A control) live in the same rank processes: each rank builds one trainer per
run, then the trainers take turns, `block` steps at a time, in an order that reverses every block
(A B C, C B A, A B C ..). Drift within the round and the processes' own luck fall on every run of
the round alike and cancel in its ratios. Rounds are separate processes, so the spread between
rounds (the intervals of `cluster_noise.py`) still measures what is left.

    records = spawn_ranks(rank_round, world, dict(runs=[spec, ...], block=10))

Each spec is one of `cluster.plan_runs` (a peer's, `peers.py`, runs beside the project's); the runs
of a round must share world size, compute threads and backend (those are the processes'). A record
per run, in the specs' order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .cluster_records import PHASES
from .ranks import gloo_rank

STEP_KEYS = ("wire_bytes", "raw_bytes", *PHASES)


class TimedRun:
    """One run of a round: the project's run (`taco.train.build.build_run`, this rank's share of
    it) and its per-step records."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from taco.train.build import build_run
        from taco.train.config import Config

        self.spec = spec
        self.cfg = Config.from_dict(spec["config"])
        self.run = build_run(self.cfg, self.cfg.parallel.dims().build(), Path(spec["data_dir"]))
        self.steps: list[dict[str, Any]] = []

    @property
    def done(self) -> bool:
        return self.run.iteration >= self.cfg.train.steps

    def step(self) -> None:
        """One optimizer step, timed by the run; the TP policy's byte and phase counters of it."""
        run = self.run
        stats = run.policy.stats
        before = stats.total()
        st = run.step()
        after = stats.total()
        delta = {k: getattr(after, k) - getattr(before, k) for k in STEP_KEYS}
        self.steps.append(dict(step_s=st.seconds, loss=st.loss, **delta))
        # compression.when = "auto" decides here, outside the timed step
        run.end_step(dict(step=run.iteration, step_s=st.seconds, loss=st.loss))

    def finish(self, rank: int) -> dict[str, Any]:
        """The run's record: its steps, the validation loss, the bytes of each TP site."""
        run = self.run
        sites = {
            n: dict(calls=s.calls, raw_bytes=s.raw_bytes, wire_bytes=s.wire_bytes)
            for n, s in run.policy.stats.sites.items()
        }
        if run.wing.auto is not None and rank == 0:
            print(run.wing.auto.format_table(), flush=True)
        return dict(steps=self.steps, val_loss=run.evaluate(), sites=sites)


def block_order(n: int, index: int) -> list[int]:
    """The order of `n` runs in block `index`: each run once, every other block reversed."""
    return list(range(n)) if index % 2 == 0 else list(range(n))[::-1]


def make_run(spec: dict[str, Any]) -> Any:
    """The project's trainer for a spec, or a peer's (`peers.py`) for a `peer:` spec."""
    if spec.get("peer"):
        from taco.train.config import Config

        from .peers import PeerRun

        return PeerRun(spec["peer"], Config.from_dict(spec["config"]), Path(spec["data_dir"]))
    return TimedRun(spec)


def train_round(specs: list[dict[str, Any]], block: int, rank: int) -> list[dict[str, Any]]:
    """Build a run per spec, then step them by turns of `block` steps until all are done."""
    if block < 1:
        raise ValueError(f"--block-steps must be >= 1, got {block}")
    runs = [make_run(s) for s in specs]
    b = 0
    while not all(r.done for r in runs):
        for i in block_order(len(runs), b):
            for _ in range(block):
                if runs[i].done:
                    break
                runs[i].step()
        b += 1
    return [r.finish(rank) for r in runs]


def rank_round(rank: int, world: int, port: int, job: dict[str, Any]) -> list[dict[str, Any]]:
    """The body of one rank process: the round's runs (`job["runs"]`) on one gloo world."""
    specs = job["runs"]
    first = specs[0]
    for key in ("threads", "backend", "timeout", "pin"):
        if any(s[key] != first[key] for s in specs):
            raise ValueError(f"the runs of one round must share {key!r} (they share processes)")
    if first["backend"] == "auto":
        import taco.kernels  # noqa: F401 - registers the native CPU codec kernels
    with gloo_rank(rank, world, port, first["threads"], first["timeout"], first.get("pin", False)):
        return train_round(specs, job["block"], rank)
