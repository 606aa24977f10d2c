"""Load and save Hugging Face checkpoints (local directories only) for ``GPT`` and ``Qwen``.

Why this file exists: fine-tuning starts from published weights, and exporting lets Hugging Face
tools read what we trained. A checkpoint directory holds ``config.json`` and either one
``*.safetensors`` file or ``model.safetensors.index.json`` with its shards. Supported
``model_type``: ``gpt2``, ``qwen2``, ``qwen3``, ``llama`` (Llama 3, ``llama3`` RoPE scaling) and
``mistral`` (sliding window); the last two are ``llama.Llama`` models. Nothing is ever
downloaded. A vocabulary padded for tensor parallelism (``Decoder.resize_vocab``) is written
back at its own size with ``save_hf_checkpoint(model, path, vocab_size=...)``.

Name mapping (ours <- Hugging Face):

* gpt2: ``tok_emb``/``pos_emb`` <- ``wte``/``wpe``; the fused ``layers.i.attn.qkv`` <-
  ``h.i.attn.c_attn`` (a Conv1D, weight ``[in, out]``, hence transposed); ``attn.out`` <-
  ``attn.c_proj``; ``mlp.up``/``mlp.down`` <- ``mlp.c_fc``/``mlp.c_proj``; ``attn_norm``,
  ``mlp_norm``, ``norm`` <- ``ln_1``, ``ln_2``, ``ln_f``.
* qwen2/qwen3/llama/mistral: ``tok_emb`` <- ``embed_tokens``; the fused ``attn.qkv`` <-
  ``self_attn.{q,k,v}_proj`` stacked on output features (unstacked on export); ``attn.out`` <-
  ``self_attn.o_proj``;
  ``attn.{q,k}_norm`` <- ``self_attn.{q,k}_norm``; the fused ``mlp.gate_up`` <-
  ``mlp.{gate,up}_proj`` stacked; ``mlp.down`` <- ``mlp.down_proj``;
  ``attn_norm``/``mlp_norm`` <- ``input_layernorm``/``post_attention_layernorm``.

Loaded weights are fp32 whatever the file stores (call ``model.to(dtype)`` afterwards if needed),
and dropout is 0 (GPT-2's ``*_pdrop`` are not read: dropout under tensor parallelism needs
coordinated random states, so it is opt-in via ``GPTConfig.dropout``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taco.models.gpt import GPT, GPTConfig
from taco.models.llama import MODEL_TYPES as LLAMA_TYPES
from taco.models.llama import Llama, LlamaConfig, llama_config, llama_config_json
from taco.models.qwen import Qwen, QwenConfig

Tensors = dict[str, torch.Tensor]

# Per-layer renames, ours -> Hugging Face. GPT-2 linears (Conv1D) are transposed on the way.
_GPT2_LAYER = {
    "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
    "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
    "attn.out.weight": "attn.c_proj.weight", "attn.out.bias": "attn.c_proj.bias",
    "mlp_norm.weight": "ln_2.weight", "mlp_norm.bias": "ln_2.bias",
    "mlp.up.weight": "mlp.c_fc.weight", "mlp.up.bias": "mlp.c_fc.bias",
    "mlp.down.weight": "mlp.c_proj.weight", "mlp.down.bias": "mlp.c_proj.bias",
}  # fmt: skip
_GPT2_TOP = {
    "tok_emb.weight": "wte.weight",
    "pos_emb.weight": "wpe.weight",
    "norm.weight": "ln_f.weight",
    "norm.bias": "ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}
_QWEN_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.out.weight": "self_attn.o_proj.weight", "attn.out.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}  # fmt: skip
# Fused projections, ours -> the Hugging Face tensors stacked in it (on output features, in order).
_QWEN_FUSED = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
}
_QWEN_PART = {f"{hf}.{p}": (f"{ours}.{p}", i) for ours, hfs in _QWEN_FUSED.items()
              for i, hf in enumerate(hfs) for p in ("weight", "bias")}  # fmt: skip
_QWEN_TOP = {
    "tok_emb.weight": "embed_tokens.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_MODEL_TYPES = ("gpt2", "qwen2", "qwen3", *LLAMA_TYPES)
# Buffers some checkpoints carry that are not parameters (causal masks, RoPE tables).
_IGNORED = re.compile(r"(^|\.)(attn\.bias|attn\.masked_bias|rotary_emb\.inv_freq)$")
_CONV1D = re.compile(r"(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")


def _gpt_config(hf: dict[str, Any]) -> GPTConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"gpt2 activation_function={act!r} is not supported (only gelu_new)")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise ValueError(f"gpt2 n_inner={hf['n_inner']} is not supported (only 4 * n_embd)")
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        block_size=hf.get("n_positions", 1024),
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def _qwen_config(hf: dict[str, Any]) -> QwenConfig:
    qwen3 = hf["model_type"] == "qwen3"
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{hf['model_type']} rope_type={rope_type!r} is not supported (only default RoPE)")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{hf['model_type']} use_sliding_window=true is not supported")
    bias = hf.get("attention_bias", False) if qwen3 else True
    return QwenConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf.get("num_key_value_heads"),
        head_dim=hf.get("head_dim", 128 if qwen3 else None),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        attention_bias=bias, attention_out_bias=qwen3 and bias, qk_norm=qwen3,
    )  # fmt: skip


def _names(model_type: str) -> tuple[str, str, dict[str, str], dict[str, str]]:
    """(prefix, layer list name, top-level renames, per-layer renames) for a model type."""
    if model_type == "gpt2":
        return "transformer.", "h", _GPT2_TOP, _GPT2_LAYER
    return "model.", "layers", _QWEN_TOP, _QWEN_LAYER


def _to_ours(model_type: str, hf: Tensors) -> tuple[Tensors, dict[str, str], list[str]]:
    """Rename (and transpose/split) Hugging Face tensors; return ours, their sources, unknown names."""
    gpt = model_type == "gpt2"
    prefix, _, top, layer = _names(model_type)
    inv_top = {v: k for k, v in top.items()}
    inv_layer = {v: k for k, v in layer.items()}
    ours: Tensors = {}
    source: dict[str, str] = {}
    unknown: list[str] = []
    stacks: dict[str, dict[int, torch.Tensor]] = {}  # fused key -> its parts by position
    for name, t in hf.items():
        short = name.removeprefix(prefix)
        if _IGNORED.search(short):
            continue
        m = re.fullmatch(r"(?:h|layers)\.(\d+)\.(.+)", short)
        if m and not gpt and m[2] in _QWEN_PART:  # one block of a fused projection
            fused, i = _QWEN_PART[m[2]]
            key = f"layers.{m[1]}.{fused}"
            stacks.setdefault(key, {})[i] = t
            source[key] = name
            continue
        key = f"layers.{m[1]}.{inv_layer[m[2]]}" if m and m[2] in inv_layer else inv_top.get(short)
        if key is None:
            unknown.append(name)
            continue
        ours[key] = t.t() if gpt and _CONV1D.search(short) else t
        source[key] = name
    for key, parts in stacks.items():
        want = len(_QWEN_FUSED[key.split(".", 2)[2].rsplit(".", 1)[0]])
        if len(parts) != want:  # a block is missing: report the fused name as missing
            source.pop(key)
            continue
        ours[key] = torch.cat([parts[i] for i in range(want)], dim=0)
    return ours, source, unknown


def _gpt2_config_json(cfg: GPTConfig, tied: bool) -> dict[str, Any]:
    if not cfg.bias:
        raise ValueError("gpt2 checkpoints always have biases; cannot export a GPT with bias=False")
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
        "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.layer_norm_eps,
        "tie_word_embeddings": tied, "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
    }  # fmt: skip


def _qwen_config_json(cfg: QwenConfig, tied: bool) -> dict[str, Any]:
    qwen3 = cfg.qk_norm
    if (qwen3 and cfg.attention_bias != cfg.attention_out_bias) or (
        not qwen3 and (not cfg.attention_bias or cfg.attention_out_bias)
    ):
        raise ValueError(
            "this Qwen bias layout has no Hugging Face equivalent "
            "(qwen2: biases on q, k, v only; qwen3: on all four attention projections or none)"
        )
    return {
        "model_type": "qwen3" if qwen3 else "qwen2",
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "Qwen2ForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": tied,
        "attention_bias": cfg.attention_bias, "use_sliding_window": False,
    }  # fmt: skip


def _from_ours(model: nn.Module, vocab_size: int | None = None) -> tuple[dict[str, Any], Tensors]:
    """Hugging Face ``config.json`` content and tensors for ``model`` (its first ``vocab_size`` tokens)."""
    tied = model.lm_head.weight is model.tok_emb.weight
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if tied:
        del state["lm_head.weight"]  # Hugging Face re-ties it from tie_word_embeddings
    rows = model.tok_emb.weight.shape[0]
    vocab = rows if vocab_size is None else vocab_size
    if not 0 < vocab <= rows:
        raise ValueError(f"vocab_size = {vocab_size}: the model has {rows} token rows; give 1..{rows}")
    for key in ("tok_emb.weight", "lm_head.weight"):
        if key in state:
            state[key] = state[key][:vocab]  # strip a padded vocabulary
    if isinstance(model, GPT):
        hf_cfg = _gpt2_config_json(model.config, tied)
    elif isinstance(model.config, LlamaConfig):
        hf_cfg = llama_config_json(model.config, tied)
    elif isinstance(model, Qwen):
        hf_cfg = _qwen_config_json(model.config, tied)
    else:
        raise TypeError(
            f"cannot export {type(model).__name__}: only GPT, Qwen and Llama models are supported"
        )
    hf_cfg["vocab_size"] = vocab
    gpt = hf_cfg["model_type"] == "gpt2"
    prefix, layers, top, layer = _names(hf_cfg["model_type"])
    out: Tensors = {}
    for key in state:
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        fused = m[2].rsplit(".", 1)[0] if m else ""
        if m and not gpt and fused in _QWEN_FUSED:  # unstack q/k/v (gate/up) by the blocks' widths
            widths = list(model.get_submodule(f"layers.{m[1]}.{fused}").fused_parts)
            kind = m[2].rsplit(".", 1)[1]
            for hf, part in zip(_QWEN_FUSED[fused], state[key].split(widths, dim=0)):
                out[f"{prefix}{layers}.{m[1]}.{hf}.{kind}"] = part
        elif m:
            hf_name = f"{prefix}{layers}.{m[1]}.{layer[m[2]]}"
            out[hf_name] = state[key].t() if gpt and _CONV1D.search(hf_name) else state[key]
        else:
            out[top[key] if key == "lm_head.weight" else prefix + top[key]] = state[key]
    return hf_cfg, {k: v.contiguous().clone() for k, v in out.items()}


def _read_tensors(path: Path) -> Tensors:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing[:3]}")
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path} (.bin checkpoints are not supported)")
    tensors: Tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def read_hf_config(path: str | Path) -> tuple[str, GPTConfig | QwenConfig | LlamaConfig]:
    """``(model_type, config)`` of a local Hugging Face checkpoint directory, from its ``config.json``.

    Raises ``FileNotFoundError`` for a missing directory or file and ``ValueError`` for an unsupported
    ``model_type`` or architecture.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist (nothing is downloaded)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; is it a Hugging Face checkpoint directory?")
    hf_cfg = json.loads((path / "config.json").read_text())
    model_type = hf_cfg.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {path / 'config.json'}; supported: "
            + ", ".join(_MODEL_TYPES)
        )
    try:
        if model_type in LLAMA_TYPES:
            return model_type, llama_config(hf_cfg)
        return model_type, _gpt_config(hf_cfg) if model_type == "gpt2" else _qwen_config(hf_cfg)
    except KeyError as e:
        raise ValueError(f"{path / 'config.json'} lacks the field {e} that {model_type} needs") from None


