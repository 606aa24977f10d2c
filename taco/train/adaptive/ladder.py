"""A ladder TP codec (`compression.tp_codec = "ladder(...)"`): each site's codec chosen by its fidelity.

Why this file exists: one codec for every TP site is a compromise; the fidelity telemetry already
measures each compressed site on its sampled steps, so a closed loop can move each site (a site is
one direction: `{name}.fwd` carries activations, `{name}.bwd` activation gradients) along the ladder's
rungs, cheapest first. The measure of a forward site is its SQNR; of a backward site its cosine
against the uncompressed value, compared in dB as -10 log10(1 - cos) (for noise orthogonal to the
signal that is the SQNR + 3 dB, so one margin serves both directions).

At every telemetry step, after the telemetry's exchange, each site's measure m against its
direction's target T (docs/ladder.md says how the defaults were measured):

* m < T: one rung up (safer), at once; the rung it left becomes the site's floor (it never goes
  back below it), so a site cannot oscillate;
* m >= T + `ladder_down_margin_db` on `ladder_confirm_checks` checks in a row: one rung down (a rung
  of an int-N Hadamard ladder costs ~6 dB), unless the site has made `ladder_max_moves` moves;
* NaN/Inf from finite input, or m below the site's previous reading on the same rung by more than
  `ladder_drop_db`: the site goes to "none" and stays (the guard's fallback in a ladder run is
  "none" too; a site the guard switched is left to it).

Every rank decides from the merged readings the telemetry's all_gather_object already gave every
rank, so the ranks of a TP group switch the same sites at the same step with no collective of the
ladder's own. A site `compression.when = "auto"` left uncompressed is never touched (it sends no
readings). Decisions go to the step's record (`ladder_moves`, metrics.jsonl); the state to
`ladder.json` in the run folder (a resumed run reinstalls it); `format_table` is the per-site table
of the end of the run.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from taco.codec import Ladder, build_codec, parse_ladder
from taco.comm import CommPolicy

from .fidelity import FidelityTelemetry
from .observers import StepEnd

log = logging.getLogger("taco.comm")

LADDER_FILE = "ladder.json"
VERSION = 1


def cos_db(cos: float) -> float:
    """A cosine on the SQNR's dB scale: -10 log10(1 - cos) (capped at 200 dB for cos >= 1)."""
    return 200.0 if cos >= 1.0 else -10.0 * math.log10(1.0 - cos)


@dataclass
class SiteState:
    """One site's place on the ladder and what moved it."""

    rung: int
    floor: int = 0
    """the cheapest rung it may go to (raised past a rung it left for missing the target)"""
    moves: int = 0
    good: int = 0
    """consecutive checks with room for a cheaper rung"""
    last: float | None = None
    """its previous measure (dB) on its current rung"""
    latest: float | None = None
    """its latest measure (dB)"""
    pinned: str = ""
    """why the ladder no longer moves it ("" while it does)"""
    rungs: list[tuple[int, int]] = field(default_factory=list)
    """(step, rung) from its start: its width over the run"""


