"""The adaptive wing: what watches the compressed TP collectives of a run and changes their codecs.

Calibration (`calibration`: a codec per site, measured on real tensors), the auto policy
(`autopolicy`: compress a site only where it pays), fidelity telemetry and its guard (`fidelity`),
the tensor capture (`observers.TensorCapture`) and gradient fidelity (`grad_fidelity`) each
register on the TP policy's `Observers` and see messages and step ends only, never the trainer
(docs/design.md, "The adaptive wing"). `build_wing` is the build step that registers them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from taco.codec import parse_ladder
from taco.comm import CommPolicy
from taco.comm.telemetry import FidelityGuard
from taco.train.config import Config

from .autopolicy import AutoPolicy
from .calibration import Calibration
from .fidelity import FidelityTelemetry
from .ladder import LadderController
from .observers import Gradients, Observers, StepEnd, TensorCapture
from .overlap import OverlapProbe

__all__ = [
    "AutoPolicy", "Calibration", "FidelityTelemetry", "Gradients", "Observers", "StepEnd", "TensorCapture",
    "LadderController", "OverlapProbe", "Wing", "build_wing",
]  # fmt: skip


class Wing(Observers):
    """The observers of a run's TP policy, with the ones the config asked for by name."""

    fidelity: FidelityTelemetry | None = None
    auto: AutoPolicy | None = None
    calibration: Calibration | None = None
    ladder: LadderController | None = None
    overlap: OverlapProbe | None = None
    """with parallel.tp_overlap = "auto" (registered by the run's build, which holds the stage)"""


def build_wing(
    cfg: Config,
    policy: CommPolicy,
    *,
    tp_group: Any,
    device: torch.device,
    decides: bool,
    captures: bool,
    log: bool,
    extra: tuple[Any, ...] = (),
) -> Wing:
    """The [compression] section's observers on `policy`, in the order they see each step:
    fidelity telemetry, the auto policy, calibration, the ladder controller (a ladder tp_codec),
    then `extra` (e.g. `GradFidelity`).
    `decides`: this rank decides calibration for its stage (dp 0, tp 0); `captures`: this rank
    writes `train.capture_dir` (tp 0, dp 0). Calibration from a file installs its codecs here."""
    c, t = cfg.compression, cfg.train
    wing = Wing(policy)
    if t.capture_dir and captures:
        wing.register(TensorCapture(Path(t.capture_dir), t.capture_interval))
    if c.telemetry_every:
        wing.fidelity = wing.register(FidelityTelemetry(policy, c, log))
    calibration = None
    if c.calibrate or c.calibration:
        calibration = Calibration(policy, cfg, Path(t.out_dir), decides, log)
    if c.when == "auto":  # compress where it pays, once calibration has chosen the codecs
        wing.auto = wing.register(AutoPolicy(policy, tp_group, device, c, log, after=calibration))
    if calibration is not None:
        wing.calibration = wing.register(calibration, messages=calibration.watches_messages)
    ladder = parse_ladder(c.tp_codec)
    if ladder is not None and wing.fidelity is not None:
        # the ladder's targets replace the guard's floor; the guard keeps NaN/Inf, to "none"
        fid = wing.fidelity
        fid.guard = FidelityGuard(-math.inf, c.guard_patience, "none") if c.guard else None
        resume = cfg.train.resume is not False
        wing.ladder = wing.register(LadderController(
            policy, ladder.with_options(c.tp_codec_options), fid, c, out_dir=Path(t.out_dir),
            resume=resume, log=log, auto=wing.auto,
        ))  # fmt: skip
    for obs in extra:
        wing.register(obs)
    return wing
