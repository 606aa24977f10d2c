"""Fidelity telemetry of compressed sites: the SQNR and non-finite counts of real messages, and the guard.

Why this file exists: a codec's error is only known on the tensors a run really sends
(docs/design.md 1.4, 4). A `FidelityProbe`, installed as a `CommPolicy.observer`, round-trips the
first message of each compressed site through the site's codec on the steps it is armed for,
keeping the result on the device (no host sync per call); the step boundary reads all sites at
once (`FidelityProbe.collect`), `merge_sites` reduces the ranks' readings (min SQNR, summed
counts), `FidelityHistory` keeps per-site min/mean/last for `comm_stats.txt`, and `FidelityGuard`
decides, from the merged numbers only (so every rank decides the same), which sites fall back to a
safer codec: one whose SQNR stays under the floor for `patience` checks, or at once one whose codec
turns finite input into NaN/Inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..codec import Codec, build_codec

SQNR_CAP_DB = 200.0
"""SQNR reported for an exact round trip (and the floor of one that is all noise, negated)."""

Reading = tuple[float, float, float]
"""(SQNR dB, non-finite input elements, non-finite output elements from finite input)"""


@torch.no_grad()
def roundtrip_measures(x: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Encode and decode `x` with `codec`: a float64 tensor [SQNR dB, non-finite elements of x,
    elements finite in x but not in the round trip, cosine of x and the round trip], on x's device,
    without a host sync.

    SQNR = 10 log10(sum x^2 / sum (y - x)^2) in fp32 over the elements finite in both x and y,
    clamped to +-`SQNR_CAP_DB` (an exact round trip reads `SQNR_CAP_DB`); cosine = <x, y> / (|x| |y|)
    over the same elements (1 for an all-zero message).
    """
    xf = x.detach().float()
    yf = codec.roundtrip(x.detach()).float()
    fin_x, fin_y = torch.isfinite(xf), torch.isfinite(yf)
    both = fin_x & fin_y
    zero = xf.new_zeros(())
    xs, ys = torch.where(both, xf, zero), torch.where(both, yf, zero)
    sig = xs.square().sum()
    noise = (ys - xs).square().sum()
    db = torch.nan_to_num(10 * torch.log10(sig / noise), nan=SQNR_CAP_DB, posinf=SQNR_CAP_DB)
    db = db.clamp(-SQNR_CAP_DB, SQNR_CAP_DB)
    cos = torch.nan_to_num((xs * ys).sum() / (sig.sqrt() * ys.square().sum().sqrt()), nan=1.0)
    bad_in = torch.logical_not(fin_x).sum()
    made = (fin_x & torch.logical_not(fin_y)).sum()
    return torch.stack([db.double(), bad_in.double(), made.double(), cos.double()])


def roundtrip_fidelity(x: torch.Tensor, codec: Codec) -> torch.Tensor:
    """[SQNR dB, non-finite elements of x, non-finite elements made] of `roundtrip_measures`."""
    return roundtrip_measures(x, codec)[:3]


class FidelityProbe:
    """A `CommPolicy.observer` measuring the first message of each compressed site while `armed`.

    Plain calls (codec None), empty and non-float messages are skipped. Results stay on the
    device until `collect()` reads them all with one host transfer.
    """

    def __init__(self) -> None:
        self.armed = False
        self._pending: dict[str, torch.Tensor] = {}
        self.specs: dict[str, str] = {}
        """site -> spec of the codec its last measured message used"""
        self.cosines: dict[str, float] = {}
        """site -> cosine of its message and the round trip, from the last `collect`"""

    def __call__(self, site: str, op: str, x: torch.Tensor, codec: Codec | None) -> None:
        if not self.armed or codec is None or site in self._pending:
            return
        if x.numel() == 0 or not x.is_floating_point() or x.layout != torch.strided:
            return
        self._pending[site] = roundtrip_measures(x, codec)
        self.specs[site] = codec.spec

    def collect(self) -> dict[str, Reading]:
        """The readings since the last collect (site -> `Reading`), read in one transfer; clears them."""
        self.cosines = {}
        if not self._pending:
            return {}
        sites = list(self._pending)
        rows = torch.stack([self._pending[s] for s in sites]).tolist()
        self._pending.clear()
        self.cosines = {s: r[3] for s, r in zip(sites, rows)}
        return {s: (r[0], r[1], r[2]) for s, r in zip(sites, rows)}


