"""Checkpoint files written so that a crash never leaves a half-written one: an atomic text write
(temporary file, fsync, rename) and a file's sha256. Both checkpoint formats (`checkpoint.py`, the
per-rank files; `dcp.py`, torch.distributed.checkpoint) write and verify through these."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path`, replacing it only once the whole text is on disk."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
