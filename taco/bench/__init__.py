"""Benchmarks (docs/design.md 3): codec fidelity/throughput, collectives, emulated clusters, cost model.

Every figure is measured side by side in one run; each benchmark prints a table and can write JSON.
This file registers the `taco bench` subcommands and holds what their entries share. The
benchmarks raise `BenchError` (the environment cannot run it: no root, no iproute2) or `ValueError`
(an option value it does not support); `taco.cli`, the one place that maps errors to exit codes,
turns them into one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib


class BenchError(RuntimeError):
    """A benchmark cannot run on this machine as asked (e.g. a capped namespace without root).

    The message is complete and meant for the user; no traceback is needed to act on it.
    """


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
