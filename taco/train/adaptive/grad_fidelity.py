"""`taco compare --grad-fidelity`: how far each codec's TP compression moves the full-model gradient.

Why this file exists: a final validation loss mixes the codec's error with the noise of training
(seeds, data order), so small differences hide in the seed band. This is the noise-free measure:
train the uncompressed baseline, and at a few evenly spaced steps compute, on the same weights and
the same batch, the full-model gradient with plain TP collectives (the reference) and with each
codec compressing every TP site (forward activations and backward activation gradients alike).
Each is compared with the reference as one flattened vector over the whole model:

    cos = <g, g_ref> / (|g| |g_ref|),    rel_err = |g - g_ref| / |g_ref|

with TP-sharded parameters summed over their shards, replicated ones counted once
(`Run.grad_sums`). The gradients are the raw ones (clipping off, every codec's norm differs).
Same batch and weights: each pass reseeds with the step (`Run.compute_gradients`), so dropout
masks repeat too; the optimiser does not step between the passes. A codec bit-identical to the
plain collective (`none`) gives cos = 1 and rel_err = 0 exactly.

Writes `{out}/grad_fidelity.md` (the table), `{out}/grad_fidelity.json` and the baseline's run
folder `{out}/grad-fidelity/` (its `metrics.jsonl` holds the measures at the measured steps, as
`grad_cos/{codec}`, `grad_rel_err/{codec}`, `grad_loss/{codec}`, `grad_loss/reference`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import tomllib
import torch

from taco.comm import CommStats
from taco.parallel import fully_sharded
from taco.train.build import build_policy
from taco.train.config import Config

from .ladder import LADDER_FILE, LadderController
from .observers import Gradients, StepEnd

REFERENCE = "none"
LADDER_ROW = "ladder-run"
"""the row of a ladder run's per-step site codecs"""


def fidelity_steps(steps: int, points: int) -> list[int]:
    """`points` evenly spaced step boundaries in (0, steps], the last one the final step."""
    if steps < 1 or points < 1:
        raise ValueError(f"need steps >= 1 and points >= 1 (got steps={steps}, points={points})")
    return sorted({max(1, round(steps * i / points)) for i in range(1, points + 1)})


def _tp_policy(cfg: Config, codec: str):
    """The TP policy of `cfg` with `codec` at its sites (options it accepts kept from the config).
    A pair "FWD/BWD" puts codec FWD on the forward sites (`*.fwd`, activations) and BWD on the
    backward ones (`*.bwd`, activation gradients)."""
    fwd, pair, bwd = codec.partition("/")
    c = copy.deepcopy(cfg)
    c.compression.set_tp_codec(fwd)
    policy = build_policy(c)
    if not pair:
        return policy
    if policy.overrides:
        raise ValueError(f"{codec!r}: a FWD/BWD pair needs compression.tp_sites = ['*']")
    back = _tp_policy(cfg, bwd).default_codec
    fresh = {"stats": CommStats(), "recompute_stats": CommStats()}
    return dataclasses.replace(policy, overrides={"*.bwd": back}, **fresh)


def ladder_run(path: Path, seed: int, steps: int) -> dict[str, Any]:
    """The ladder.json of the ladder run in folder `path`, checked against the measured run: the
    same `train.seed` and at least `steps` steps (from its config.toml)."""
    doc = json.loads((path / LADDER_FILE).read_text())
    conf = path / "config.toml"
    if conf.exists():
        train = tomllib.loads(conf.read_text()).get("train", {})
        if train.get("seed", seed) != seed or train.get("steps", steps) < steps:
            got = f"seed {train.get('seed')} and {train.get('steps')} steps"
            raise ValueError(f"{path}: a ladder run of {got}; measuring seed {seed} over {steps} steps")
    return doc


