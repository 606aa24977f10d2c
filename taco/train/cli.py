"""`taco train` and `taco compare` argument handling (config file + `--section.key=value`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _load(args: argparse.Namespace):
    import taco
    from taco.train.config import check_codecs, load_config

    cfg = load_config(args.config, args.overrides)
    check_codecs(cfg, taco.list_codecs())
    return cfg


def add_train_subparser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model (spawns local ranks unless under torchrun)",
        description="Extra --section.key=value arguments override the config file.",
    )
    p.add_argument("--config", default=None, help="TOML config (e.g. configs/demo.toml)")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from taco.train.launch import launch

    try:
        cfg = _load(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"taco train: {e}", file=sys.stderr)
        return 2
    try:
        launch(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"taco train: {e}", file=sys.stderr)
        return 2
    return 0


def add_compare_subparser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="baseline vs codecs on the same seed and data")
    p.add_argument("--config", default=None)
    p.add_argument(
        "--codecs",
        default="taco,fp8-tensor,taco-1s,int8-hadamard",
        help="comma-separated TP codecs to compare against codec 'none'",
    )
    p.add_argument("--out", default="runs/compare", help="output directory (curves, table, PNG)")
    p.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    from taco.train.compare import compare

    try:
        cfg = _load(args)
        import taco

        codecs = [c for c in args.codecs.split(",") if c]
        for c in codecs:
            taco.get_codec(c)
    except (ValueError, FileNotFoundError) as e:
        print(f"taco compare: {e}", file=sys.stderr)
        return 2
    compare(cfg, codecs, Path(args.out))
    return 0