def load_hf_checkpoint(
    path: str | Path, model_cls: type[nn.Module] | None = None
) -> tuple[nn.Module, GPTConfig | QwenConfig | LlamaConfig]:
    """Build a model from a local Hugging Face checkpoint directory; return ``(model, config)``.

    ``model_cls`` replaces the default class (``GPT``, ``Qwen`` or ``Llama``); it is called with the config.
    Raises ``FileNotFoundError`` for a missing directory/file and ``ValueError`` for an unsupported
    ``model_type``, missing or unexpected tensors, or shape mismatches.
    """
    path = Path(path)
    model_type, config = read_hf_config(path)
    default_cls = GPT if model_type == "gpt2" else Llama if model_type in LLAMA_TYPES else Qwen
    model = (model_cls or default_cls)(config)
    expected = model.state_dict()
    ours, source, unknown = _to_ours(model_type, _read_tensors(path))
    tied = model.lm_head.weight is model.tok_emb.weight
    if tied:
        ours.pop("lm_head.weight", None)
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    unexpected = unknown + [source[k] for k in ours if k not in expected]
    missing = [k for k in expected if k not in ours]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match {type(model).__name__}: missing {len(missing)} "
            f"{missing[:5]}, unexpected {len(unexpected)} {unexpected[:5]}"
        )
    bad = [
        f"{source[k]} {tuple(t.shape)} vs {k} {tuple(expected[k].shape)}"
        for k, t in ours.items()
        if t.shape != expected[k].shape
    ]
    if bad:
        raise ValueError(f"shape mismatch in {path}: {bad[:5]}")
    with torch.no_grad():
        for k, t in ours.items():
            expected[k].copy_(t)
    return model, config


def save_hf_checkpoint(model: nn.Module, path: str | Path, vocab_size: int | None = None) -> Path:
    """Write ``model`` as a Hugging Face checkpoint (``config.json`` + ``model.safetensors``).

    ``vocab_size``: write only the first ``vocab_size`` token rows of ``tok_emb``/``lm_head`` and
    declare that vocabulary (strips the padding of a vocabulary padded for tensor parallelism, so
    transformers reloads the original shape); None = every row.
    """
    from safetensors.torch import save_file

    hf_cfg, tensors = _from_ours(model, vocab_size)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_cfg["torch_dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    save_file(
        {k: v.cpu() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    return path
