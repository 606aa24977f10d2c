"""Codec spec strings, as `Codec.spec` prints them ("int6-hadamard(group_size=64,signs=True)"), and
lists of them: parsed where codecs are named by text (the CLI's --codecs, config codec fields,
`taco.comm.make_codec`)."""

from __future__ import annotations

from .codecs import accepted_options


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
