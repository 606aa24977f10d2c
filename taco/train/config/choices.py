"""The string enums of the run configuration (`model.kind`, `train.dtype`, `parallel.backend`, ...).

Why this file exists: each enum field of the schema takes one of a few strings; `_Choice` makes
those values compare and print as the plain strings users write in TOML and on the command line,
and `parse` turns a string into a member with an error naming the field and the choices.
"""

from __future__ import annotations

import enum
from typing import Any


class _Choice(str, enum.Enum):
    """A string enum: compares equal to its value and prints as its value (`f"{x}"` -> "1f1b")."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, value: Any, where: str) -> _Choice:
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value.strip().lower():
                    return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{where}: got {value!r}, expected one of {choices}")


class ModelKind(_Choice):
    GPT = "gpt"
    QWEN = "qwen"
    LLAMA = "llama"


class PPSchedule(_Choice):
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"


class TPOverlap(_Choice):
    NONE = "none"
    BATCH_SPLIT = "batch-split"
    AUTO = "auto"
    CHUNKED = "chunked"


class Backend(_Choice):
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


class Device(_Choice):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class Dtype(_Choice):
    FP32 = "fp32"
    BF16 = "bf16"


class MixedPrecision(_Choice):
    MASTER = "master"
    AUTOCAST = "autocast"


class CommDtype(_Choice):
    AUTO = "auto"
    INPUT = "input"
    FP32 = "fp32"
    BF16 = "bf16"


class Recompute(_Choice):
    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


class DatasetKind(_Choice):
    SHAKESPEARE = "shakespeare"
    TOKENS = "tokens"
    TEXT = "text"
