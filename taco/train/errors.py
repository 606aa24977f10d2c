"""The errors a run ends with that the `taco` command prints as one line, and their exit codes.

Why this file exists: the launcher (`taco.train.procs`), the checkpoint checks and the command line
(`taco.cli`) share them, and the command line must import them without importing torch.
"""

from __future__ import annotations

import signal


class UsageError(ValueError):
    """The command cannot run as asked (arguments that do not go together, a value out of range):
    the message names the fix; `taco` prints it as one line and exits 2."""


class CheckpointError(ValueError):
    """A checkpoint that must not be resumed (missing, empty, corrupt or another rank's file, a
    different mesh): the message names the file. A ValueError, so `taco train` exits 2 with one line."""


class RunStopped(Exception):
    """The run ended early for a reason the message says in one line; `exit_code` for the shell."""

    exit_code = 1


class RankError(RunStopped):
    """A rank raised (or died): which rank, the exception's type and message, where the traceback is."""

    def __init__(self, rank: int, kind: str, message: str, log: str = "") -> None:
        self.rank, self.kind, self.message, self.log = rank, kind, message, log
        text = f"error on rank {rank}: {kind}: {message}" if kind else f"error on rank {rank}: {message}"
        super().__init__(text + (f" (traceback: {log})" if log else ""))


class RunInterrupted(RunStopped):
    """The run got SIGTERM or SIGINT: its ranks stopped after a checkpoint (`saved` says where and
    how to go on) or, at a second signal, at once; exit code 128 + the signal."""

    def __init__(self, signum: int, ranks: int = 0, saved: str = "") -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        how = saved or f"{ranks} rank(s) stopped at once, no checkpoint written"
        super().__init__(f"stopped by {signal.Signals(signum).name}: {how}")
