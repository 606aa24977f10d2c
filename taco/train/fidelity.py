"""The trainer's fidelity telemetry and guard (`compression.telemetry_every`, `guard*`).

Why this file exists: the measurement is generic (`taco.comm.telemetry`); this is the step-boundary
glue. Every `telemetry_every` steps the probe on the TP policy measures each compressed site's first
message of the step; after the step every rank reads its readings once, the ranks exchange them
(`all_gather_object` over the job: one host sync and one small collective per telemetry step), and
every rank merges the same numbers, so the guard's `set_site_codec` calls agree on every rank.
The record gets `sqnr_db/<site>`, `nonfinite_in/<site>` and `nonfinite/<site>` (non-finite
elements the codec made from finite input) for metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from taco.comm.telemetry import FidelityGuard, FidelityHistory, FidelityProbe, merge_sites

log = logging.getLogger("taco.comm")


class FidelityTelemetry:
    """A `Trainer.step_hooks` entry; built with the trainer, it chains its probe onto `trainer.policy`."""

    def __init__(self, trainer: Any) -> None:
        c = trainer.cfg.compression
        self.every, self.log = c.telemetry_every, trainer.log
        self.policy = trainer.policy
        self.probe = FidelityProbe()
        self.history = FidelityHistory()
        self.guard = FidelityGuard(c.min_sqnr_db, c.guard_patience, c.guard_fallback) if c.guard else None
        self.probe.armed = True  # measures on the steps `_due` names: trainer.step + 1 is the one running
        prev = self.policy.observer
        mine = lambda *a: self.probe(*a) if self._due(trainer.step + 1) else None  # noqa: E731
        self.policy.observer = lambda *a: (prev and prev(*a), mine(*a))

    def _due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def __call__(self, trainer: Any, rec: dict[str, Any]) -> None:
        if self._due(rec["step"]):
            self._check(rec["step"], rec)

    def _check(self, step: int, rec: dict[str, Any]) -> None:
        readings = self.probe.collect()
        local = (readings, {site: self.probe.specs[site] for site in readings})
        gathered: list[Any] = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        merged = merge_sites([r for r, _ in gathered])
        specs = {site: spec for _, sp in gathered for site, spec in sp.items()}  # the same on every rank
        for site, (db, bad_in, made) in merged.items():
            rec[f"sqnr_db/{site}"] = db
            rec[f"nonfinite_in/{site}"] = int(bad_in)
            rec[f"nonfinite/{site}"] = int(made)
        self.history.add(merged)
        if self.guard is None:
            return
        for site, new, why in self.guard.decide(merged, specs):
            self.policy.set_site_codec(site, new)
            line = f"fidelity guard: step {step} site {site!r}: {why}; codec {specs[site]} -> {new}"
            self.history.actions.append(line.removeprefix("fidelity guard: "))
            if self.log:
                log.warning("%s", line)

    def summary(self) -> str:
        """The `[tp fidelity]` section of comm_stats.txt."""
        return self.history.summary()
