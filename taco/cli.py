"""The `taco` console script: train, calibrate, compare, bench, plan, data, export, config
(docs/design.md 2.2).

Each subcommand's module adds its own arguments; heavy imports happen only when it runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable


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

    from taco.bench.plan_report import add_plan_subparser

    add_plan_subparser(sub)
    add_data_subparser(sub)
    add_export_subparser(sub)
    add_config_subparser(sub)
    return p


def exit_code(command: str, exc: BaseException) -> int | None:
    """The exit status of `taco COMMAND` ending with `exc`, None for a bug (the traceback shows).

    The one place that maps errors to exit codes: 2 when the command cannot run as asked (a bad
    argument, config value or file, `UsageError`, `ValueError`, `FileNotFoundError`, a benchmark the
    machine cannot run, `BenchError`); 1 when `taco data` cannot prepare a data set (a download or a
    file that fails) and when a run stops early (`RunStopped`, whose `exit_code` may say more: 128 +
    the signal for SIGTERM/SIGINT); 130 for Ctrl-C outside a run.
    """
    from taco.bench import BenchError
    from taco.train.errors import RunStopped, UsageError

    if isinstance(exc, RunStopped):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, UsageError | BenchError):
        return 2
    if command == "data" and isinstance(exc, RuntimeError | ValueError | FileNotFoundError):
        return 1
    if isinstance(exc, ValueError | FileNotFoundError):
        return 2
    return None


def run_command(prog: str, command: str, fn: Callable[[], int | None]) -> int:
    """Run a command's handler: its return value is the exit status; an error it raises is one line
    on stderr ("prog: message") and the status `exit_code` gives, or a traceback if it is a bug."""
    try:
        code = int(fn() or 0)
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at exit
        return code
    except BrokenPipeError:  # `taco config show | head`: the reader has gone, as for any Unix tool
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing left to flush at exit
        return 128 + signal.SIGPIPE
    except (Exception, KeyboardInterrupt) as e:
        code = exit_code(command, e)
        if code is None:
            raise
        # one line; a rank's traceback is in the run's log
        text = "interrupted" if isinstance(e, KeyboardInterrupt) else e
        print(f"{prog}: {text}", file=sys.stderr, flush=True)
        return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    prog = f"taco {args.command}" + (f" {args.bench}" if args.command == "bench" else "")
    return run_command(prog, args.command, lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
