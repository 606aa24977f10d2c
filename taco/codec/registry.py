"""Codecs by name: the registry of every codec class (`taco.codec.codecs`, the hardware block
formats of `taco.codec.mx`) and how a name plus keyword options becomes a Codec. Spec strings
("int6-hadamard(signs=true)", ladders) are parsed on top of this by `taco.codec.specs`."""

from __future__ import annotations

import inspect

from .base import Codec
from .codecs import (
    INT_HADAMARD,
    FP8GroupCodec,
    FP8TensorCodec,
    Int4Hadamard32Codec,
    Int8GroupCodec,
    NoneCodec,
    Taco1sCodec,
    TacoCodec,
)
from .mx import MX_CODECS

CODECS: dict[str, type[Codec]] = {
    c.name: c
    for c in (
        NoneCodec,
        FP8TensorCodec,
        FP8GroupCodec,
        Int8GroupCodec,
        TacoCodec,
        Taco1sCodec,
        *INT_HADAMARD.values(),
        Int4Hadamard32Codec,
        *MX_CODECS.values(),
    )
}


def list_codecs() -> list[str]:
    """Names accepted by `get_codec`."""
    return list(CODECS)


def codec_options(name: str) -> list[str]:
    """The keyword options codec `name` accepts (its constructor's parameters)."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}: choose one of {list_codecs()}")
    return [p for p in inspect.signature(CODECS[name].__init__).parameters if p != "self"]


def accepted_options(name: str, options: dict) -> dict:
    """The subset of `options` that codec `name` accepts (e.g. no group_size for fp8-tensor)."""
    params = codec_options(name)
    return {k: v for k, v in options.items() if k in params}


def get_codec(name: str | Codec | None = "taco", **options) -> Codec:
    """Build a codec by name with keyword options, e.g. get_codec("taco", group_size=128, fmt="e4m3").

    A `Codec` instance is returned as is; None means "none".
    """
    if isinstance(name, Codec):
        if options:
            raise ValueError("options cannot be given with a codec instance")
        return name
    if name is None:
        name = "none"
    if not isinstance(name, str):
        raise TypeError(f"codec must be a name or a Codec, got {type(name).__name__}")
    cls = CODECS.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}: choose one of {list_codecs()}")
    try:
        return cls(**options)
    except TypeError as e:
        raise TypeError(f"codec {name!r} accepts options {codec_options(name)}: {e}") from None
