"""Async handles: a collective in flight whose `wait()` finishes the transfers and decodes.

Why this file exists: a compressed collective is a small program (encode, transfer, decode, and
for two-shot all-reduce a second transfer), not one `torch.distributed` work object. Each is
written as a generator that runs up to its first `yield` when called (every first transfer is
issued with `async_op=True`) and runs the rest in `wait()` (STYLE.md lesson 9).

Ordering assumptions (the same ones torch.distributed makes, plus one):
- every rank of the group issues the same collectives in the same order, with the same
  arguments (codec, slices, shapes); collectives issued at call time are in flight on return;
- a compressed all-reduce issues its second transfer (the all-gather) inside `wait()`, so all
  ranks must wait on their handles in the same order relative to other collectives on the group;
- the input tensor must not be modified before `wait()` returns (it may still be read);
- on CUDA, `wait()` does not block the host: it orders the current stream after the call's codec
  side stream (`streams.Lane`), which ran the kernels and waited on the transfers.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

Steps = Generator[None, None, torch.Tensor]


class Handle:
    """An in-flight collective: `wait()` completes it and returns the (decoded) result tensor."""

    def __init__(self, steps: Steps | None = None, result: torch.Tensor | None = None) -> None:
        self._steps = steps
        self._result = result
        self._error: BaseException | None = None  # what the steps raised, if they failed
        self._on_done: list[Callable[[torch.Tensor], None]] = []

    @classmethod
    def start(cls, steps: Steps) -> Handle:
        """Run `steps` up to its first `yield` (everything that can be issued without waiting)."""
        h = cls(steps)
        try:
            next(steps)
        except StopIteration as stop:  # finished without waiting (e.g. nothing to send)
            h._finish(stop.value)
        return h

    def then(self, fn: Callable[[torch.Tensor], None]) -> Handle:
        """Call `fn(result)` once, when the result is ready (used for statistics)."""
        if self._steps is None:
            fn(self._result)
        else:
            self._on_done.append(fn)
        return self

    def wait(self) -> torch.Tensor:
        """Block until the collective is done (CUDA: order the current stream) and return the result.

        If the collective fails, `wait()` raises its error, and every later `wait()` raises a
        RuntimeError chained to it (the steps cannot be resumed; there is no result)."""
        if self._error is not None:
            e = self._error
            raise RuntimeError(
                f"taco.comm: this collective failed in an earlier wait() ({type(e).__name__}: {e}); "
                "it has no result, start a new one"
            ) from e
        if self._steps is not None:
            try:
                while True:
                    next(self._steps)
            except StopIteration as stop:
                self._finish(stop.value)
            except BaseException as e:  # the generator is finished: remember why, for later waits
                self._steps = None
                self._error = e
                self._on_done.clear()
                raise
        return self._result

    def is_completed(self) -> bool:
        """True once `wait()` has returned or raised (a handle is never completed behind the caller's
        back)."""
        return self._steps is None

    def _finish(self, value: torch.Tensor) -> None:
        self._steps = None
        self._result = value
        for fn in self._on_done:
            fn(value)
        self._on_done.clear()

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.is_completed() else "in flight"
        return f"<taco.comm.Handle {state}>"
