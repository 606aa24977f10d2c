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
import json
import math
from pathlib import Path
from typing import Any

import torch

from taco.parallel import fully_sharded
from taco.train.build import build_policy
from taco.train.config import Config

from .observers import Gradients, StepEnd

REFERENCE = "none"


def fidelity_steps(steps: int, points: int) -> list[int]:
    """`points` evenly spaced step boundaries in (0, steps], the last one the final step."""
    if steps < 1 or points < 1:
        raise ValueError(f"need steps >= 1 and points >= 1 (got steps={steps}, points={points})")
    return sorted({max(1, round(steps * i / points)) for i in range(1, points + 1)})


def _tp_policy(cfg: Config, codec: str):
    """The TP policy of `cfg` with `codec` at its sites (options it accepts kept from the config)."""
    c = copy.deepcopy(cfg)
    c.compression.set_tp_codec(codec)
    return build_policy(c)


class GradFidelity:
    """A step observer (`taco.train.adaptive.observers`): at `steps`, each codec's gradient against
    the plain one, through the run's `Gradients` view.

    Adds `grad_cos/{codec}`, `grad_rel_err/{codec}` and `grad_loss/{codec}` (the compressed forward's
    loss) to the step's record. Collective: every rank of the mesh runs it. Picklable until first
    called (the policies are built on the rank)."""

    def __init__(self, cfg: Config, codecs: list[str], steps: list[int]) -> None:
        self.cfg, self.codecs, self.steps = cfg, list(codecs), set(steps)
        self.policies: dict[str, Any] | None = None
        self.reference: Any = None

    def on_step_end(self, end: StepEnd) -> None:
        if end.step not in self.steps:
            return
        assert end.grads is not None, "GradFidelity measures the run's gradients"
        if self.policies is None:
            self.reference = _tp_policy(self.cfg, REFERENCE)
            self.policies = {c: _tp_policy(self.cfg, c) for c in self.codecs}
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


def grad_fidelity(cfg: Config, codecs: list[str], out: Path, points: int = 5) -> dict[str, Any]:
    """Train `cfg` uncompressed (TP codec none) in `{out}/grad-fidelity`, measuring each codec's
    gradient at `points` evenly spaced steps; writes and returns the table (see the module doc)."""
    from taco.train.launch import launch

    steps = fidelity_steps(cfg.train.steps, points)
    c = copy.deepcopy(cfg)
    c.compression.tp_codec = REFERENCE
    c.compression.tp_codec_options = {}
    c.train.out_dir = str(out / "grad-fidelity")
    c.train.name = "grad-fidelity"
    c.train.resume = False
    c.train.overwrite = True
    out.mkdir(parents=True, exist_ok=True)
    print(f"[taco compare] === grad fidelity at steps {steps}: {', '.join(codecs)} ===", flush=True)
    summary = launch(c, observers=[GradFidelity(cfg, codecs, steps)])
    recs = [json.loads(x) for x in (out / "grad-fidelity" / "metrics.jsonl").read_text().splitlines() if x]
    result = table(recs, codecs, steps)
    result["final_val_loss"] = summary["final_val_loss"]
    write(out, result)
    return result


def table(recs: list[dict[str, Any]], codecs: list[str], steps: list[int]) -> dict[str, Any]:
    """Per codec: cos and rel_err at each measured step, their worst values and, against `taco`
    when measured, whether the codec's cosine is >= taco's at every step."""
    by_step = {r["step"]: r for r in recs if r["step"] in steps}
    rows = []
    for name in codecs:
        cos = [by_step[s][f"grad_cos/{name}"] for s in steps]
        rel = [by_step[s][f"grad_rel_err/{name}"] for s in steps]
        rows.append({"codec": name, "cos": cos, "rel_err": rel, "min_cos": min(cos), "max_rel_err": max(rel)})
    ref = next((r for r in rows if r["codec"] == "taco"), None)
    for r in rows:
        r["cos_ge_taco"] = None if ref is None else all(a >= b for a, b in zip(r["cos"], ref["cos"]))
    return {"steps": steps, "rows": rows}


def write(out: Path, result: dict[str, Any]) -> None:
    """`grad_fidelity.md` (printed too) and `grad_fidelity.json`."""
    steps = result["steps"]
    head = "| codec | " + " | ".join(f"step {s}: cos / rel err" for s in steps)
    lines = [head + " | min cos | max rel err | cos >= taco at every step |", "|---" * (len(steps) + 4) + "|"]
    for r in result["rows"]:
        cells = " | ".join(f"{c:.6f} / {e:.4f}" for c, e in zip(r["cos"], r["rel_err"]))
        ge = "-" if r["cos_ge_taco"] is None else ("yes" if r["cos_ge_taco"] else "no")
        lines.append(f"| {r['codec']} | {cells} | {r['min_cos']:.6f} | {r['max_rel_err']:.4f} | {ge} |")
    text = "\n".join(lines)
    (out / "grad_fidelity.md").write_text(text + "\n")
    (out / "grad_fidelity.json").write_text(json.dumps(result, indent=2))
    print(text, flush=True)
