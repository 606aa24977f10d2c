"""Named model sizes, written in the size vocabulary of the `[model]` config section.

Why this file exists: a model size used to be spelled twice, once per vocabulary (the config's
`hidden`/`seq_len`, the model classes' `n_embd`/`block_size`/`hidden_size`...), in two tables that
had the same names and different values. This is the one table. `taco.models.model_config`
translates its neutral names into `GPTConfig`/`QwenConfig`, and `taco.train.config` checks
`model.preset` against it. Plain data and one sizing rule; the module itself needs no torch, the
config layer reads it before any model exists.

`SIZE_DEFAULTS` gives every neutral name its default; a 0 means "derived": `vocab_size` from the
tokenizer, `n_kv_head` = n_head, `head_dim` = hidden // n_head, `intermediate` = `ffn_size(...)`,
`max_positions` = seq_len.

Real shapes (GPT-2 small to XL, Qwen2.5-7B/14B/32B, Qwen3-8B, Llama-3-8B/70B) are here for
`taco plan` and for random-init training at those shapes (`--model.preset=llama3-8b`); their
`seq_len` is a fine-tuning length (4096; GPT-2: its 1024 context), `max_positions` the
checkpoint's context. Llama 3 has no family of its own yet: its presets run on the qwen family
(RMSNorm, RoPE, SwiGLU, grouped-query attention; rope_theta 5e5), which differs from Llama in one
thing, Qwen2's biases on q, k and v (hidden + 2 * kv_heads * head_dim parameters per layer:
196,608 in all for Llama-3-8B, 0.002%); Llama 3.1's RoPE frequency scaling is not modelled either.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["PRESETS", "SIZE_DEFAULTS", "SIZE_KEYS", "ffn_size"]

# Default of every size field (also the defaults of `taco.train.config.ModelConfig`).
SIZE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=0,
    n_layer=4,
    n_head=4,
    n_kv_head=0,
    hidden=128,
    head_dim=0,
    intermediate=0,
    seq_len=128,
    dropout=0.0,
    tie_embeddings=True,
    qk_norm=False,
    rope_theta=10000.0,
    norm_eps=1e-5,
    max_positions=0,
)

# The neutral size vocabulary: what a preset, `model_config` and `[model]` have in common.
SIZE_KEYS: tuple[str, ...] = tuple(SIZE_DEFAULTS)


def ffn_size(kind: str, hidden: int, intermediate: int = 0) -> int:
    """MLP inner size; `intermediate` = 0 means 4 * hidden for gpt and, for qwen, 8/3 * hidden rounded
    up to a multiple of 64 (the SwiGLU width of the same parameter count as gpt's 4 * hidden)."""
    if intermediate:
        return intermediate
    if kind == "gpt":
        return 4 * hidden
    return 64 * math.ceil(8 * hidden / 3 / 64)


# What the members of a checkpoint family share: vocabulary, fine-tuning length, context, untied
# embeddings and the RoPE/norm constants; each member adds its sizes.
_QWEN25_LARGE: dict[str, Any] = dict(kind="qwen", vocab_size=152064, seq_len=4096, max_positions=32768,
                                     tie_embeddings=False, rope_theta=1e6, norm_eps=1e-6)  # fmt: skip
_LLAMA3: dict[str, Any] = dict(kind="qwen", vocab_size=128256, seq_len=4096, max_positions=8192,
                               tie_embeddings=False, rope_theta=5e5, norm_eps=1e-5)  # fmt: skip

# Every preset names its `kind` and the size fields that differ from SIZE_DEFAULTS.
PRESETS: dict[str, dict[str, Any]] = {
    # Tiny models for CPU training, the shapes of configs/*.toml. vocab_size is left to the tokenizer.
    # ~1.3M parameters at a 4096-token vocabulary
    "gpt-demo": dict(kind="gpt", n_layer=4, n_head=4, hidden=128, seq_len=128),
    # ~7.4M parameters at a 4096-token vocabulary
    "gpt-small": dict(kind="gpt", n_layer=8, n_head=8, hidden=256, seq_len=256),
    # ~1.3M parameters at a 4096-token vocabulary
    "qwen-demo": dict(
        kind="qwen", n_layer=4, n_head=8, n_kv_head=4, hidden=128, intermediate=384, seq_len=256,
        rope_theta=1e6, norm_eps=1e-6,
    ),
    # ~5.8M parameters at a 4096-token vocabulary (Qwen3-style: q/k norm, GQA 4/2)
    "qwen-small": dict(
        kind="qwen", n_layer=6, n_head=4, n_kv_head=2, hidden=256, intermediate=768, seq_len=256,
        qk_norm=True, norm_eps=1e-6,
    ),
    # Shapes of public checkpoints (for model.init_from); vocab_size is the checkpoint tokenizer's.
    "gpt2": dict(kind="gpt", vocab_size=50257, n_layer=12, n_head=12, hidden=768, seq_len=1024),
    "gpt2-medium": dict(kind="gpt", vocab_size=50257, n_layer=24, n_head=16, hidden=1024, seq_len=1024),
    "gpt2-large": dict(kind="gpt", vocab_size=50257, n_layer=36, n_head=20, hidden=1280, seq_len=1024),
    "gpt2-xl": dict(kind="gpt", vocab_size=50257, n_layer=48, n_head=25, hidden=1600, seq_len=1024),
    "qwen2.5-0.5b": dict(
        kind="qwen", vocab_size=151936, n_layer=24, n_head=14, n_kv_head=2, hidden=896, intermediate=4864,
        seq_len=2048, rope_theta=1e6, norm_eps=1e-6,
    ),
    "qwen3-0.6b": dict(
        kind="qwen", vocab_size=151936, n_layer=28, n_head=16, n_kv_head=8, hidden=1024, head_dim=128,
        intermediate=3072, seq_len=2048, qk_norm=True, rope_theta=1e6, norm_eps=1e-6,
    ),
    # Qwen2.5 (untied embeddings from 7B on; q/k/v biases, rope_theta 1e6)
    "qwen2.5-7b": dict(**_QWEN25_LARGE, n_layer=28, n_head=28, n_kv_head=4, hidden=3584, intermediate=18944),
    "qwen2.5-14b": dict(**_QWEN25_LARGE, n_layer=48, n_head=40, n_kv_head=8, hidden=5120, intermediate=13824),
    "qwen2.5-32b": dict(**_QWEN25_LARGE, n_layer=64, n_head=40, n_kv_head=8, hidden=5120, intermediate=27648),
    # Qwen3-8B: an 8B-class model whose heads (32, kv 8) split 8 ways, loadable with model.init_from
    "qwen3-8b": dict(
        kind="qwen", vocab_size=151936, n_layer=36, n_head=32, n_kv_head=8, hidden=4096, head_dim=128,
        intermediate=12288, seq_len=4096, max_positions=40960, tie_embeddings=False, qk_norm=True,
        rope_theta=1e6, norm_eps=1e-6,
    ),
    # Llama 3 on the qwen family (module docstring: + q/k/v biases)
    "llama3-8b": dict(**_LLAMA3, n_layer=32, n_head=32, n_kv_head=8, hidden=4096, intermediate=14336),
    "llama3-70b": dict(**_LLAMA3, n_layer=80, n_head=64, n_kv_head=8, hidden=8192, intermediate=28672),
}  # fmt: skip