class GradFidelity:
    """A step observer (`taco.train.adaptive.observers`): at `steps`, each codec's gradient against
    the plain one, through the run's `Gradients` view.

    Adds `grad_cos/{codec}`, `grad_rel_err/{codec}` and `grad_loss/{codec}` (the compressed forward's
    loss) to the step's record. With `ladder` (a ladder run's ladder.json), a row `LADDER_ROW` too:
    every site on the codec that run had at the same step (`LadderController.codecs_at`), the
    same weights and batch as the other rows. Collective: every rank of the mesh runs it.
    Picklable until first called (the policies are built on the rank)."""

    def __init__(self, cfg: Config, codecs: list[str], steps: list[int], ladder: dict | None = None) -> None:
        self.cfg, self.codecs, self.steps, self.ladder = cfg, list(codecs), set(steps), ladder
        self.policies: dict[str, Any] | None = None
        self.reference: Any = None

    def on_step_end(self, end: StepEnd) -> None:
        if end.step not in self.steps:
            return
        assert end.grads is not None, "GradFidelity measures the run's gradients"
        if self.policies is None:
            self.reference = _tp_policy(self.cfg, REFERENCE)
            self.policies = {c: _tp_policy(self.cfg, c) for c in self.codecs}
            if self.ladder is not None:
                self.policies[LADDER_ROW] = _tp_policy(self.cfg, self.ladder["ladder"])
        if self.ladder is not None:
            for site, spec in LadderController.codecs_at(self.ladder, end.step).items():
                self.policies[LADDER_ROW].set_site_codec(site, spec)
        end.record.update(measure(end.grads, self.reference, self.policies))


def measure(run: Gradients, reference: Any, policies: dict[str, Any]) -> dict[str, float]:
    """Gradients of the run's current step (weights, batch) under each TP policy, compared with
    the one under `reference` (plain collectives). Leaves the gradients cleared; reads the results
    on the host."""
    out: dict[str, float] = {}
    try:
        with run.tp_policy(reference):
            ref_loss, _ = run.compute_gradients(clip=0.0)  # the raw gradient
        ref = {p: p.grad.detach().clone() for p in run.parameters() if p.grad is not None}
        out["grad_loss/reference"] = ref_loss.item()

        def terms(p: torch.nn.Parameter, g: torch.Tensor) -> torch.Tensor:
            g, r = g.double(), fully_sharded.local_tensor(ref[p]).double()
            return torch.stack([(g * r).sum(), g.square().sum(), r.square().sum(), (g - r).square().sum()])

        for name, policy in policies.items():
            with run.tp_policy(policy):
                loss, _ = run.compute_gradients(clip=0.0)
            dot, gg, rr, dd = run.grad_sums(terms).tolist()  # one host read per codec
            out[f"grad_cos/{name}"] = dot / math.sqrt(gg * rr) if gg * rr > 0 else float("nan")
            out[f"grad_rel_err/{name}"] = math.sqrt(dd / rr) if rr > 0 else float("nan")
            out[f"grad_loss/{name}"] = loss.item()
    finally:
        run.zero_grad()
    return out


