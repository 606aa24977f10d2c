"""Type coercion: a TOML value or a command-line string -> the annotated type of a config field.

Why this file exists: the same field is set from a TOML file (already typed: `3`, `true`,
`{group_size = 64}`) and from `--section.key=value` (always a string: "3", "true", "1_000",
"a,b", "{group_size=64}"), and both must land as one type with an error naming the field
("train.steps: expected int, got 'ten'"). It knows the handful of types the sections use:
bool, int, float, str, str enums, `X | None`, `bool | str`, `list[...]`, `dict[str, Any]`.
Why not a library: see the package docstring (`taco.train.config`).
"""

from __future__ import annotations

import enum
import sys
import types
import typing
from pathlib import Path
from typing import Any, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["coerce", "toml_value", "type_name"]


def type_name(tp: Any) -> str:
    """The type as a user reads it in an error or in `--help` ("int or none", "one of 'gpt', 'qwen')."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])} (comma-separated on the command line)"
    if origin is dict:
        return 'table, e.g. {group_size=128, fmt="e4m3"}'
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def toml_value(text: str) -> Any:
    """Parse `text` as one TOML value (`{a=1}`, `[1, 2]`, `"x"`, `3`); raise ValueError if it is not."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not a TOML value: {text!r} ({exc})") from None


def _enum(value: Any, tp: type[enum.Enum], where: str) -> enum.Enum:
    parse = getattr(tp, "parse", None)  # the config's string enums bring their own (case-insensitive)
    if parse is not None:
        return parse(value, where)
    try:
        return tp(value)
    except ValueError:
        raise ValueError(f"{where}: expected {type_name(tp)}, got {value!r}") from None


def _int(value: Any, bad: ValueError) -> int:
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            try:
                f = float(value)
            except ValueError:
                raise bad from None
            if f.is_integer():
                return int(f)
    raise bad


def _float(value: Any, bad: ValueError) -> float:
    if isinstance(value, bool):
        raise bad
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            raise bad from None
    raise bad


def _bool(value: Any, bad: ValueError) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise bad


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert `value` (a TOML value or a command-line string) to the annotated type `tp`.

    Raises ValueError naming `where` (e.g. "train.steps") and the expected type.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ValueError(f"{where}: expected {type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if type(None) in args and (
            value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null"))
        ):
            return None
        for arg in args:  # first member that accepts the value wins: `bool | str` reads "true" as True
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ValueError:
                pass
        raise bad
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum(value, tp, where)
    if tp is bool:
        return _bool(value, bad)
    if tp is int:
        return _int(value, bad)
    if tp is float:
        return _float(value, bad)
    if tp is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise bad
    if origin is list:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                value = toml_value(text)
            else:
                value = [item.strip() for item in text.split(",") if item.strip()]
        if isinstance(value, (list, tuple)):
            return [coerce(item, args[0] if args else Any, f"{where}[{i}]") for i, item in enumerate(value)]
        raise bad
    if origin is dict or tp is dict:
        if isinstance(value, str) and value.strip().startswith("{"):
            value = toml_value(value.strip())
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise bad
    raise TypeError(f"{where}: unsupported field type {tp!r} (a bug in taco.train.config)")

