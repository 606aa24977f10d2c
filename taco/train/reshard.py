"""Layout-free names for a rank's tensors: what makes a checkpoint loadable at another tp/pp/dp.

Why this file exists: the trainer's parameters are plain local shards of a layout (a fused q/k/v
column shard is ``[q_r; k_r; v_r]``, a vocabulary is padded for tp, FSDP2 cuts each TP shard once
more along dim 0 across dp). A checkpoint that names each tensor by a *logical* key with its full
*logical* shape, and records where this rank's block sits in it, reloads at any layout: the
reader asks for the blocks of its own layout and `torch.distributed.checkpoint` copies the
overlapping parts (docs/design.md, section 4, "Checkpoints").

Logical tensors (for a model parameter named ``name`` in the unsharded model, pipeline stages
keep global layer indices):

* a column-parallel projection with fused blocks (``fused_parts``: q/k/v, gate/up) is one logical
  tensor per block, ``{name}/{i}`` of shape ``[block_i, in]`` (its bias ``[block_i]``): at tp=t,
  rank r holds rows ``[r*block_i/t, (r+1)*block_i/t)`` of each, contiguous in its local shard;
* a row-parallel weight ``[out, in]`` is cut along dim 1;
* the vocabulary (``tok_emb``, ``lm_head``) has the *real* vocabulary's rows: the rows padded for
  tp are not saved and load as zeros; a tied ``lm_head`` (one object, or the last pipeline stage's
  copy) is the same logical tensor as ``tok_emb.weight``;
* everything else is replicated: the whole tensor on every rank.

A `Piece` says: local block ``local`` (one slice per dim of the rank's TP shard) is the block of
the logical tensor ``key`` (shape ``size``) starting at ``offsets``. `dp_restrict` cuts pieces to
the rows an FSDP2 rank keeps. Optimizer moments and fp32 masters follow their parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from taco.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

_VOCAB_MODULES = ("tok_emb", "lm_head")


@dataclass(frozen=True)
class Piece:
    """Block ``local`` of a rank's tensor is block ``offsets`` (+ its shape) of logical ``key``."""

    key: str
    """Layout-free name of the logical tensor."""
    local: tuple[slice, ...]
    """Where the block is in the rank's (TP-local) tensor, one slice per dim."""
    offsets: tuple[int, ...]
    """Where it starts in the logical tensor."""
    size: tuple[int, ...]
    """Shape of the logical tensor."""
    replicated: bool = False
    """Every TP rank holds the whole logical tensor (norms, row-parallel biases)."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.local)


def _whole(key: str, t: torch.Tensor) -> Piece:
    return Piece(key, tuple(slice(0, n) for n in t.shape), (0,) * t.dim(), tuple(t.shape), replicated=True)


def _rows(key: str, t: torch.Tensor, lo: int, hi: int, start: int, total: int) -> Piece:
    """Rows [lo, hi) of local `t` are rows [start, start + hi - lo) of a logical [total, ...]."""
    rest = tuple(slice(0, n) for n in t.shape[1:])
    return Piece(key, (slice(lo, hi), *rest), (start,) + (0,) * (t.dim() - 1), (total, *t.shape[1:]))


def _column(key: str, t: torch.Tensor, parts: tuple[int, ...] | None, tp: int, r: int) -> list[Piece]:
    """A column shard [sum(parts), ...] of local blocks `parts` (default: one block) at tp rank r."""
    parts = parts or (t.shape[0],)
    out, lo = [], 0
    for i, w in enumerate(parts):
        name = f"{key}/{i}" if len(parts) > 1 else key
        out.append(_rows(name, t, lo, lo + w, r * w, w * tp))
        lo += w
    return out


def _vocab(key: str, t: torch.Tensor, r: int, vocab: int) -> list[Piece]:
    """A vocabulary shard [V_pad/tp, h]: its rows below the real `vocab` only."""
    n = t.shape[0]
    start = r * n
    keep = max(0, min(n, vocab - start))
    return [_rows(key, t, 0, keep, start, vocab)] if keep else []


def tp_pieces(model: nn.Module, tp: int, tp_rank: int, vocab: int) -> dict[str, list[Piece]]:
    """Pieces of every parameter `model` holds (after `apply_tensor_parallel` and the pipeline cut),
    by its local name (``model.named_parameters()``; a tied weight once). `vocab`: the real
    vocabulary (rows past it are padding)."""
    tied_emb = None
    emb = getattr(model, "tok_emb", None)
    head = getattr(model, "lm_head", None)
    if emb is not None and head is not None and head.weight is emb.weight:
        tied_emb = emb.weight
    cfg = model.config
    tied_copy = bool(getattr(cfg, "tie_word_embeddings", getattr(cfg, "tie_embeddings", False)))
    out: dict[str, list[Piece]] = {}
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if mname in _VOCAB_MODULES and pname == "weight":
                tied = mname == "lm_head" and (tied_emb is not None or tied_copy)
                if tied and tied_emb is not None:
                    continue  # the same Parameter as tok_emb.weight: listed once
                key = "tok_emb.weight" if tied else name
                out[name] = _vocab(key, p, tp_rank, vocab)
            elif isinstance(mod, ColumnParallelLinear):
                out[name] = _column(name, p, getattr(mod, "fused_parts", None), tp, tp_rank)
            elif isinstance(mod, nn.Linear):  # tp = 1: the whole projection, still cut into its blocks
                out[name] = _column(name, p, getattr(mod, "fused_parts", None), 1, 0)
            elif isinstance(mod, RowParallelLinear) and pname == "weight":
                n = p.shape[1]
                out[name] = [
                    Piece(name, (slice(0, p.shape[0]), slice(0, n)), (0, tp_rank * n), (p.shape[0], n * tp))
                ]
            elif isinstance(mod, VocabParallelEmbedding):
                out[name] = _vocab(name, p, tp_rank, vocab)
            else:
                out[name] = [_whole(name, p)]
    return out


def dp_restrict(pieces: list[Piece], lo: int, hi: int) -> list[Piece]:
    """The pieces cut to rows [lo, hi) of the TP-local tensor, re-indexed into that row block (an
    FSDP2 shard); pieces outside it are dropped."""
    out = []
    for p in pieces:
        if not p.local:  # a scalar: replicated whole
            out.append(p)
            continue
        a, b = max(p.local[0].start, lo), min(p.local[0].stop, hi)
        if a >= b:
            continue
        shift = a - p.local[0].start
        local = (slice(a - lo, b - lo), *p.local[1:])
        out.append(replace(p, local=local, offsets=(p.offsets[0] + shift, *p.offsets[1:])))
    return out


def fsdp_rows(full_rows: int, local_rows: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of a TP-local tensor of `full_rows` that FSDP2's dim-0 shard of `dp_rank`
    holds (``torch.chunk`` sizes: ceil(n/dp) per rank, the last ones shorter or empty)."""
    per = -(-full_rows // dp)
    lo = min(dp_rank * per, full_rows)
    hi = min(lo + per, full_rows)
    if hi - lo != local_rows:
        raise ValueError(f"an FSDP2 shard of {full_rows} rows at dp rank {dp_rank}/{dp}: {local_rows} rows")
    return lo, hi
