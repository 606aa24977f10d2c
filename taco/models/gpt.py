"""GPT-2 style decoder as a plain ``nn.Module`` that knows nothing of distribution.

Why this file exists: it is the reference model the trainer and the tensor-parallel tests run.
Tensor parallelism is applied from the outside (``taco.models.plans`` names the styles,
``taco.parallel`` swaps the layers), so the forward here must keep working when another module
shards its linears:

* q, k and v are one fused projection ``qkv`` (one GEMM, as Megatron-Core's ``linear_qkv``) whose
  ``fused_parts`` name the three output blocks; a column-parallel shard keeps each rank's q, k and
  v slices contiguous (``[q_r; k_r; v_r]``), and attention derives its *local* heads from the
  output width, ``n_local = qkv.shape[-1] // (3 * head_dim)``, so sharding by heads needs no
  change here (``head_dim`` is fixed by the config);
* the model is cut into ``embed`` -> ``run_layers`` -> ``head`` so a pipeline stage can run a
  subset (replace ``layers`` by a slice, or skip ``embed``/``head``).

Layout is batch first, ``[b, s, h]``. Parameter names (``tok_emb``, ``layers.{i}.attn.qkv``,
``layers.{i}.mlp.down``, ...) are a contract with ``plans.py`` and ``hf.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from taco.models.decoder import Decoder, fused_linear


@dataclass
class GPTConfig:
    """Hyper-parameters of a GPT-2 style model."""

    vocab_size: int
    """Number of token ids (rows of the embedding and of ``lm_head``)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Number of attention heads; ``n_embd`` must be divisible by it."""
    n_embd: int
    """Hidden size ``h``."""
    block_size: int
    """Maximum sequence length (rows of the learned position embedding)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    bias: bool = True
    """Biases in linears and LayerNorms (GPT-2 has them)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon (GPT-2: 1e-5)."""
    tie_embeddings: bool = True
    """Share ``lm_head.weight`` with ``tok_emb.weight``."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "pick n_embd as a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class Attention(nn.Module):
    """Causal multi-head self-attention: one fused q/k/v projection, then the out projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h = cfg.n_embd
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.qkv = fused_linear(h, (h, h, h), bias=cfg.bias)  # [q; k; v] on output features
        self.out = nn.Linear(h, h, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # x: [b, s, h]
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x [b, s, nl*hd], nl = local heads (all unless sharded)
        n_local = q.shape[-1] // self.head_dim
        q = q.view(b, s, n_local, self.head_dim).transpose(1, 2)  # [b, nl, s, hd]
        k = k.view(b, s, n_local, self.head_dim).transpose(1, 2)  # [b, nl, s, hd]
        v = v.view(b, s, n_local, self.head_dim).transpose(1, 2)  # [b, nl, s, hd]
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # [b, nl, s, hd]
        y = y.transpose(1, 2).reshape(b, s, n_local * self.head_dim)  # [b, s, nl*hd]
        return self.resid_drop(self.out(y))  # [b, s, h]


class MLP(nn.Module):
    """Two-layer feed-forward with GPT-2's tanh-approximated GELU (``gelu_new``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.up(x), approximate="tanh")  # [b, s, 4h] (or 4h/tp when sharded)
        return self.drop(self.down(x))  # [b, s, h]


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))  # [b, s, h]
        x = x + self.mlp(self.mlp_norm(x))  # [b, s, h]
        return x


class GPT(Decoder):
    """GPT-2 language model: ``forward(idx) = head(run_layers(embed(idx)))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2 n_layer)."""
        self.init_weights(self.config.n_layer, (nn.LayerNorm,))

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token + position embeddings. ``idx``: [b, s]; ``positions``: [s] or [b, s] (default 0..s-1)."""
        s = idx.shape[1]  # idx: [b, s]
        if positions is None:
            if s > self.config.block_size:
                raise ValueError(f"sequence length {s} exceeds block_size={self.config.block_size}")
            positions = torch.arange(s, device=idx.device)  # [s]
        x = self.tok_emb(idx) + self.pos_emb(positions)  # [b, s, h]
        return self.drop(x)  # [b, s, h]

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """All blocks in ``self.layers``; ``positions`` is unused (kept for a uniform signature)."""
        for layer in self.layers:
            x = layer(x)  # [b, s, h]
        return x
