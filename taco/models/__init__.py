"""Models TACO-TP trains: plain ``nn.Module``s, their tensor-parallel plans, and HF checkpoint I/O.

Why this package exists: the trainer and the tensor-parallel layers need a few small, readable
decoders (GPT-2 and Qwen2/Qwen3 style) whose parameter names are stable; distribution is applied
from outside through ``plans.tp_plan``. ``build_model`` makes one by kind or preset name
(``presets.PRESETS``), through ``model_config``, the one translation from the neutral size names
of the presets and of the ``[model]`` config section to ``GPTConfig``/``QwenConfig``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from taco.models.gpt import GPT, GPTConfig
from taco.models.hf import load_hf_checkpoint, read_hf_config, save_hf_checkpoint
from taco.models.llama import Llama, LlamaConfig
from taco.models.plans import check_tp_size, resolve_plan, sites, tp_plan
from taco.models.presets import PRESETS, SIZE_DEFAULTS, SIZE_KEYS, ffn_size
from taco.models.qwen import Qwen, QwenConfig

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "Qwen",
    "QwenConfig",
    "build_model",
    "check_tp_size",
    "load_hf_checkpoint",
    "model_config",
    "read_hf_config",
    "resolve_plan",
    "save_hf_checkpoint",
    "sites",
    "tp_plan",
]

_KINDS: dict[str, tuple[type[nn.Module], type]] = {
    "gpt": (GPT, GPTConfig),
    "qwen": (Qwen, QwenConfig),
    "llama": (Llama, LlamaConfig),
}


def model_config(kind: str, **sizes: Any) -> GPTConfig | QwenConfig:
    """Translate neutral sizes (the names of ``PRESETS`` and of the ``[model]`` config section) into the
    config of the model class of ``kind``; omitted sizes take ``SIZE_DEFAULTS``, ``vocab_size`` is required.

    The one place that knows ``hidden`` is GPT's ``n_embd`` and Qwen's ``hidden_size``, and so on.
    Values a class cannot honour raise ``ValueError`` instead of being dropped.
    """
    if kind not in _KINDS:
        raise ValueError(
            f"unknown model kind {kind!r}; choose one of {sorted(_KINDS)} or a preset {sorted(PRESETS)}"
        )
    unknown = sorted(set(sizes) - set(SIZE_KEYS))
    if unknown:
        raise ValueError(
            f"bad config for {kind!r}: unknown field(s) {unknown}; valid fields: {list(SIZE_KEYS)}"
        )
    s = {**SIZE_DEFAULTS, **sizes}
    if not s["vocab_size"]:
        raise ValueError(f"{kind} model needs vocab_size > 0 (0 = the tokenizer's: pass that number)")
    if s["n_head"] < 1:
        raise ValueError(f"n_head must be >= 1, got {s['n_head']}")
    positions = s["max_positions"] or s["seq_len"]  # GPT's position table, Qwen's declared context
    if kind == "gpt":
        fixed = dict(n_kv_head=s["n_head"], head_dim=s["hidden"] // s["n_head"], intermediate=4 * s["hidden"])
        for name, only in fixed.items():  # GPT-2's shapes follow from hidden and n_head alone
            if s[name] not in (0, only):
                raise ValueError(f"gpt takes only {name} = 0 or {only} here, got {s[name]}")
        if s["qk_norm"]:
            raise ValueError("gpt has no q/k norm: qk_norm must be false")
        # rope_theta does not apply: GPT has learned positions
        return GPTConfig(
            vocab_size=s["vocab_size"], n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["hidden"],
            block_size=positions, dropout=s["dropout"], tie_embeddings=s["tie_embeddings"],
            layer_norm_eps=s["norm_eps"],
        )  # fmt: skip
    if s["dropout"]:
        raise ValueError(f"{kind} has no dropout: dropout must be 0, got {s['dropout']}")
    return _KINDS[kind][1](
        vocab_size=s["vocab_size"], hidden_size=s["hidden"],
        intermediate_size=ffn_size(kind, s["hidden"], s["intermediate"]), num_hidden_layers=s["n_layer"],
        num_attention_heads=s["n_head"], num_key_value_heads=s["n_kv_head"] or s["n_head"],
        head_dim=s["head_dim"] or None, rope_theta=s["rope_theta"], rms_norm_eps=s["norm_eps"],
        max_position_embeddings=positions, tie_word_embeddings=s["tie_embeddings"], qk_norm=s["qk_norm"],
    )  # fmt: skip


def build_model(name_or_kind: str, **sizes: Any) -> nn.Module:
    """Build a model by preset name or kind (``"gpt"``, ``"qwen"``); ``sizes`` (neutral names, see
    ``model_config``) override the preset's.

    Example: ``build_model("gpt-demo", vocab_size=65)`` or ``build_model("gpt", vocab_size=65, n_layer=2)``.
    """
    kind = name_or_kind
    if name_or_kind in PRESETS:
        preset = dict(PRESETS[name_or_kind])
        kind = preset.pop("kind")
        if sizes.get("kind", kind) != kind:
            raise ValueError(f"kind={sizes['kind']!r} contradicts preset {name_or_kind!r} (a {kind} preset)")
        sizes = {**preset, **sizes}
    sizes.pop("kind", None)
    config = model_config(kind, **sizes)
    return _KINDS[kind][0](config)
