"""From a codec's name to a Codec, one road: spec strings, as `Codec.spec` prints them
("int6-hadamard(group_size=64,signs=True)"), parsed and built by `build_codec`, which every codec
field of a run (TP, PP, DP weights and gradients, per-site overrides, calibration's choices, the
guard's fallback) and the collectives' `codec=` arguments go through; and lists of specs (the CLI's
--codecs)."""

from __future__ import annotations

from typing import Any

from .base import Codec
from .codecs import NoneCodec, accepted_options, get_codec

CodecSpec = str | Codec | None
"""A codec name ("taco"), a spec with options ("taco(group_size=64,fmt=e5m2)"), a Codec, or None."""


def _parse_value(v: str) -> object:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


def parse_spec(spec: str) -> tuple[str, dict]:
    """A spec string, as `Codec.spec` prints it, -> (name, options): "int6-hadamard(signs=true)" ->
    ("int6-hadamard", {"signs": True}); a plain name has no options."""
    name = spec.strip()
    opts: dict = {}
    if name.endswith(")") and "(" in name:
        name, _, args = name[:-1].partition("(")
        for item in filter(None, (a.strip() for a in args.split(","))):
            key, eq, val = item.partition("=")
            if not eq:
                raise ValueError(f"codec spec {spec!r}: options are key=value, got {item!r}")
            opts[key.strip()] = _parse_value(val.strip())
    return name.strip(), opts


def split_specs(text: str) -> list[str]:
    """A comma-separated list of codec specs, commas inside parentheses kept:
    "taco,int6-hadamard(group_size=64,signs=true)" -> ["taco", "int6-hadamard(group_size=64,signs=true)"]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [s.strip() for s in [*out, cur] if s.strip()]


def codec_config(spec: str, options: dict) -> tuple[str, dict]:
    """(name, options) of a config's codec given as a spec string: the options of `options` the codec
    accepts (`accepted_options`), overridden by those the spec names (e.g. for compression.tp_codec
    and tp_codec_options: "int6-hadamard(signs=true)" -> ("int6-hadamard", {..., "signs": True}))."""
    name, opts = parse_spec(spec)
    return name, {**accepted_options(name, options), **opts}


def build_codec(spec: CodecSpec, options: dict[str, Any] | None = None) -> Codec | None:
    """The codec a spec names, with `options` on top of the spec's own; None for no compression
    ("none", None or a NoneCodec). A Codec is returned as is.

    Unknown names raise ValueError listing the choices (from `get_codec`).
    """
    if spec is None:
        return None
    if isinstance(spec, Codec):
        return None if isinstance(spec, NoneCodec) else spec
    if not isinstance(spec, str):
        raise TypeError(f"codec must be a name, a Codec or None, got {type(spec).__name__}")
    name, parsed = parse_spec(spec)  # "taco(group_size=64,fmt=e4m3)", as Codec.spec prints
    if name == "none":
        return None
    codec = get_codec(name, **{**parsed, **(options or {})})
    return None if isinstance(codec, NoneCodec) else codec
