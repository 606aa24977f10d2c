"""The observer registry of one communication policy: who sees each message, who acts at a step's end.

Why this file exists: calibration, the auto policy, fidelity telemetry and the tensor capture all
watch the same TP collectives and act at the same step boundaries. Each registers here once and
gets a narrow view: per message `(site, op, x, codec, step)` (the input of the collective, which
it must not modify, on the caller's stream, no sync), per step a `StepEnd` (the step, its seconds,
the record it may add fields to). None of them holds the trainer. The registry is the policy's
single `CommPolicy.observer`; observers are called in registration order (docs/design.md, "The
adaptive wing").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from taco.codec import Codec
from taco.comm import CommPolicy


class Gradients(Protocol):
    """The gradient view of a run, for observers that measure gradients (`GradFidelity`)."""

    def compute_gradients(self, clip: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of the current step's batch (its seeds too); (loss, norm)."""
        ...

    def grad_sums(self, terms: Callable[[torch.nn.Parameter, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Sums over the whole model of `terms(param, local grad)` (collective over the mesh)."""
        ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def zero_grad(self) -> None: ...

    def tp_policy(self, policy: CommPolicy | None) -> AbstractContextManager[None]:
        """The TP collectives use `policy` inside the context (None: plain)."""
        ...


@dataclass
class StepEnd:
    """A step boundary as an observer sees it; observers act collectively here (every rank)."""

    step: int
    """the optimizer step that just ended (1-based)"""
    step_s: float
    """its seconds"""
    record: dict[str, Any]
    """the step's metrics record: fields added here land in metrics.jsonl"""
    grads: Gradients | None = None
    """the run's gradients, for observers that measure them (None where nothing measures)"""


@runtime_checkable
class MessageObserver(Protocol):
    def on_message(self, site: str, op: str, x: torch.Tensor, codec: Codec | None, step: int) -> None:
        """Before a collective of the policy: `step` is the optimizer step running (1-based)."""
        ...


@runtime_checkable
class StepObserver(Protocol):
    def on_step_end(self, end: StepEnd) -> None: ...


class Observers:
    """The observers of one `CommPolicy`: installed as its `observer` once the first one that
    watches messages registers (none: the policy calls nothing)."""

    def __init__(self, policy: CommPolicy) -> None:
        self.policy = policy
        self.step = 1
        """the optimizer step running, as the run last said (`begin_step`)"""
        self.on_message: list[MessageObserver] = []
        self.on_step_end: list[StepObserver] = []

    def register(self, obs: Any, messages: bool = True) -> Any:
        """Add `obs` (a `MessageObserver`, a `StepObserver` or both; `messages=False`: its step ends
        only); returns it."""
        if messages and isinstance(obs, MessageObserver):
            self.on_message.append(obs)
            self.policy.observer = self._message
        if isinstance(obs, StepObserver):
            self.on_step_end.append(obs)
        return obs

    def _message(self, site: str, op: str, x: torch.Tensor, codec: Codec | None) -> None:
        for obs in self.on_message:
            obs.on_message(site, op, x, codec, self.step)

    def begin_step(self, step: int) -> None:
        self.step = step

    def end_step(self, end: StepEnd) -> None:
        for obs in self.on_step_end:
            obs.on_step_end(end)


class TensorCapture:
    """`train.capture_dir`: the input of every TP collective of a training step whose index
    (0-based) is a multiple of `every`, saved on the CPU as `out/{site}.step{N}.pt` (forward
    activations and backward activation gradients, for `taco bench codec --tensors`)."""

    def __init__(self, out: Path, every: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.every = out, every

    def on_message(self, site: str, op: str, x: torch.Tensor, codec: Codec | None, step: int) -> None:
        n = step - 1
        if n % self.every == 0:
            torch.save(x.detach().to("cpu").clone(), self.out / f"{site}.step{n}.pt")
