"""The tokenizer: train a byte-level BPE on a corpus, or load a Hugging Face one; encode documents.

Why this file exists: the tokenizer is the step of preparation that must be reproducible to the bit
(the same corpus gives the same merges and the same token ids), and encoding a long document in
parallel chunks is only correct if no BPE word straddles a cut. Both rules live here. Fine-tuning
a checkpoint needs the checkpoint's own tokenizer instead (`load_hf_tokenizer`: a tokenizer.json
read with the `tokenizers` library, nothing downloaded), whose document separator is its
<|endoftext|> or else the eos_token of the tokenizer_config.json beside it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "EOT",
    "encode_documents",
    "load_hf_tokenizer",
    "separator_token",
    "splits_at_newlines",
    "tokenizer_file",
    "tokenizer_sha256",
    "train_tokenizer",
]

EOT = "<|endoftext|>"
"""The document separator, the tokenizer's only special token (id 0)."""


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


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json of `path` (the file itself, or a directory holding one)."""
    p = Path(path).expanduser()
    f = p / "tokenizer.json" if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(
            f"no Hugging Face tokenizer at {p} (expected a tokenizer.json file, or a directory holding one)"
        )
    return f


def tokenizer_sha256(path: str | Path) -> str:
    """sha256 of the bytes of a tokenizer.json: what a prepared data set records and is named by."""
    return hashlib.sha256(tokenizer_file(path).read_bytes()).hexdigest()


def load_hf_tokenizer(path: str | Path) -> Tokenizer:
    """The Hugging Face tokenizer of `path` (a tokenizer.json or its directory), read locally."""
    from tokenizers import Tokenizer

    f = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(f))
    except Exception as exc:  # the tokenizers library raises its own exception types
        raise ValueError(f"{f} is not a tokenizer.json the tokenizers library can read: {exc}") from None


def separator_token(tok: Tokenizer, path: str | Path) -> str:
    """The document separator of a loaded tokenizer: <|endoftext|> when it has one, else the
    eos_token named by the tokenizer_config.json beside its tokenizer.json."""
    if tok.token_to_id(EOT) is not None:
        return EOT
    config = tokenizer_file(path).parent / "tokenizer_config.json"
    eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and tok.token_to_id(eos) is not None:
        return eos
    raise ValueError(
        f"the tokenizer {tokenizer_file(path)} has no {EOT} token and no eos_token in a "
        "tokenizer_config.json beside it: documents need a separator token"
    )


def splits_at_newlines(tok: Tokenizer) -> bool:
    """Whether a pre-token always ends at a lone newline (byte-level pre-tokenizers, GPT-2/Qwen
    style), the condition under which `_safe_chunks` may cut a long document for parallel encoding."""
    return "ByteLevel" in json.dumps(json.loads(tok.to_str()).get("pre_tokenizer"))


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


def encode_documents(
    tok: Tokenizer, docs: Sequence[str], separator: str = EOT, chunked: bool = True
) -> list[np.ndarray]:
    """Token ids of each document (parallel over chunks, in order), each ended by `separator`.

    `chunked`: cut long documents at `_safe_chunks` places (only for tokenizers that
    `splits_at_newlines`); otherwise each document is encoded whole. No special tokens are added.
    """
    eot = tok.token_to_id(separator)
    pieces: list[str] = []
    owner: list[int] = []
    for i, text in enumerate(docs):
        for chunk in _safe_chunks(text) if chunked else [text]:
            pieces.append(chunk)
            owner.append(i)
    encoded = tok.encode_batch(pieces, add_special_tokens=False)
    ids: list[list[int]] = [[] for _ in docs]
    for i, enc in zip(owner, encoded):
        ids[i].extend(enc.ids)
    return [np.asarray([*doc, eot], dtype=np.int64) for doc in ids]
