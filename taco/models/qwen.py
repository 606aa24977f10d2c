"""Qwen2.5 / Qwen3 style decoder as a plain ``nn.Module`` that knows nothing of distribution.

Why this file exists: the second model family the library trains and fine-tunes (RMSNorm, RoPE,
grouped-query attention, SwiGLU), loadable from Hugging Face checkpoints by ``hf.py``.
As in ``gpt.py``, q/k/v are one fused projection ``qkv`` (GQA-aware: blocks of nq*hd, nkv*hd,
nkv*hd) and gate/up one fused ``gate_up``; the forward stays correct when they are column-sharded
by heads, since local head counts come from the fused output width (``(nq + 2 nkv) * hd`` with
nq = groups * nkv), and the model is cut into ``embed`` -> ``run_layers`` -> ``head`` for
pipeline stages.

RoPE follows the Hugging Face Qwen2 convention (``rotate_half`` on two halves of each head,
``inv_freq = 1 / theta^(arange(0, d, 2) / d)``); ``qk_norm=True`` adds Qwen3's per-head RMSNorm
on q and k before RoPE. Layout is batch first, ``[b, s, h]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from taco.models.decoder import Decoder, fused_linear

_SDPA_GQA = torch.__version__ >= (2, 5)  # scaled_dot_product_attention(enable_gqa=...) exists


@dataclass
class QwenConfig:
    """Hyper-parameters of a Qwen2/Qwen3 style model (names follow the Hugging Face config)."""

    vocab_size: int
    """Number of token ids."""
    hidden_size: int
    """Hidden size ``h``."""
    intermediate_size: int
    """Width ``f`` of the SwiGLU feed-forward."""
    num_hidden_layers: int
    """Number of transformer blocks."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None`` means ``num_attention_heads``."""
    head_dim: int | None = None
    """Per-head width; ``None`` means ``hidden_size // num_attention_heads``."""
    rope_theta: float = 1e6
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_position_embeddings: int = 32768
    """Longest context the model is meant for (informational; RoPE has no table)."""
    tie_word_embeddings: bool = False
    """Share ``lm_head.weight`` with ``tok_emb.weight``."""
    attention_bias: bool | None = None
    """Biases on q, k, v; ``None`` means Qwen's default: yes without ``qk_norm`` (Qwen2), no with (Qwen3)."""
    attention_out_bias: bool = False
    """Bias on the attention output projection (only Qwen3 with ``attention_bias`` has one)."""
    qk_norm: bool = False
    """Qwen3's per-head RMSNorm on q and k before RoPE."""
    rope_scaling: dict | None = None
    """RoPE frequency scaling, Hugging Face's ``rope_parameters``: None (plain RoPE) or
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` (Llama 3.1+)."""
    sliding_window: int | None = None
    """Sliding-window attention (Mistral): token i attends to j with ``i - window < j <= i``; None = all."""

    def __post_init__(self) -> None:
        if self.attention_bias is None:
            self.attention_bias = not self.qk_norm
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"QwenConfig: hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"QwenConfig: num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"QwenConfig: head_dim={self.head_dim} must be even for RoPE")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ("default", "llama3"):
            raise ValueError(f"rope_type={kind!r} is not supported (default or llama3)")


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, computed in fp32 and cast back (Hugging Face order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # [..., d]
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., d]
        return self.weight * x32.to(x.dtype)  # [..., d]


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's RoPE scaling: wavelengths over ``original / low_freq_factor`` slowed by ``factor``,
    those under ``original / high_freq_factor`` kept, the band between interpolated smoothly."""
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # [hd/2]
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)  # [hd/2]


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``positions`` ([s] or [b, s]) -> each [1 or b, 1, s, head_dim];
    ``scaling``: ``QwenConfig.rope_scaling``."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [hd/2]
    if scaling and scaling.get("rope_type") == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    pos = positions if positions.dim() == 2 else positions[None]  # [b or 1, s]
    freqs = pos.float()[..., None] * inv_freq  # [b or 1, s, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [b or 1, s, hd]
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [b or 1, 1, s, hd]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension split in halves."""
    x1, x2 = x.chunk(2, dim=-1)  # [..., hd/2] each
    return torch.cat((-x2, x1), dim=-1)  # [..., hd]


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE (and optional per-head q/k RMSNorm)."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.head_dim = hd
        self.window = cfg.sliding_window
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads per k/v head
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        self.qkv = fused_linear(h, (q, kv, kv), bias=cfg.attention_bias)  # [q; k; v] on output features
        self.out = nn.Linear(cfg.num_attention_heads * hd, h, bias=cfg.attention_out_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # x: [b, s, h]
        hd = self.head_dim
        qkv = self.qkv(x)  # [b, s, (nq + 2 nkv)*hd], nq/nkv = local query/key-value heads
        nkv = qkv.shape[-1] // (hd * (self.groups + 2))
        nq = nkv * self.groups
        q, k, v = qkv.split((nq * hd, nkv * hd, nkv * hd), dim=-1)  # [b, s, nq*hd], 2 x [b, s, nkv*hd]
        q = q.view(b, s, nq, hd)  # [b, s, nq, hd]
        k = k.view(b, s, nkv, hd)  # [b, s, nkv, hd]
        if self.q_norm is not None:
            q = self.q_norm(q)  # [b, s, nq, hd]
            k = self.k_norm(k)  # [b, s, nkv, hd]
        q = q.transpose(1, 2)  # [b, nq, s, hd]
        k = k.transpose(1, 2)  # [b, nkv, s, hd]
        v = v.view(b, s, nkv, hd).transpose(1, 2)  # [b, nkv, s, hd]
        q = q * cos + rotate_half(q) * sin  # [b, nq, s, hd]
        k = k * cos + rotate_half(k) * sin  # [b, nkv, s, hd]
        gqa = {"enable_gqa": True} if nq != nkv and _SDPA_GQA else {}  # each k/v head read for its group
        if nq != nkv and not gqa:  # torch < 2.5: SDPA wants one k/v head per query head
            k = k.repeat_interleave(nq // nkv, dim=1)  # [b, nq, s, hd]
            v = v.repeat_interleave(nq // nkv, dim=1)  # [b, nq, s, hd]
        if self.window is not None and s > self.window:  # causal, and at most `window` keys back
            i = torch.arange(s, device=x.device)
            lag = i[:, None] - i[None, :]  # [s, s]: query index - key index
            mask = (lag >= 0) & (lag < self.window)  # [s, s]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)  # [b, nq, s, hd]
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)  # [b, nq, s, hd]
        y = y.transpose(1, 2).reshape(b, s, nq * hd)  # [b, s, nq*hd]
        return self.out(y)  # [b, s, h]


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, gate and up as one fused projection."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        f = cfg.intermediate_size
        self.gate_up = fused_linear(cfg.hidden_size, (f, f), bias=False)  # [gate; up] on output features
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # 2 x [b, s, f] (or f/tp when sharded)
        y = F.silu(gate) * up  # [b, s, f]
        return self.down(y)  # [b, s, h]


class Block(nn.Module):
    """Pre-norm block: ``x + attn(rmsnorm(x))`` then ``x + mlp(rmsnorm(x))``."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # [b, s, h]
        x = x + self.mlp(self.mlp_norm(x))  # [b, s, h]
        return x


class Qwen(Decoder):
    """Qwen2/Qwen3 language model: ``forward(idx) = head(run_layers(embed(idx)))``."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def reset_parameters(self) -> None:
        """N(0, 0.02) for linears and embeddings, residual projections scaled by 1/sqrt(2 L)."""
        self.init_weights(self.config.num_hidden_layers, (RMSNorm,))

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings. ``idx``: [b, s] -> [b, s, h]; ``positions`` unused (RoPE is in the layers)."""
        return self.tok_emb(idx)  # [b, s, h]

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """All blocks in ``self.layers``. ``positions``: [s] or [b, s], default 0..s-1."""
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)  # [s]
        c = self.config
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype, c.rope_scaling)
        for layer in self.layers:
            x = layer(x, cos, sin)  # [b, s, h]
        return x