def grad_fidelity(
    cfg: Config, codecs: list[str], out: Path, points: int = 5, seeds: list[int] | None = None,
    ladder_runs: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Train `cfg` uncompressed (TP codec none) in `{out}/grad-fidelity`, measuring each codec's
    gradient at `points` evenly spaced steps; writes and returns the table (see the module doc).

    `seeds`: one such run per seed in `{out}/seed{S}` (its own table), and `{out}/grad_fidelity.md`
    the rows of every seed with the count of steps where each row's cosine is >= taco's.
    `ladder_runs`: the folder of a ladder run of the same config ("{seed}" in it: the seed's),
    measured as the row `ladder-run` with that run's site codecs at each step."""
    if seeds is not None and len(seeds) > 1:
        per = []
        for seed in seeds:
            c = copy.deepcopy(cfg)
            c.train.seed = seed
            res = grad_fidelity(c, codecs, out / f"seed{seed}", points, None, ladder_runs)
            per.append({"seed": seed, **res})
        result = {"steps": per[0]["steps"], "seeds": per, "totals": totals(per)}
        write_seeds(out, result)
        return result
    from taco.train.launch import launch

    steps = fidelity_steps(cfg.train.steps, points)
    ladder = None
    if ladder_runs:
        folder = Path(ladder_runs.replace("{seed}", str(cfg.train.seed)))
        ladder = ladder_run(folder, cfg.train.seed, cfg.train.steps)
    c = copy.deepcopy(cfg)
    c.compression.tp_codec = REFERENCE
    c.compression.tp_codec_options = {}
    c.train.out_dir = str(out / "grad-fidelity")
    c.train.name = "grad-fidelity"
    c.train.resume = False
    c.train.overwrite = True
    out.mkdir(parents=True, exist_ok=True)
    rows = [*codecs, *([LADDER_ROW] if ladder is not None else [])]
    print(f"[taco compare] === grad fidelity at steps {steps}: {', '.join(rows)} ===", flush=True)
    summary = launch(c, observers=[GradFidelity(cfg, codecs, steps, ladder)])
    recs = [json.loads(x) for x in (out / "grad-fidelity" / "metrics.jsonl").read_text().splitlines() if x]
    result = table(recs, rows, steps)
    result["final_val_loss"] = summary["final_val_loss"]
    write(out, result)
    return result


def table(recs: list[dict[str, Any]], codecs: list[str], steps: list[int]) -> dict[str, Any]:
    """Per codec: cos and rel_err at each measured step, their worst values and, against `taco`
    when measured, at how many steps the codec's cosine is >= taco's (`n_ge_taco`) and whether
    at every one (`cos_ge_taco`)."""
    by_step = {r["step"]: r for r in recs if r["step"] in steps}
    rows = []
    for name in codecs:
        cos = [by_step[s][f"grad_cos/{name}"] for s in steps]
        rel = [by_step[s][f"grad_rel_err/{name}"] for s in steps]
        rows.append({"codec": name, "cos": cos, "rel_err": rel, "min_cos": min(cos), "max_rel_err": max(rel)})
    ref = next((r for r in rows if r["codec"] == "taco"), None)
    for r in rows:
        ge = None if ref is None else sum(a >= b for a, b in zip(r["cos"], ref["cos"]))
        r["n_ge_taco"], r["cos_ge_taco"] = ge, None if ge is None else ge == len(steps)
    return {"steps": steps, "rows": rows}


def totals(per: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row over the seeds: the steps where its cosine is >= taco's, of all measured steps."""
    names = [r["codec"] for r in per[0]["rows"]]
    out = []
    for name in names:
        rows = [next(r for r in p["rows"] if r["codec"] == name) for p in per]
        ge = None if rows[0]["n_ge_taco"] is None else sum(r["n_ge_taco"] for r in rows)
        out.append({"codec": name, "n_ge_taco": ge, "n": sum(len(r["cos"]) for r in rows),
                    "min_cos": min(r["min_cos"] for r in rows)})  # fmt: skip
    return out


def _lines(result: dict[str, Any], seed: str = "") -> list[str]:
    steps = result["steps"]
    head = f"| codec {'| seed ' if seed else ''}| " + " | ".join(f"step {s}: cos / rel err" for s in steps)
    lines = [head + " | min cos | max rel err | cos >= taco |", "|---" * (len(steps) + 4 + bool(seed)) + "|"]
    for r in result["rows"]:
        cells = " | ".join(f"{c:.6f} / {e:.4f}" for c, e in zip(r["cos"], r["rel_err"]))
        ge = "-" if r["n_ge_taco"] is None else f"{r['n_ge_taco']} of {len(steps)}"
        lines.append(f"| {r['codec']} {seed}| {cells} | {r['min_cos']:.6f} | {r['max_rel_err']:.4f} | {ge} |")
    return lines


def write(out: Path, result: dict[str, Any], lines: list[str] | None = None) -> None:
    """`grad_fidelity.md` (printed too; `lines`, else the table of `result`) and `grad_fidelity.json`."""
    text = "\n".join(_lines(result) if lines is None else lines)
    (out / "grad_fidelity.md").write_text(text + "\n")
    (out / "grad_fidelity.json").write_text(json.dumps(result, indent=2))
    print(text, flush=True)


def write_seeds(out: Path, result: dict[str, Any]) -> None:
    """The rows of every seed and the totals, in `{out}/grad_fidelity.md` and `.json`."""
    lines = []
    for p in result["seeds"]:
        skip = 2 if lines else 0  # one header
        lines += _lines(p, f"| {p['seed']} ")[skip:]
    lines += ["", "| codec | cos >= taco (steps, all seeds) | min cos |", "|---|---|---|"]
    for t in result["totals"]:
        ge = "-" if t["n_ge_taco"] is None else f"{t['n_ge_taco']} of {t['n']}"
        lines.append(f"| {t['codec']} | {ge} | {t['min_cos']:.6f} |")
    write(out, result, lines)