def merge_sites(per_rank: list[dict[str, Reading]]) -> dict[str, Reading]:
    """One reading per site over the ranks' readings: min SQNR, summed non-finite counts (sorted)."""
    out: dict[str, Reading] = {}
    for readings in per_rank:
        for site, (db, bad_in, made) in readings.items():
            if site in out:
                d0, b0, m0 = out[site]
                out[site] = (min(d0, db), b0 + bad_in, m0 + made)
            else:
                out[site] = (db, bad_in, made)
    return dict(sorted(out.items()))


@dataclass
class _SiteHistory:
    checks: int = 0
    min_db: float = SQNR_CAP_DB
    sum_db: float = 0.0
    last_db: float = SQNR_CAP_DB
    nonfinite_in: int = 0
    nonfinite_made: int = 0


@dataclass
class FidelityHistory:
    """Per-site min/mean/last SQNR and non-finite totals over a run's checks, and the guard's actions."""

    sites: dict[str, _SiteHistory] = field(default_factory=dict)
    actions: list[str] = field(default_factory=list)

    def add(self, merged: dict[str, Reading]) -> None:
        for site, (db, bad_in, made) in merged.items():
            h = self.sites.setdefault(site, _SiteHistory())
            h.checks += 1
            h.min_db = min(h.min_db, db)
            h.sum_db += db
            h.last_db = db
            h.nonfinite_in += int(bad_in)
            h.nonfinite_made += int(made)

    def summary(self) -> str:
        """A fixed-width table: site, checks, min/mean/last SQNR dB, non-finite in/made; then actions."""
        head = ("site", "checks", "min dB", "mean dB", "last dB", "nf in", "nf made")
        width = max([len(head[0])] + [len(s) for s in self.sites])
        lines = [f"{head[0]:<{width}} " + " ".join(f"{h:>8}" for h in head[1:])]
        for site, h in sorted(self.sites.items()):
            vals = (
                f"{h.checks:>8d}",
                f"{h.min_db:>8.2f}",
                f"{h.sum_db / max(h.checks, 1):>8.2f}",
                f"{h.last_db:>8.2f}",
                f"{h.nonfinite_in:>8d}",
                f"{h.nonfinite_made:>8d}",
            )
            lines.append(f"{site:<{width}} " + " ".join(vals))
        lines += [f"guard: {a}" for a in self.actions] or ["guard: no site switched"]
        return "\n".join(lines)


@dataclass
class FidelityGuard:
    """Which sites fall back, decided from merged readings alone (the same on every rank).

    A site is switched when its codec turned finite input into NaN/Inf, or when its SQNR was under
    `floor_db` at `patience` consecutive checks; it moves to `fallback`, or to "none" when it
    already uses the fallback codec (or the fallback is "none").
    """

    floor_db: float
    patience: int = 2
    fallback: str = "int8-hadamard"
    strikes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        codec = build_codec(self.fallback)  # unknown names fail here, at construction
        self._fallback_spec = codec.spec if codec is not None else "none"

    def decide(self, merged: dict[str, Reading], specs: dict[str, str]) -> list[tuple[str, str, str]]:
        """(site, new codec spec, reason) for every site to switch now; `specs`: site -> current spec."""
        out = []
        for site, (db, _, made) in merged.items():
            low = db < self.floor_db
            self.strikes[site] = self.strikes.get(site, 0) + 1 if low else 0
            if made > 0:
                why = f"{int(made)} non-finite output elements from finite input (SQNR {db:.1f} dB)"
            elif self.strikes[site] >= self.patience:
                n = self.strikes[site]
                why = f"SQNR {db:.1f} dB < floor {self.floor_db:.1f} dB at {n} checks in a row"
            else:
                continue
            current = specs.get(site, "?")
            new = "none" if current == self._fallback_spec else self._fallback_spec
            self.strikes.pop(site)
            out.append((site, new, why))
        return out
