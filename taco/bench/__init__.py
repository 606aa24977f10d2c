"""Benchmarks (docs/design.md 3): codec fidelity/throughput, collectives, emulated clusters, cost model.

Every figure is measured side by side in one run; each benchmark prints a table and can write JSON.
This file registers the `taco bench` subcommands and holds what their entries share: library code
here raises `BenchError` (the environment cannot run it: no root, no iproute2) or
`ValueError` (an option value it does not support); only the command-line entries (`run_codec`,
`run_comm`, `run_cluster`, `netns.main`, wrapped by `cli_entry`) turn them into one line on stderr
and exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., int])


class BenchError(RuntimeError):
    """A benchmark cannot run on this machine as asked (e.g. a capped namespace without root).

    The message is complete and meant for the user; no traceback is needed to act on it.
    """


def cli_entry(prog: str) -> Callable[[F], F]:
    """Decorate a command-line entry: `BenchError` and `ValueError` become "prog: message" on stderr
    and exit status 2, instead of a traceback (the library below raises, it never exits)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def entry(*args, **kwargs) -> int:
            try:
                return fn(*args, **kwargs)
            except (BenchError, ValueError) as e:
                print(f"{prog}: {e}", file=sys.stderr)
                return 2

        return entry  # type: ignore[return-value]

    return wrap


BENCHES = ("codec", "comm", "cluster")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` that ends each option's text with its default, lists as they are typed (`50,100`);
    not for options without one (None, a flag's False, "", []) or whose text gives it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        none = default is None or default is False or default is argparse.SUPPRESS or default in ("", [])
        if not action.option_strings or none or "(default" in text or "%(default)" in text:
            return text
        if isinstance(default, (list, tuple)):
            default = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default)
        return f"{text} (default: {str(default).replace('%', '%%')})"


def add_bench_subparsers(sub: argparse._SubParsersAction) -> None:
    """Register `taco bench codec|comm|cluster`: each module gives `HELP`, `add_arguments(p)` and
    `run_<name>(args)`; a module with `TAKES_OVERRIDES` also receives `--section.key=value` extras."""
    for name in BENCHES:
        mod = importlib.import_module(f"taco.bench.{name}")
        p = sub.add_parser(
            name, help=mod.HELP, description=mod.__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter
        )
        mod.add_arguments(p)
        takes = getattr(mod, "TAKES_OVERRIDES", False)
        p.set_defaults(func=getattr(mod, f"run_{name}"), takes_overrides=takes)


def bench_main(name: str, argv: list[str] | None = None) -> int:
    """`python -m taco.bench.<name> ARGS` = `taco bench <name> ARGS` (one parser for both)."""
    from taco.cli import main

    return main(["bench", name, *(sys.argv[1:] if argv is None else argv)])
