"""The `taco` console script: train, calibrate, compare, bench, plan, data, export, config
(docs/design.md 2.2).

Each subcommand's module adds its own arguments; heavy imports happen only when it runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="taco", description="TACO-TP: compressed tensor-parallel communication for LLM training"
    )
    sub = p.add_subparsers(dest="command", required=True)

    from taco.train.cli import (
        add_calibrate_subparser,
        add_compare_subparser,
        add_config_subparser,
        add_data_subparser,
        add_export_subparser,
        add_train_subparser,
    )

    add_train_subparser(sub)
    add_calibrate_subparser(sub)
    add_compare_subparser(sub)

    bench = sub.add_parser("bench", help="benchmarks: codec, comm, cluster")
    bsub = bench.add_subparsers(dest="bench", required=True)
    from taco.bench import add_bench_subparsers

    add_bench_subparsers(bsub)

    from taco.train.plan_report import add_plan_subparser

    add_plan_subparser(sub)
    add_data_subparser(sub)
    add_export_subparser(sub)
    add_config_subparser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    from taco.train.errors import RunStopped

    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at exit
        return code
    except BrokenPipeError:  # `taco config show | head`: the reader has gone, as for any Unix tool
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing left to flush at exit
        return 128 + signal.SIGPIPE
    except RunStopped as e:  # a rank's error, or SIGTERM/SIGINT: one line, the traceback in a log
        print(f"taco {args.command}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"taco {args.command}: interrupted", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
