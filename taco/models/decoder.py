"""What GPT and Qwen share: the decoder interface the parallel code relies on, and the random init.

Why this file exists: the pipeline runs a model as ``embed -> run_layers -> head`` (a stage keeps
its slice of ``layers`` and, first or last, the embedding or the head), and the TP plan names
``tok_emb``, ``layers``, ``norm`` and ``lm_head``. A model subclasses ``Decoder`` and writes
``embed`` and ``run_layers`` (where the architectures differ); ``head``, ``forward``,
``num_params`` and the weight initialisation are written once here. Init (nanoGPT, GPT-2):
N(0, 0.02) for linears and embeddings, the residual projections of each block (``attn.out``,
``mlp.down``) scaled by 1/sqrt(2 n_layer), zero biases, unit norm gains.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class Decoder(nn.Module):
    """Base of the decoder-only models: ``tok_emb``, ``layers``, ``norm``, ``lm_head`` (+ ``pos_emb``)."""

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b, s] -> hidden states [b, s, h]."""
        raise NotImplementedError

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states through the blocks held here: [b, s, h] -> [b, s, h]."""
        raise NotImplementedError

    def head(self, x: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """Final norm and output projection. ``x``: [b, s, h] -> logits [b, s, vocab], in fp32
        (``upcast=False``: in the model's dtype, for a loss that widens them itself, so that the
        logits are not copied to fp32 twice)."""
        logits = self.lm_head(self.norm(x))  # [b, s, vocab]
        return logits.float() if upcast else logits

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``idx``: LongTensor [b, s] -> logits [b, s, vocab] (float32)."""
        return self.head(self.run_layers(self.embed(idx, positions), positions))

    def embeddings(self) -> list[nn.Module]:
        """The embedding tables ``embed`` looks up: ``tok_emb`` (and ``pos_emb`` where the model has one)."""
        return [m for m in (self.tok_emb, getattr(self, "pos_emb", None)) if m is not None]

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters, tied weights counted once; optionally without ``tok_emb`` (and ``pos_emb``)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= sum(emb.weight.numel() for emb in self.embeddings())
        return n

    def resize_vocab(self, vocab_size: int) -> None:
        """Give ``tok_emb`` and ``lm_head`` ``vocab_size`` token rows, in place: the first rows kept,
        new rows zero (padding a vocabulary so that vocab-parallel layers shard it evenly), extra
        rows dropped (stripping that padding). Tied weights stay tied; ``config.vocab_size`` follows."""
        old_emb, old_head = self.tok_emb.weight, self.lm_head.weight
        tied = old_head is old_emb
        keep = min(old_emb.shape[0], vocab_size)

        def rows(w: torch.Tensor) -> nn.Parameter:
            new = w.new_zeros(vocab_size, w.shape[1])  # [V', h]
            new[:keep] = w[:keep]
            return nn.Parameter(new, requires_grad=w.requires_grad)

        with torch.no_grad():
            self.tok_emb = nn.Embedding(vocab_size, old_emb.shape[1], _weight=rows(old_emb))
            head = nn.Linear(old_head.shape[1], vocab_size, bias=False, device="meta")
            head.weight = self.tok_emb.weight if tied else rows(old_head)
            self.lm_head = head
        self.config.vocab_size = vocab_size

    def init_weights(self, n_layer: int, norms: tuple[type[nn.Module], ...]) -> None:
        """The random init above, in place; ``norms`` are the norm classes whose gain starts at one."""
        resid_std = 0.02 / math.sqrt(2 * n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith(("attn.out", "mlp.down")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, norms):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)


def fused_linear(in_features: int, parts: tuple[int, ...], bias: bool) -> nn.Linear:
    """One ``nn.Linear`` computing several projections of the same input, stacked on output
    features (q/k/v, gate/up): one GEMM instead of several. ``fused_parts`` on the module names
    each block's width, so tensor parallelism shards every block by itself and each rank holds
    its slices of all blocks, contiguous (``taco.parallel.layers.ColumnParallelLinear``)."""
    lin = nn.Linear(in_features, sum(parts), bias=bias)
    lin.fused_parts = tuple(parts)
    return lin