class LadderController:
    """The step observer that moves sites along the ladder (see the module doc); registered after
    the fidelity telemetry, reads its latest merged readings."""

    def __init__(
        self, policy: CommPolicy, ladder: Ladder, telemetry: FidelityTelemetry, c: Any, *,
        out_dir: Path, resume: bool, log: bool, auto: Any = None,
    ) -> None:  # fmt: skip
        """`ladder`: its rungs as full specs (`Ladder.with_options`); `c`: the [compression] section;
        `log`: this rank logs and writes ladder.json; `auto`: the run's `AutoPolicy`, if any."""
        self.policy, self.ladder, self.telemetry, self.auto, self.log = policy, ladder, telemetry, auto, log
        self.fwd_db, self.bwd_db = c.ladder_fwd_sqnr_db, cos_db(c.ladder_bwd_cos)
        self.margin, self.confirm = c.ladder_down_margin_db, c.ladder_confirm_checks
        self.max_moves, self.drop = c.ladder_max_moves, c.ladder_drop_db
        self.rung_bytes = [self._bytes(r) for r in ladder.rungs]
        self.path = out_dir / LADDER_FILE
        self.sites: dict[str, SiteState] = {}
        self.decisions: list[dict[str, Any]] = []
        if resume and self.path.exists():
            self.restore(json.loads(self.path.read_text()))

    @staticmethod
    def _bytes(spec: str) -> float:
        codec = build_codec(spec)
        return codec.bytes_per_elem() if codec is not None else 2.0

    def target(self, site: str) -> float:
        return self.bwd_db if site.endswith(".bwd") else self.fwd_db

    def start_rung(self, spec: str) -> int:
        """The rung of a site first seen with codec `spec`: that rung if the ladder has it (the
        ladder's start, or what calibration installed), else the cheapest rung sending at least
        its bytes (the safest if none does)."""
        if spec in self.ladder.rungs:
            return self.ladder.rungs.index(spec)
        b = self._bytes(spec)
        return next((i for i, rb in enumerate(self.rung_bytes) if rb >= b), len(self.rung_bytes) - 1)

    # -- deciding ---------------------------------------------------------------------------------
    def on_step_end(self, end: StepEnd) -> None:
        t = self.telemetry
        if t.last_step != end.step:
            return
        moves = []
        for site, (db, _bad_in, made) in t.readings.items():
            if self.auto is not None and self.auto.choice.get(site) is False:
                continue  # left uncompressed by the auto policy: it pays to send it plain
            spec = t.specs.get(site, "")
            st = self.sites.get(site)
            if st is None:
                st = self.sites[site] = SiteState(self.start_rung(spec))
                st.rungs.append((end.step, st.rung))
            if st.pinned:
                continue
            if spec in self.ladder.rungs and self.ladder.rungs.index(spec) != st.rung:
                st.rung, st.last, st.good = self.ladder.rungs.index(spec), None, 0  # set by another observer
            if site in t.switched:  # the guard acted on it this step: its codec is the guard's now
                st.pinned = f"guard: {t.switched[site]}"
                continue
            m = cos_db(t.cosines[site]) if site.endswith(".bwd") and site in t.cosines else db
            move = self.decide(site, st, m, made)
            if move is not None:
                moves.append(self._apply(end.step, site, st, *move, m))
        if moves:
            end.record["ladder_moves"] = moves
            self.save(end.step)
        end.record["ladder_bytes_per_elem"] = self.mean_bytes()

    def decide(self, site: str, st: SiteState, m: float, made: float) -> tuple[int, str] | None:
        """(new rung, reason) for a site measuring `m` dB on its rung, or None to stay."""
        top = len(self.ladder.rungs) - 1
        previous, st.last, st.latest = st.last, m, m
        if made > 0 or not math.isfinite(m):
            return top, f"collapse: {int(made)} non-finite elements from finite input"
        if previous is not None and previous - m > self.drop:
            return top, f"collapse: {previous:.1f} -> {m:.1f} dB (drop > {self.drop:.0f} dB)"
        target = self.target(site)
        if m < target and st.rung < top:
            st.floor = max(st.floor, st.rung + 1)
            return st.rung + 1, f"{m:.1f} dB < target {target:.1f} dB"
        if m >= target + self.margin and st.rung > st.floor and st.moves < self.max_moves:
            st.good += 1
            if st.good >= self.confirm:
                why = f"{m:.1f} dB >= target {target:.1f} + {self.margin:.1f} dB at {st.good} checks"
                return st.rung - 1, why
        else:
            st.good = 0
        return None

    def _apply(self, step: int, site: str, st: SiteState, rung: int, why: str, m: float) -> dict[str, Any]:
        old = self.ladder.rungs[st.rung]
        new = self.ladder.rungs[rung]
        self.policy.set_site_codec(site, new)  # every rank, the same step: the same merged numbers
        if why.startswith("collapse"):
            st.pinned = why
        st.rung, st.moves, st.good, st.last = rung, st.moves + 1, 0, None
        st.rungs.append((step, rung))
        d = dict(step=step, site=site, direction=site.rsplit(".", 1)[-1], frm=old, to=new,
                 measure_db=round(m, 3), target_db=round(self.target(site), 3), why=why)  # fmt: skip
        self.decisions.append(d)
        if self.log:
            level = logging.WARNING if st.pinned else logging.INFO
            log.log(level, "ladder: step %d site %r: %s; codec %s -> %s", step, site, why, old, new)
        return d

    # -- state ------------------------------------------------------------------------------------
    def mean_bytes(self) -> float:
        """Wire bytes per element of the sites' current rungs, averaged over sites (0 if none)."""
        if not self.sites:
            return 0.0
        return sum(self.rung_bytes[s.rung] for s in self.sites.values()) / len(self.sites)

    def state(self, step: int) -> dict[str, Any]:
        return dict(version=VERSION, ladder=self.ladder.spec, step=step,
                    sites={s: asdict(st) for s, st in sorted(self.sites.items())},
                    decisions=self.decisions)  # fmt: skip

    def save(self, step: int) -> None:
        if self.log:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.state(step), indent=1))
            tmp.replace(self.path)

    def restore(self, doc: dict[str, Any]) -> None:
        """A ladder.json of this ladder: reinstall each site's rung and its state (every rank)."""
        if doc.get("version") != VERSION or doc.get("ladder") != self.ladder.spec:
            raise ValueError(f"{self.path}: not a ladder.json of {self.ladder.spec}")
        for site, d in doc["sites"].items():
            st = SiteState(**{**d, "rungs": [tuple(r) for r in d["rungs"]]})
            self.sites[site] = st
            self.policy.set_site_codec(site, self.ladder.rungs[st.rung])
        self.decisions = list(doc.get("decisions", []))

    # -- reading a run back -----------------------------------------------------------------------
    @staticmethod
    def codecs_at(doc: dict[str, Any], step: int) -> dict[str, str]:
        """Each site's codec (full spec) in the run whose ladder.json is `doc` as it stood at the end
        of `step`: the moves of steps <= `step` applied, so the codecs of step `step + 1`'s
        collectives. A site's first entry is its start rung, which it had from step 1 on."""
        ladder = parse_ladder(doc.get("ladder"))
        if doc.get("version") != VERSION or ladder is None:
            raise ValueError("not a ladder.json (no version/ladder fields of this taco)")
        out = {}
        for site, d in doc["sites"].items():
            rungs = [tuple(r) for r in d["rungs"]]
            rung = rungs[0][1] if rungs else ladder.start
            for s, r in rungs:
                if s <= step:
                    rung = r
            out[site] = ladder.rungs[rung]
        return out

    # -- reporting --------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """summary.json's "ladder": the rungs, the targets, each site's state, every decision."""
        return dict(rungs=list(self.ladder.rungs), fwd_target_db=self.fwd_db, bwd_target_db=self.bwd_db,
                    mean_bytes_per_elem=self.mean_bytes(),
                    sites={s: dict(codec=self.ladder.rungs[st.rung], moves=st.moves, last_db=st.latest,
                                   pinned=st.pinned, rungs=st.rungs) for s, st in sorted(self.sites.items())},
                    decisions=self.decisions)  # fmt: skip

    def format_table(self) -> str:
        """One line per site: its start and final codec, moves, last measure against its target."""
        if not self.sites:
            return "ladder: no site measured (telemetry off, or no compressed site)"
        w = max(len(s) for s in self.sites)
        names = ",".join(r.split("(")[0] for r in self.ladder.rungs)
        lines = [
            f"ladder({names}): mean {self.mean_bytes():.3f} B/elem over {len(self.sites)} sites, "
            f"targets fwd {self.fwd_db:.1f} dB SQNR, bwd {self.bwd_db:.1f} dB (-10 log10(1 - cos))",
            f"{'site':<{w}} {'start':<16} {'now':<16} {'B/elem':>6} {'moves':>5} {'last dB':>8} "
            f"{'target':>7}  note",
        ]
        for site, st in sorted(self.sites.items()):
            start = self.ladder.rungs[st.rungs[0][1]].split("(")[0] if st.rungs else "?"
            now = self.ladder.rungs[st.rung].split("(")[0]
            last = f"{st.latest:8.2f}" if st.latest is not None else f"{'-':>8}"
            lines.append(f"{site:<{w}} {start:<16} {now:<16} {self.rung_bytes[st.rung]:>6.3f} {st.moves:>5d} "
                         f"{last} {self.target(site):>7.1f}  {st.pinned}")  # fmt: skip
        return "\n".join(lines)
