"""Llama 3 and Mistral: the Qwen decoder without biases, with Llama 3's RoPE scaling or
Mistral's sliding-window attention.

Why this file exists: most fine-tuning starts from Llama 3 or Mistral checkpoints. Their blocks
are the ones of ``qwen.py`` (RMSNorm, RoPE with ``rotate_half``, grouped-query attention,
SwiGLU, fused ``qkv`` and ``gate_up``), so ``Llama`` is a ``Qwen`` whose config says which
Hugging Face family it is (``model_type``: ``"llama"`` or ``"mistral"``), has no biases by
default (Llama's ``attention_bias`` puts one on all four attention projections), and carries
``rope_scaling`` (``"llama3"``) and ``sliding_window``. The tensor-parallel plan, the sites
(``layers.{i}.attn.qkv`` ...) and the pipeline cut are Qwen's. This module also translates the
Hugging Face ``config.json`` both ways (``hf.py`` moves the tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from taco.models.qwen import Qwen, QwenConfig

MODEL_TYPES = ("llama", "mistral")


@dataclass
class LlamaConfig(QwenConfig):
    """A ``QwenConfig`` for the Llama 3 / Mistral families (biases off unless asked for)."""

    model_type: str = "llama"
    """Hugging Face family written on export: ``"llama"`` or ``"mistral"``."""

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"LlamaConfig: model_type={self.model_type!r}; choose one of {MODEL_TYPES}")
        if self.attention_bias is None:
            self.attention_bias = False
        if self.qk_norm:
            raise ValueError("LlamaConfig: Llama and Mistral have no q/k norm (qk_norm must be false)")
        super().__post_init__()


class Llama(Qwen):
    """Llama 3 / Mistral language model (``Qwen``'s blocks, ``LlamaConfig``'s options)."""

    config: LlamaConfig


def llama_config(hf: dict[str, Any]) -> LlamaConfig:
    """``LlamaConfig`` of a Hugging Face llama/mistral ``config.json`` (ValueError if unsupported)."""
    kind = hf["model_type"]
    if hf.get("mlp_bias"):
        raise ValueError(f"{kind} mlp_bias=true is not supported")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{kind} hidden_act={act!r} is not supported (only silu)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"{kind} rope_type={rope_type!r} is not supported (default or llama3)")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 500000.0 if kind == "llama" else 10000.0)))
    scaling = None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = {"rope_type": "llama3", **{k: rope[k] for k in keys}}
    bias = bool(hf.get("attention_bias", False)) if kind == "llama" else False
    heads = hf["num_attention_heads"]
    return LlamaConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or None, rope_theta=theta, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
        tie_word_embeddings=hf.get("tie_word_embeddings", False), attention_bias=bias,
        attention_out_bias=bias, rope_scaling=scaling,
        sliding_window=hf.get("sliding_window") if kind == "mistral" else None, model_type=kind,
    )  # fmt: skip


def llama_config_json(cfg: LlamaConfig, tied: bool) -> dict[str, Any]:
    """The Hugging Face ``config.json`` content of ``cfg`` (``vocab_size`` set by the caller)."""
    if cfg.attention_bias != cfg.attention_out_bias or (cfg.attention_bias and cfg.model_type == "mistral"):
        raise ValueError(
            "this bias layout has no Hugging Face equivalent (llama: on all four attention "
            "projections or none; mistral: none)"
        )
    if cfg.sliding_window is not None and cfg.model_type != "mistral":
        raise ValueError("sliding_window is a Mistral option: set model_type='mistral'")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    out = {
        "model_type": cfg.model_type,
        "architectures": ["LlamaForCausalLM" if cfg.model_type == "llama" else "MistralForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": tied,
    }  # fmt: skip
    if cfg.model_type == "llama":
        out.update(attention_bias=cfg.attention_bias, mlp_bias=False)
    else:
        out["sliding_window"] = cfg.sliding_window
    return out
