"""The intB-hadamard settings before the measured defaults of docs/design.md 1.2, for the tests of
wire layouts and kernels that were written against them (same bytes per element as the defaults)."""

from __future__ import annotations

LEGACY_INT_DEFAULTS = {"group_size": 128, "scale_fmt": "fp32", "signs": False, "scale_search": "absmax"}


def classes() -> list[type]:
    from taco.codec.codecs import Int4HadamardCodec, IntHadamardCodec

    return [IntHadamardCodec, Int4HadamardCodec]


def pin() -> None:
    """Make `LEGACY_INT_DEFAULTS` the defaults in this process (a rank of `tests.helpers.dist`)."""
    for cls in classes():
        cls.DEFAULTS = dict(LEGACY_INT_DEFAULTS)
