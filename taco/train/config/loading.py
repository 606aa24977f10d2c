"""Reading a run configuration: TOML file < `--section.key=value` overrides, merged, then validated.

Why this file exists: the command line and the TOML file speak the same keys, and the CLI must
be able to reject a bad config (with the field and the fix named) before it starts any rank.
Resolution order (later wins): dataclass defaults < `model.preset` < TOML file < command line.

    cfg = load_config("configs/demo.toml", ["--parallel.tp=4", "--train.steps", "50"])
    cfg.parallel.tp            # 4
"""

from __future__ import annotations

import difflib
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from taco.codec.specs import LADDER, parse_ladder, split_specs
from taco.train.config.coerce import toml_value
from taco.train.config.run import _ALIASES, _SECTIONS, Config, _resolve_keys, _valid_keys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _split_overrides(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """["--a.b=1", "--c.d", "2", "--e.f"] -> [("a.b", "1"), ("c.d", "2"), ("e.f", None)]."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        token = args[i]
        key = token[2:] if token.startswith("--") else token
        if "=" in key:
            key, value = key.split("=", 1)
            pairs.append((key, value))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((key, args[i + 1]))
            i += 1
        else:
            pairs.append((key, None))  # a bare flag: "--parallel.sp" means true
        i += 1
    return pairs


def parse_overrides(args: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Turn `--section.key=value` arguments into a nested dict of (still untyped) values.

    Accepted forms: `--train.steps=10`, `--train.steps 10`, `train.steps=10`, a bare `--parallel.sp`
    (= true), and `--compression.tp_codec_options.group_size=64` for one key of a table field (its value
    read as a TOML literal when it is one, else as a string). Types are converted later, from the
    dataclass field types, when the sections are built.
    """
    out: dict[str, dict[str, Any]] = {}
    for key, value in _split_overrides(args):
        parts = key.split(".")
        if len(parts) < 2 or not all(parts):
            owners = [s for s in _SECTIONS if key in _valid_keys(s)]
            hint = f" (did you mean --{owners[0]}.{key}?)" if owners else ""
            raise ValueError(
                f"override {key!r} must look like --section.key=value{hint}; sections: {', '.join(_SECTIONS)}"
            )
        section, name, rest = parts[0], parts[1], parts[2:]
        if section not in _SECTIONS:
            close = difflib.get_close_matches(section, list(_SECTIONS), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"override --{key}: unknown section {section!r}{hint}; valid sections: {', '.join(_SECTIONS)}"
            )
        name = _ALIASES.get(section, {}).get(name, name)
        _resolve_keys(section, {name: None})  # unknown key -> error with the valid keys
        if rest:
            field_type = typing.get_type_hints(_SECTIONS[section])[name]
            if len(rest) != 1 or typing.get_origin(field_type) is not dict:
                raise ValueError(
                    f"override --{key}: only table fields take a sub-key "
                    f"(like --compression.tp_codec_options.group_size=64)"
                )
            try:
                sub_value: Any = toml_value(value) if value is not None else True
            except ValueError:
                sub_value = value
            table = out.setdefault(section, {}).setdefault(name, {})
            if not isinstance(table, dict):
                raise ValueError(f"override --{key}: {section}.{name} was already set as a whole")
            table[rest[0]] = sub_value
        else:
            out.setdefault(section, {})[name] = "true" if value is None else value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Overrides win; a table override given key by key is merged into the file's table."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for section, values in extra.items():
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise ValueError(f"[{section}] must be a table of keys, got {target!r}")
        aliases = _ALIASES.get(section, {})
        for key in list(target):  # so that an override of seq_len replaces a file's block_size
            if aliases.get(key) is not None:
                target[aliases[key]] = target.pop(key)
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key] = {**target[key], **value}
            else:
                target[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a TOML file (None = defaults only), apply command-line overrides, validate.

    `train.name` defaults to the file's stem, so `configs/demo.toml` runs in `runs/demo`.
    Raises FileNotFoundError for a missing file and ValueError for any bad content.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} not found (ready-made ones are in configs/)")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: invalid TOML: {exc}") from None
    raw = _merge(raw, parse_overrides(overrides))
    if path is not None:
        train = raw.setdefault("train", {})
        if isinstance(train, dict) and not train.get("name"):
            train["name"] = path.stem
    return Config.from_dict(raw)


def check_codecs(cfg: Config, available: Sequence[str]) -> None:
    """Raise ValueError if a configured codec is not in `available` (pass `taco.list_codecs()`).

    Kept apart from `__post_init__`: building and checking a config needs no codec registry; the
    caller passes the names it accepts (the CLI passes `taco.list_codecs()`).
    """
    for name in ("tp_codec", "pp_codec", "dp_codec"):
        codec = getattr(cfg.compression, name)
        if name == "tp_codec" and codec.strip().startswith(LADDER + "("):
            items = split_specs(codec.strip()[len(LADDER) + 1 : -1])
            names = [r.partition("(")[0].strip() for r in items if "=" not in r.partition("(")[0]]
            bad = [r for r in names if r not in available]
            if bad:
                raise ValueError(f"compression.tp_codec = {codec!r}: unknown rung codec {bad[0]!r}; "
                                 f"available: {', '.join(available)}")  # fmt: skip
            parse_ladder(codec)  # a malformed ladder raises ValueError naming it
            continue
        if codec not in available:
            hint = ""
            if "(" in codec:  # a spec string: the options have their own field
                hint = f" (a name: options go in compression.{name}_options, e.g. {{ signs = true }})"
            raise ValueError(
                f"compression.{name} = {codec!r}: unknown codec{hint}; available: {', '.join(available)}"
            )
    fallback = cfg.compression.guard_fallback  # a spec string may carry options: "taco(group_size=64)"
    if fallback.partition("(")[0].strip() not in available:
        raise ValueError(
            f"compression.guard_fallback = {fallback!r}: unknown codec; available: {', '.join(available)}"
        )

