"""The errors a run ends with that the `taco` command prints as one line, and their exit codes.

Why this file exists: the launcher (`taco.train.procs`), the checkpoint checks and the command line
(`taco.cli`) share them, and the command line must import them without importing torch.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that must not be resumed (missing, empty, corrupt or another rank's file, a
    different mesh): the message names the file. A ValueError, so `taco train` exits 2 with one line."""
