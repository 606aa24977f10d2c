"""Writing a run configuration: TOML that `load_config` reads back, and the `--help` text of every key.

Why this file exists: a run directory keeps the resolved config (`config_to_toml`) so that the run
can be reproduced or resumed from its own folder; each key is written with its doc as a comment
(the field metadata of schema.py) and every size explicitly, so that a later change of a preset or
of a default cannot change what the saved file means. A tiny writer instead of a dependency:
`tomllib` only reads, and the values here are flat tables of scalars, lists and inline tables.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
import typing
from typing import Any

from taco.train.config.choices import _Choice
from taco.train.config.coerce import type_name
from taco.train.config.run import _SECTIONS, Config
from taco.train.config.schema import default_cache_dir, field_docs


def _toml_str(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_key(key: str) -> str:
    return key if key and all(c.isalnum() or c in "_-" for c in key) else _toml_str(key)


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and math.isnan(value):
            return "nan"
        if isinstance(value, float) and math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as TOML")


def config_to_toml(cfg: Config, comments: bool = True) -> str:
    """The resolved config as TOML (every key, one section per table), loadable by `load_config`.

    With `comments`, each key is preceded by its doc (`field_docs`) as a comment. Every model size
    field is written explicitly, so the preset (kept for the record) changes nothing on reload.
    """
    lines = ["# TACO-TP resolved run configuration (taco.train.config.config_to_toml)"]
    for name, section_cls in _SECTIONS.items():
        docs = field_docs(section_cls) if comments else {}
        lines += ["", f"[{name}]"]
        for key, value in getattr(cfg, name).to_dict().items():
            lines += textwrap.wrap(docs.get(key, ""), width=100, initial_indent="# ", subsequent_indent="# ")
            lines.append(f"{_toml_key(key)} = {_toml_literal(value)}")
    return "\n".join(lines) + "\n"


def config_help() -> str:
    """Every key (`--section.key  (type, default)` and its doc, wrapped) for `taco config show`."""
    intro = (
        "Every key of a run config: in a TOML file as `key = value` under its [section], or on the "
        "command line as --section.key=value (later wins: defaults < model.preset < file < command line)."
    )
    lines = [*textwrap.wrap(intro, width=100), ""]
    for name, section_cls in _SECTIONS.items():
        docs = field_docs(section_cls)
        hints = typing.get_type_hints(section_cls)
        default = section_cls()
        lines.append((section_cls.__doc__ or f"[{name}]").strip())
        for f in dataclasses.fields(section_cls):
            value = getattr(default, f.name)
            shown = _toml_literal(value.value if isinstance(value, _Choice) else value)
            lines.append(f"  --{name}.{f.name}  ({type_name(hints[f.name])}, default {shown})")
            if docs.get(f.name):
                indent = " " * 6
                lines += textwrap.wrap(docs[f.name], 100, initial_indent=indent, subsequent_indent=indent)
    return "\n".join(lines)


def config_reference() -> str:
    """Every key as a Markdown page (`taco config show --markdown`): docs/configuration.md is this
    text, so the documented keys, types, defaults and docs are the schema's (a test compares them)."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the config schema by `taco config show --markdown > docs/configuration.md`;",
        "     do not edit by hand (tests/test_docs.py checks that it matches). -->",
        "",
        "A run is configured by a TOML file with one table per section below, and by command-line",
        "overrides `--section.key=value` (later wins: defaults < `model.preset` < file < command line).",
        "`taco config show` prints this list in the terminal; `taco config show --config FILE",
        "[--section.key=value ...]` prints the config they resolve to, as the `config.toml` a run",
        "writes to its folder. Aliases: `model.block_size` for `model.seq_len`, `train.checkpoint_every`",
        "for `train.checkpoint_interval`.",
    ]
    for name, section_cls in _SECTIONS.items():
        docs = field_docs(section_cls)
        hints = typing.get_type_hints(section_cls)
        default = section_cls()
        lines += ["", f"## [{name}]", "", " ".join((section_cls.__doc__ or "").split()), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(section_cls):
            value = getattr(default, f.name)
            if f.default_factory is default_cache_dir:  # depends on the machine: say how
                shown = "`$TACO_DATA_DIR`, else `~/.cache/taco`"
            else:
                shown = f"`{_toml_literal(value.value if isinstance(value, _Choice) else value)}`"
            cells = [f"`{name}.{f.name}`", type_name(hints[f.name]), shown, docs.get(f.name, "")]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
