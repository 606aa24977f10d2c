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

import torch
import torch.distributed as dist

from taco.codec import Codec
from taco.comm import CommPolicy
from taco.comm.telemetry import FidelityGuard, FidelityHistory, FidelityProbe, merge_sites

from .observers import StepEnd

log = logging.getLogger("taco.comm")


class FidelityTelemetry:
    """An observer of the TP policy (`taco.train.adaptive.observers`): its probe measures the
    messages of every `telemetry_every`-th step; at that step's end the ranks agree and the guard
    may switch sites. `c`: the [compression] section; `log`: this rank logs the guard's switches."""

    def __init__(self, policy: CommPolicy, c: Any, log: bool) -> None:
        self.every, self.log = c.telemetry_every, log
        self.policy = policy
        self.probe = FidelityProbe()
        self.history = FidelityHistory()
        self.guard = FidelityGuard(c.min_sqnr_db, c.guard_patience, c.guard_fallback) if c.guard else None
        self.probe.armed = True  # measures on the steps `_due` names
        self.last_step = 0
        """the latest step measured; `readings`, `cosines`, `specs` and `switched` are its (merged)"""
        self.readings: dict[str, Any] = {}
        self.cosines: dict[str, float] = {}
        self.specs: dict[str, str] = {}
        self.switched: dict[str, str] = {}
        """site -> the codec the guard switched it to at `last_step`"""

    def _due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def on_message(self, site: str, op: str, x: torch.Tensor, codec: Codec | None, step: int) -> None:
        if self._due(step):
            self.probe(site, op, x, codec)

    def on_step_end(self, end: StepEnd) -> None:
        if self._due(end.step):
            self._check(end.step, end.record)

    def _check(self, step: int, rec: dict[str, Any]) -> None:
        readings = self.probe.collect()
        local = (readings, {site: self.probe.specs[site] for site in readings}, self.probe.cosines)
        gathered: list[Any] = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        merged = merge_sites([r for r, _, _ in gathered])
        specs = {site: spec for _, sp, _ in gathered for site, spec in sp.items()}  # the same on every rank
        cosines: dict[str, float] = {}
        for _, _, cs in gathered:  # the worst rank's cosine, as the SQNR's
            for site, cos in cs.items():
                cosines[site] = min(cos, cosines.get(site, cos))
        self.last_step, self.readings, self.cosines, self.specs = step, merged, cosines, specs
        self.switched = {}
        for site, (db, bad_in, made) in merged.items():
            rec[f"sqnr_db/{site}"] = db
            rec[f"nonfinite_in/{site}"] = int(bad_in)
            rec[f"nonfinite/{site}"] = int(made)
            if site.endswith(".bwd") and site in cosines:
                rec[f"cos/{site}"] = cosines[site]
        self.history.add(merged)
        if self.guard is None:
            return
        for site, new, why in self.guard.decide(merged, specs):
            self.policy.set_site_codec(site, new)
            self.switched[site] = new
            line = f"fidelity guard: step {step} site {site!r}: {why}; codec {specs[site]} -> {new}"
            self.history.actions.append(line.removeprefix("fidelity guard: "))
            if self.log:
                log.warning("%s", line)

    def summary(self) -> str:
        """The `[tp fidelity]` section of comm_stats.txt."""
        return self.history.summary()
