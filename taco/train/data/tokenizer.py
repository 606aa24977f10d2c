"""The byte-level BPE: train it on a corpus and encode documents with it.

Why this file exists: the tokenizer is the step of preparation that must be reproducible to the bit
(the same corpus gives the same merges and the same token ids), and encoding a long document in
parallel chunks is only correct if no BPE word straddles a cut. Both rules live here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["EOT", "encode_documents", "train_tokenizer"]

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


def encode_documents(tok: Tokenizer, docs: Sequence[str]) -> list[np.ndarray]:
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
