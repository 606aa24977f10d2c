"""A stop requested by a signal, honoured at the next step boundary: how Ctrl-C keeps the progress.

Why this file exists: a run stopped by SIGINT/SIGTERM should end with a checkpoint of the last
finished step, so that `--train.resume=true` continues from there. A signal arrives in the middle
of a step, at a different moment on each rank; the ranks must agree on the step after which they
all stop and save (a checkpoint is collective). So a signal only records a request here; the
trainer reads it once per step, as one more element of the step's gradient-norm and loss
reductions (`MeshGrads.clip`, no collective of its own), and every rank stops after the first step
in which any rank saw one.

Who receives what: the launcher of locally spawned ranks (`taco.train.procs`) keeps Ctrl-C and
SIGTERM for itself and forwards a stop request to its ranks as `REQUEST_SIGNAL`; a second Ctrl-C
there stops the ranks at once. Under torchrun each rank gets SIGINT/SIGTERM itself: the first one
is a request, a second one (of either) ends the process with the signal's default action.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable
from typing import Any

REQUEST_SIGNAL = signal.SIGUSR1
"""What the launcher sends its spawned ranks to ask for a checkpoint and a stop."""

_requested = 0  # the signal number of the first request in this process, 0 = none


def _on_signal(signum: int, frame: object) -> None:
    global _requested
    if _requested and signum != REQUEST_SIGNAL:  # a second interrupt: stop at once
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _requested = _requested or signum


def install(signals: Iterable[int]) -> dict[int, Any]:
    """Record `signals` as stop requests in this process; returns the handlers they replace, for
    `restore` (nothing is installed outside the main thread, where Python cannot)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _on_signal) for s in signals}


def restore(handlers: dict[int, Any]) -> None:
    """Put back the handlers `install` replaced."""
    for s, h in handlers.items():
        signal.signal(s, h)


def requested() -> int:
    """The signal that first asked this process to stop, 0 if none did."""
    return _requested


def clear() -> None:
    """Forget a request (a new run in the same process starts without one)."""
    global _requested
    _requested = 0
