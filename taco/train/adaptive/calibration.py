"""Data-driven reshaping in training (docs/design.md 1.1): a codec per TP site, measured.

Why this file exists: the best (codec, group size G, grouping axis) differs per site (a down-projection
gradient is not an attention output), and only real tensors tell. With `compression.calibrate`,
`Calibration` observes the TP policy (`taco.train.adaptive.observers`): its `SiteSampler` copies the
input of the first call of every compressed site (forward and backward) in each of the first
`calibrate_steps` steps; at the end of step K it scores the candidates on those samples
(`taco.codec.calibrate`: error x bytes under the floor `min_sqnr_db` and the budget
`max_bytes_per_elem`); the rank (dp 0, tp 0) of every pipeline stage, the only one that samples,
decides its stage's sites; every rank gathers all decisions and installs the same codecs with
`CommPolicy.set_site_codec`, and global rank 0 writes `calibration.json` to the run folder and
prints the table. A resumed run (or `compression.calibration = PATH`) applies that file before
the first step and samples nothing.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from taco.codec import GROUP_SIZES, Codec, build_codec
from taco.codec.calibrate import calibrate
from taco.comm import CommPolicy
from taco.train.config import Config

from .observers import StepEnd

CALIBRATION_FILE = "calibration.json"
VERSION = 1
EXTRA_CANDIDATES = ("int8-hadamard", "int6-hadamard")
"""Default candidates besides the tp_codec grid, each width's default (G = 64, bf16 scales, the
per-group rotation choice: the settings that lead at their bytes on captured TP tensors, docs/design.md
1.2). Measured on the demo (4 steps, 18 sites), every site picks int8-hadamard: 43.7 dB mean SQNR at
1.031 B/elem against taco's 31.8 dB at 1.0625; int6-hadamard (0.78 B/elem, 32.9 dB, 1.7 dB above
MXFP6) is the choice under a budget below 1.03."""
BYTES_KEYS = ("bytes_per_elem", "default_bytes_per_elem")
SAMPLE_MAX_ELEMS = 1 << 18
"""A sample of more elements keeps a slice of its dim 1 (dims 0 and -1, the grouping axes, stay
whole): bounds the host memory and the scoring time on large models."""


def candidate_codecs(cfg: Config) -> list[Codec]:
    """The codecs calibration chooses from: `compression.calibrate_candidates`, or [] = tp_codec with
    its options at every G of `GROUP_SIZES`, grouped along the last axis and along axis 0, and the
    `EXTRA_CANDIDATES`. ValueError names the spec that does not build."""
    c = cfg.compression
    if c.calibrate_candidates:
        specs: list[tuple[str, dict]] = [(s, {}) for s in c.calibrate_candidates]
    else:
        opts = {k: v for k, v in c.tp_codec_options.items() if k not in ("group_size", "axis")}
        specs = [(c.tp_codec, {**opts, "group_size": g, "axis": a}) for g in GROUP_SIZES for a in (-1, 0)]
        specs += [(x, {}) for x in EXTRA_CANDIDATES if x != c.tp_codec]
    out = []
    for spec, opts in specs:
        try:
            codec = build_codec(spec, opts)
        except (TypeError, ValueError) as e:
            raise ValueError(f"compression.calibrate_candidates: {spec!r} {opts or ''}: {e}") from e
        if codec is None:
            raise ValueError(f"compression.calibrate_candidates: {spec!r} is no codec")
        out.append(codec)
    return out


def _bounded(x: torch.Tensor, max_elems: int) -> torch.Tensor:
    if x.numel() <= max_elems:
        return x
    if x.dim() == 1:
        return x[:max_elems]
    if x.dim() >= 3:
        keep = max(1, max_elems * x.shape[1] // x.numel())
        return x.narrow(1, 0, keep)
    return x  # 2-D: both dims are grouping axes, kept whole


class SiteSampler:
    """CommPolicy observer: copies (on the device, no sync) the input of the first call of each
    compressed site per step, at most `max_samples` per site; `end_step` moves them to the host."""

    def __init__(self, max_samples: int, max_elems: int = SAMPLE_MAX_ELEMS) -> None:
        self.max_samples, self.max_elems = max_samples, max_elems
        self.samples: dict[str, list[torch.Tensor]] = {}
        self.defaults: dict[str, str] = {}
        """site -> spec of the codec the policy gave it while sampling (the fixed default)"""
        self.active = True
        self._this_step: set[str] = set()

    def __call__(self, site: str, op: str, x: torch.Tensor, codec: Codec | None) -> None:
        if not self.active or codec is None or site in self._this_step:
            return
        got = self.samples.setdefault(site, [])
        if len(got) >= self.max_samples:
            return
        self._this_step.add(site)
        self.defaults.setdefault(site, codec.spec)
        got.append(_bounded(x.detach(), self.max_elems).clone(memory_format=torch.contiguous_format))

    def end_step(self) -> None:
        """Step boundary: every sample to the host (one device sync, K times per run)."""
        self._this_step.clear()
        cuda = {t.device for xs in self.samples.values() for t in xs if t.is_cuda}
        for d in cuda:  # the copies were made on whichever stream ran the collective
            torch.cuda.synchronize(d)
        for xs in self.samples.values():
            xs[:] = [t.cpu() for t in xs]


def _num(v: float) -> float | None:
    return round(v, 4) if math.isfinite(v) else None  # strict JSON: +-inf (exact, hopeless) -> null


def decide(
    samples: dict[str, list[torch.Tensor]],
    defaults: dict[str, str],
    candidates: list[Codec],
    min_sqnr_db: float,
    max_bytes_per_elem: float,
) -> dict[str, dict[str, Any]]:
    """Per site: the candidate `taco.codec.calibrate` picks, with the fixed default measured on the
    same samples. ValueError names the site where no candidate meets the floor and the budget."""
    budget = max_bytes_per_elem if max_bytes_per_elem > 0 else math.inf
    sites: dict[str, dict[str, Any]] = {}
    for site in sorted(samples):
        xs = [x for x in samples[site] if x.numel() and bool(x.isfinite().all())]
        if not xs:  # only NaN/Inf seen: keep the default, say so
            sites[site] = {"codec": defaults[site], "default": defaults[site], "samples": 0}
            continue
        try:
            ch = calibrate(xs, candidates, max_bytes_per_elem=budget, min_sqnr_db=min_sqnr_db)
        except ValueError as e:
            raise ValueError(
                f"calibration of TP site {site!r}: {e}. Lower compression.min_sqnr_db, raise "
                "compression.max_bytes_per_elem (0 = no budget) or add compression.calibrate_candidates"
            ) from e
        base = calibrate(xs, [build_codec(defaults[site])])
        sites[site] = {
            "codec": ch.spec,
            "sqnr_db": _num(ch.sqnr_db),
            "bytes_per_elem": _num(ch.bytes_per_elem),
            "default": defaults[site],
            "default_sqnr_db": _num(base.sqnr_db),
            "default_bytes_per_elem": _num(base.bytes_per_elem),
            "samples": len(xs),
            "elems": sum(x.numel() for x in xs),
            "candidates": [
                {
                    "codec": r["spec"],
                    "sqnr_db": _num(r["sqnr_db"]),
                    "bytes_per_elem": _num(r["bytes_per_elem"]),
                }
                for r in ch.table
            ],
        }
    return sites


def table(doc: dict[str, Any]) -> str:
    """The human-readable table of a calibration.json document: one line per site."""
    sites = doc["sites"]
    w = max([len(s) for s in sites] + [4])
    cw = max([len(e["codec"]) for e in sites.values()] + [5])
    f = lambda v: "   -" if v is None else f"{v:6.2f}"  # noqa: E731
    lines = [
        f"[taco] calibration ({len(sites)} TP sites, floor {doc['min_sqnr_db']} dB, budget "
        f"{doc['max_bytes_per_elem'] or 'none'} B/elem, {doc['steps']} steps sampled); default "
        "= the fixed tp_codec on the same samples",
        f"  {'site':<{w}}  {'choice':<{cw}}  {'SQNR dB':>7} {'B/elem':>6}   "
        f"{'default SQNR':>12} {'B/elem':>6}",
    ]
    for s, e in sites.items():
        lines.append(
            f"  {s:<{w}}  {e['codec']:<{cw}}  {f(e.get('sqnr_db')):>7} {f(e.get('bytes_per_elem')):>6}   "
            f"{f(e.get('default_sqnr_db')):>12} {f(e.get('default_bytes_per_elem')):>6}"
        )
    scored = [e for e in sites.values() if e.get("elems") and e.get("bytes_per_elem") is not None]
    if scored:
        n = sum(e["elems"] for e in scored)
        b, b0 = (sum(e[k] * e["elems"] for e in scored) / n for k in BYTES_KEYS)
        q = [e["sqnr_db"] for e in scored if e["sqnr_db"] is not None]
        q0 = [e["default_sqnr_db"] for e in scored if e["default_sqnr_db"] is not None]
        lines.append(
            f"  all sites: bytes/elem {b:.4f} vs default {b0:.4f} ({100 * (b / b0 - 1):+.1f}%); SQNR dB "
            f"mean {sum(q) / len(q):.2f} (min {min(q):.2f}) vs default {sum(q0) / len(q0):.2f} "
            f"(min {min(q0):.2f})"
        )
    return "\n".join(lines)


def load_calibration(path: str | Path) -> dict[str, Any]:
    """A calibration.json document; ValueError (naming the file) unless it is one."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"compression.calibration = {str(p)!r}: no such file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"compression.calibration = {str(p)!r}: not a calibration.json ({e})") from None
    ok = isinstance(doc, dict) and doc.get("version") == VERSION and isinstance(doc.get("sites"), dict)
    entries = doc["sites"].values() if ok else []
    if not ok or not all(isinstance(e, dict) and isinstance(e.get("codec"), str) for e in entries):
        raise ValueError(f"{p}: not a calibration.json of version {VERSION} (a 'sites' table of codecs)")
    for site, e in doc["sites"].items():
        try:
            build_codec(e["codec"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"{p}: site {site!r}: codec {e['codec']!r}: {err}") from None
    return doc


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def check_calibration(cfg: Config) -> None:
    """Start-up check (the launcher, before any rank starts): candidates build, the file loads."""
    c = cfg.compression
    if c.calibration:
        load_calibration(c.calibration)
    elif c.calibrate:
        candidate_codecs(cfg)


class Calibration:
    """The run's calibration (an observer of the TP policy): applies a file at start, or samples K
    steps and then decides. `decides`: this rank decides for its pipeline stage (TP rank 0 of DP
    replica 0); `log`: this rank prints and writes `calibration.json` to `out_dir`."""

    def __init__(self, policy: CommPolicy, cfg: Config, out_dir: Path, decides: bool, log: bool) -> None:
        self.policy, self.decides, self.log = policy, decides, log
        c = self.c = cfg.compression
        self.path = out_dir / CALIBRATION_FILE
        self.sampler: SiteSampler | None = None
        self.steps = 0
        if c.calibration:
            self.apply(load_calibration(c.calibration), source=c.calibration, record=True)
        elif c.calibrate and cfg.train.resume is not False and self.path.exists():
            self.apply(load_calibration(self.path), source=f"{self.path} (resumed run)")
        elif c.calibrate:
            self.candidates = candidate_codecs(cfg)
            self.sampler = SiteSampler(c.calibrate_steps)

    @property
    def watches_messages(self) -> bool:
        """Only the deciders keep samples; every rank takes part at the step's end."""
        return self.sampler is not None and self.decides

    @property
    def sampling(self) -> bool:
        """Still sampling: the sites' codecs change when the K-th sampled step ends."""
        return self.sampler is not None and self.sampler.active

    def on_message(self, site: str, op: str, x: torch.Tensor, codec: Codec | None, step: int) -> None:
        if self.sampler is not None:
            self.sampler(site, op, x, codec)

    def apply(self, doc: dict[str, Any], source: str, record: bool = False) -> None:
        """Install the file's codecs on this rank's TP policy (every rank, the same file);
        `record`: rank 0 copies it to the run folder too (unless it is that file)."""
        for site, e in doc["sites"].items():
            self.policy.set_site_codec(site, e["codec"])
        if self.log:
            print(f"[taco] calibration from {source}\n{table(doc)}", flush=True)
            if record and Path(source).resolve() != self.path.resolve():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                _write(self.path, doc)  # the run folder records what the run used; resume reuses it

    def on_step_end(self, end: StepEnd) -> None:
        """Collect; after K sampled steps decide, agree, install, write (collective)."""
        if self.sampler is None or not self.sampler.active:
            return
        self.sampler.end_step()
        self.steps += 1
        if self.steps < self.c.calibrate_steps:
            return
        self.sampler.active = False
        doc = self._agree(self._decide_local(), end.step)
        self.sampler.samples.clear()
        for site, e in doc["sites"].items():
            self.policy.set_site_codec(site, e["codec"])
        end.record["calibrated_sites"] = len(doc["sites"])
        if self.log:
            _write(self.path, doc)
            print(table(doc), flush=True)

    def _decide_local(self) -> dict[str, Any] | None:
        """This stage's decision on its decider (dp 0, tp 0): {"sites": ...} or {"error": ...}."""
        if not self.decides:
            return None
        assert self.sampler is not None
        try:
            s, c = self.sampler, self.c
            sites = decide(s.samples, s.defaults, self.candidates, c.min_sqnr_db, c.max_bytes_per_elem)
            return {"sites": sites}
        except ValueError as e:  # raised on every rank below, not only here (no rank left waiting)
            return {"error": str(e)}

    def _agree(self, mine: dict[str, Any] | None, step: int) -> dict[str, Any]:
        """Every rank gets every stage's decision (all_gather_object over the world)."""
        got: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(got, mine)
        errors = [g["error"] for g in got if g and "error" in g]
        if errors:
            raise ValueError(errors[0])
        sites = {k: v for g in got if g for k, v in g["sites"].items()}
        c = self.c
        return {
            "version": VERSION,
            "steps": self.steps,
            "step": step,
            "min_sqnr_db": c.min_sqnr_db,
            "max_bytes_per_elem": c.max_bytes_per_elem,
            "candidates": [x.spec for x in self.candidates],
            "sites": dict(sorted(sites.items())),
        }
