"""Benchmarks (DESIGN.md 3): codec fidelity/throughput, collectives, emulated clusters, cost model.

Every figure is measured side by side in one run; each benchmark prints a table and can write JSON.
"""

from __future__ import annotations

import argparse
import importlib


def add_bench_subparsers(sub: argparse._SubParsersAction) -> None:
    """Register `taco bench codec|comm|cluster`, each from its own module (imported lazily to run)."""
    for name in ("codec", "comm", "cluster"):
        try:
            mod = importlib.import_module(f"taco.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"taco.bench.{name}":
                raise
            continue
        getattr(mod, f"add_{name}_subparser")(sub)
        sub.choices[name].set_defaults(func=getattr(mod, f"run_{name}"))
