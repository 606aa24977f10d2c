"""From a codec's name to a Codec, one road: spec strings, as `Codec.spec` prints them
("int6-hadamard(group_size=64,signs=True)"), parsed and built by `build_codec`, which every codec
field of a run (TP, PP, DP weights and gradients, per-site overrides, calibration's choices, the
guard's fallback) and the collectives' `codec=` arguments go through; and lists of specs (the CLI's
--codecs). A ladder spec, "ladder(int4-hadamard,int6-hadamard,taco,none)", names the codecs a
closed-loop controller moves each TP site between (`parse_ladder`); as a single codec it is its
start rung."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .base import Codec
from .codecs import NoneCodec
from .registry import accepted_options, get_codec

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


LADDER = "ladder"
"""The name of a ladder spec: "ladder(rung,rung,...[,start=i])", rungs cheapest first."""


@dataclass(frozen=True)
class Ladder:
    """The rungs of a ladder spec, cheapest first (each a codec spec, "none" for plain), and the
    index of the rung every site starts on: `start=i` in the spec, else the middle rung
    ((n - 1) // 2: int6-hadamard in "ladder(int4-hadamard,int5-hadamard,int6-hadamard,taco,none)")."""

    rungs: tuple[str, ...]
    start: int

    @property
    def spec(self) -> str:
        return f"{LADDER}({','.join(self.rungs)},start={self.start})"

    def with_options(self, options: dict[str, Any]) -> Ladder:
        """Each rung with the options of `options` it accepts under its own (`codec_config`):
        a config's tp_codec_options apply to every rung that takes them."""
        rungs = []
        for r in self.rungs:
            name, own = parse_spec(r)
            codec = build_codec(name, {**accepted_options(name, options), **own})
            rungs.append(codec.spec if codec is not None else "none")
        return Ladder(tuple(rungs), self.start)


def parse_ladder(spec: object) -> Ladder | None:
    """A ladder spec -> its `Ladder`; None for anything else. ValueError for a malformed ladder
    (fewer than two rungs, a rung twice, an unknown codec, a bad start)."""
    if not isinstance(spec, str):
        return None
    text = spec.strip()
    head, paren, body = text.partition("(")
    if head.strip() != LADDER:
        return None
    if not paren or not body.endswith(")"):
        raise ValueError(f"ladder spec {spec!r}: write ladder(codec,codec,...)")
    rungs, start = [], None
    for item in split_specs(body[:-1]):
        key, eq, val = item.partition("=")
        if eq and "(" not in key:
            if key.strip() != "start":
                raise ValueError(f"ladder spec {spec!r}: the one option is start=<rung index>, got {item!r}")
            start = _parse_value(val.strip())
            continue
        build_codec(item)  # an unknown codec fails here
        rungs.append(item.strip())
    if len(rungs) < 2 or len(set(rungs)) != len(rungs):
        raise ValueError(f"ladder spec {spec!r}: needs two or more distinct rungs")
    if start is None:
        start = (len(rungs) - 1) // 2
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < len(rungs):
        raise ValueError(f"ladder spec {spec!r}: start must be a rung index in [0, {len(rungs)})")
    return Ladder(tuple(rungs), start)


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
    if parse_ladder(spec) is not None:  # each rung takes the options it accepts when built
        return spec.strip(), dict(options)
    name, opts = parse_spec(spec)
    return name, {**accepted_options(name, options), **opts}


def build_codec(spec: CodecSpec, options: dict[str, Any] | None = None) -> Codec | None:
    """The codec a spec names, with `options` on top of the spec's own; None for no compression
    ("none", None or a NoneCodec). A Codec is returned as is.

    A ladder spec ("ladder(int4-hadamard,taco,none)") builds its start rung (`parse_ladder`).
    Unknown names raise ValueError listing the choices (from `get_codec`).
    """
    if spec is None:
        return None
    if isinstance(spec, Codec):
        return None if isinstance(spec, NoneCodec) else spec
    if not isinstance(spec, str):
        raise TypeError(f"codec must be a name, a Codec or None, got {type(spec).__name__}")
    ladder = parse_ladder(spec)
    if ladder is not None:  # a ladder as one codec: its start rung
        return build_codec(ladder.with_options(options or {}).rungs[ladder.start])
    name, parsed = parse_spec(spec)  # "taco(group_size=64,fmt=e4m3)", as Codec.spec prints
    if name == "none":
        return None
    codec = get_codec(name, **{**parsed, **(options or {})})
    return None if isinstance(codec, NoneCodec) else codec
