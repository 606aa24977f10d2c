"""Models TACO-TP trains: plain ``nn.Module``s, their tensor-parallel plans, and HF checkpoint I/O.

Why this package exists: the trainer and the tensor-parallel layers need a few small, readable
decoders (GPT-2 and Qwen2/Qwen3 style) whose parameter names are stable; distribution is applied
from outside through ``plans.tp_plan``. ``build_model`` makes one by kind or preset name.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from taco.models.gpt import GPT, GPTConfig
from taco.models.hf import load_hf_checkpoint, save_hf_checkpoint
from taco.models.plans import check_tp_size, resolve_plan, sites, tp_plan
from taco.models.qwen import Qwen, QwenConfig

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "Qwen",
    "QwenConfig",
    "build_model",
    "check_tp_size",
    "load_hf_checkpoint",
    "resolve_plan",
    "save_hf_checkpoint",
    "sites",
    "tp_plan",
]

# Tiny models for CPU training. vocab_size is usually overridden by the tokenizer's size.
# Head counts, key/value heads and widths divide by 4 (tp up to 4; up to 8 for the "small" GPT).
PRESETS: dict[str, dict[str, Any]] = {
    # ~1.4M parameters
    "gpt-demo": dict(kind="gpt", vocab_size=4096, n_layer=4, n_head=4, n_embd=128, block_size=256),
    # ~7.4M parameters
    "gpt-small": dict(kind="gpt", vocab_size=4096, n_layer=8, n_head=8, n_embd=256, block_size=512),
    # ~1.3M parameters
    "qwen-demo": dict(
        kind="qwen", vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True,
    ),
    # ~7.3M parameters
    "qwen-small": dict(
        kind="qwen", vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=True,
    ),
}  # fmt: skip

_KINDS: dict[str, tuple[type[nn.Module], type]] = {"gpt": (GPT, GPTConfig), "qwen": (Qwen, QwenConfig)}


def build_model(kind: str, **cfg: Any) -> nn.Module:
    """Build a model by kind (``"gpt"``, ``"qwen"``) or preset name; ``cfg`` sets/overrides config fields.

    Example: ``build_model("gpt-demo", vocab_size=65)`` or ``build_model("gpt", vocab_size=65, ...)``.
    """
    if kind in PRESETS:
        preset = dict(PRESETS[kind])
        kind = preset.pop("kind")
        cfg = {**preset, **cfg}
    if kind not in _KINDS:
        raise ValueError(
            f"unknown model kind {kind!r}; choose one of {sorted(_KINDS)} or a preset {sorted(PRESETS)}"
        )
    model_cls, config_cls = _KINDS[kind]
    try:
        config = config_cls(**cfg)
    except TypeError as e:
        fields = sorted(config_cls.__dataclass_fields__)
        raise ValueError(f"bad config for {kind!r}: {e}; valid fields: {fields}") from e
    return model_cls(config)
