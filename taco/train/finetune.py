"""Fine-tuning a local Hugging Face checkpoint: the run's config made to describe `model.init_from`.

Why this file exists: a checkpoint fixes the architecture (kind, depth, widths, heads, norms,
positions, vocabulary) and comes with its tokenizer; the config's own sizes are only defaults the
checkpoint replaces. `resolve_init_from(cfg)` does that before any rank starts: it reads the
checkpoint's config.json, writes its sizes into `[model]` (so `config.toml` in the run folder is
the model that ran, and a size the checkpoint cannot split over `parallel.tp` fails at start-up
with the usual message), points `data.tokenizer` at the checkpoint's tokenizer.json when there is
one, and returns one line per change, which `taco train` prints. Nothing is silently overridden.

The vocabulary is the checkpoint's (`model.vocab_size`); the trainer pads it to a multiple of
128 * tp for the vocab-parallel embedding and head and masks the padded logits out of the loss
(`taco.train.build.model_vocab`); `taco export` writes the trained model back at this size.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from taco.train.config import Config, DatasetKind, ModelConfig

__all__ = ["checkpoint_sizes", "resolve_init_from"]


def checkpoint_sizes(path: str | Path) -> dict[str, Any]:
    """The `[model]` values (kind and sizes) of a local gpt2/qwen2/qwen3 checkpoint directory.

    ValueError for a checkpoint the `[model]` section cannot describe (a Qwen3 with attention
    biases: the section has no key for them).
    """
    from taco.models import GPTConfig, read_hf_config

    model_type, c = read_hf_config(path)
    if isinstance(c, GPTConfig):
        return dict(
            kind="gpt", vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head, n_kv_head=0,
            hidden=c.n_embd, head_dim=0, intermediate=0, tie_embeddings=c.tie_embeddings, qk_norm=False,
            norm_eps=c.layer_norm_eps, max_positions=c.block_size,
        )  # fmt: skip
    from taco.models import LlamaConfig

    llama = isinstance(c, LlamaConfig)
    if llama and c.attention_bias:
        raise ValueError(f"{path}: a {model_type} with attention_bias=true cannot be fine-tuned here")
    if not llama and (c.attention_bias != (not c.qk_norm) or c.attention_out_bias):
        raise ValueError(
            f"{path}: a {model_type} with attention_bias={c.attention_bias} cannot be fine-tuned here "
            "([model] has no attention-bias key: qwen2 has q/k/v biases, qwen3 none)"
        )
    return dict(
        kind="llama" if llama else "qwen", vocab_size=c.vocab_size, n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads,
        n_kv_head=c.num_key_value_heads, hidden=c.hidden_size, head_dim=c.head_dim,
        intermediate=c.intermediate_size, tie_embeddings=c.tie_word_embeddings, qk_norm=c.qk_norm,
        rope_theta=c.rope_theta, norm_eps=c.rms_norm_eps, max_positions=c.max_position_embeddings,
    )  # fmt: skip


_DERIVED = ("n_kv_head", "head_dim", "intermediate", "max_positions")


def _effective(m: ModelConfig) -> dict[str, Any]:
    """The values of `m` with its automatic zeros resolved (so 0 and its meaning compare equal)."""
    return {
        **m.to_dict(),
        "n_kv_head": m.kv_heads,
        "head_dim": m.head_size,
        "intermediate": m.ffn_size,
        "max_positions": m.max_positions or m.seq_len,
    }


def resolve_init_from(cfg: Config) -> list[str]:
    """Make `cfg` (in place) describe the checkpoint `model.init_from`; return what changed, one
    line each. A no-op returning [] without `init_from`; idempotent. Raises FileNotFoundError or
    ValueError (a missing or unsupported checkpoint, or sizes the mesh cannot split)."""
    from taco.train.build import VOCAB_MULTIPLE, padded_vocab

    m = cfg.model
    if not m.init_from:
        return []
    src = Path(m.init_from).expanduser()
    sizes = checkpoint_sizes(src)
    values = {**m.to_dict(), **sizes, "preset": ""}
    model = ModelConfig(**values)
    old, new = _effective(m), _effective(model)
    changed = [  # a derived size the checkpoint leaves automatic (0) follows the others silently
        f"{k}={new[k]} (config: {old[k]})"
        for k in values
        if k != "preset" and old[k] != new[k] and (sizes.get(k) != 0 or k not in _DERIVED)
    ]
    notes = []
    if changed:
        notes.append(f"model.init_from={src}: the checkpoint sets model." + ", model.".join(changed))
    if m.preset:
        notes.append(f"model.preset={m.preset!r} dropped: the checkpoint decides the sizes")
    data = cfg.data
    if not data.tokenizer and data.dataset != DatasetKind.TOKENS:
        if (src / "tokenizer.json").is_file():
            data = dataclasses.replace(data, tokenizer=str(src))
            notes.append(f"data.tokenizer={src}: the data is tokenized with the checkpoint's tokenizer.json")
        else:
            notes.append(
                f"warning: {src} has no tokenizer.json, so the data gets a new BPE whose token ids mean "
                "nothing to the checkpoint's embeddings; give the checkpoint's tokenizer with "
                "--data.tokenizer=DIR (a directory holding its tokenizer.json)"
            )
    resolved = Config(  # the sections checked against each other again (tp divisibility, pp depth)
        model=model, parallel=cfg.parallel, compression=cfg.compression, train=cfg.train, data=data
    )
    cfg.model, cfg.data = resolved.model, resolved.data
    multiple = VOCAB_MULTIPLE * cfg.parallel.tp
    padded = padded_vocab(model.vocab_size, multiple)
    if padded != model.vocab_size:
        notes.append(
            f"vocabulary {model.vocab_size} padded to {padded} (a multiple of {VOCAB_MULTIPLE} x "
            f"parallel.tp = {multiple}); the padded logits are masked out of the loss and "
            "`taco export` strips them"
        )
    return notes
