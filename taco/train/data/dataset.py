"""Batches from a prepared data set: memory-mapped token splits and seeded (x, y) windows.

Why this file exists: comparing codecs against the uncompressed baseline (docs/design.md section 3) only
means something if every run sees exactly the same tokens, and resuming from a checkpoint must
reproduce an uninterrupted run (section 4). So the batch of step k is a pure function of
(seed, k, data-parallel rank), with no sampler state to save, and the global batch does not depend
on the parallel layout (dp = 2 sees the same sequences as dp = 1, split in two). This is all the
trainer needs from the data package at run time; preparation lives in `prepare.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from taco.train.data.prepare import PREPARE_HINT, load_meta

if TYPE_CHECKING:
    import torch

__all__ = ["TokenDataset", "get_batch"]

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
            raise FileNotFoundError(f"{path} not found: create the data set with `{PREPARE_HINT}`")
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
