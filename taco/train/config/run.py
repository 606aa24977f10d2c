"""`Config`, a whole run: the five sections, checked against each other, built from a nested dict.

Why this file exists: a section checks only itself (schema.py); whether the sections fit together
(the batch splits over dp and micro-batches, the heads and widths split over tp, a pipeline stage
gets at least one layer) is a property of the run. This is also where a raw {section: {key: value}}
table becomes a `Config`: aliases resolved (`block_size` -> `seq_len`), unknown keys rejected with
the valid ones, `model.preset` expanded under the explicit keys.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any

from taco.models.presets import PRESETS
from taco.train.config.choices import DatasetKind
from taco.train.config.compression import CompressionConfig
from taco.train.config.parallel import ParallelConfig
from taco.train.config.schema import DataConfig, ModelConfig, TrainConfig, _Section

_SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "compression": CompressionConfig,
    "train": TrainConfig,
    "data": DataConfig,
}
_ALIASES: dict[str, dict[str, str]] = {
    "model": {"block_size": "seq_len"},
    "train": {"checkpoint_every": "checkpoint_interval"},
}


@dataclass
class Config:
    """A whole run: the five sections, checked against each other."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": "[model] section."})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"doc": "[parallel] section."})
    compression: CompressionConfig = field(
        default_factory=CompressionConfig, metadata={"doc": "[compression] section."}
    )
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": "[train] section."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"doc": "[data] section."})

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                got = type(getattr(self, name)).__name__
                raise TypeError(f"Config.{name} must be a {cls.__name__}, got {got}")
        m, p, t = self.model, self.parallel, self.train
        if t.batch_size % (p.dp * p.microbatches):
            raise ValueError(
                f"train.batch_size = {t.batch_size} must be divisible by parallel.dp * "
                f"parallel.microbatches = {p.dp * p.microbatches}"
            )
        if p.dp_shard and self.compression.dp_codec != "none":
            raise ValueError(
                "compression.dp_codec compresses DDP's all-reduce; with parallel.dp_shard = true use "
                'compression.dp_weight_codec / dp_grad_codec and set compression.dp_codec = "none"'
            )
        if p.splits_batch:
            if self.micro_batch_size % p.tp_overlap_chunks:
                raise ValueError(
                    f"parallel.tp_overlap_chunks = {p.tp_overlap_chunks} must divide the micro-batch "
                    f"size ({self.micro_batch_size} sequences = train.batch_size / (parallel.dp * "
                    "parallel.microbatches))"
                )
            if t.compile:
                raise ValueError(
                    f'parallel.tp_overlap = "{p.tp_overlap.value}" does not run with train.compile yet: set '
                    'parallel.tp_overlap = "none" for that'
                )
        if p.tp_overlap.value == "chunked" and (not p.sp or p.tp < 2 or t.compile):
            raise ValueError(
                'parallel.tp_overlap = "chunked" splits the sequence-parallel all-gather and '
                "reduce-scatter into rings: it needs parallel.sp = true and parallel.tp >= 2, and does "
                'not run with train.compile; set parallel.tp_overlap = "none" (or "batch-split")'
            )
        from taco.models.plans import check_tp_divisible

        split = {"model.n_head": m.n_head, "model.n_kv_head": m.kv_heads, "model.intermediate": m.ffn_size}
        if p.sp:
            split["model.seq_len"] = m.seq_len  # sequence parallelism splits the sequence
        check_tp_divisible(split, p.tp, "parallel.tp")
        if m.n_layer < p.pp:
            raise ValueError(
                f"model.n_layer = {m.n_layer} must be >= parallel.pp = {p.pp} "
                "(at least one layer per pipeline stage)"
            )
        trained_bpe = self.data.dataset != DatasetKind.TOKENS and not self.data.tokenizer
        if m.vocab_size and trained_bpe and not m.init_from and m.vocab_size < self.data.vocab_size:
            raise ValueError(
                f"model.vocab_size = {m.vocab_size} is smaller than the tokenizer's "
                f"data.vocab_size = {self.data.vocab_size}: set model.vocab_size = 0 "
                "to follow the tokenizer"
            )

    @property
    def local_batch_size(self) -> int:
        """Sequences per step on one data-parallel rank."""
        return self.train.batch_size // self.parallel.dp

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch on one data-parallel rank."""
        return self.local_batch_size // self.parallel.microbatches

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dict {section: {key: value}} (enums as strings)."""
        return {name: getattr(self, name).to_dict() for name in _SECTIONS}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Config:
        """Build and validate from {section: {key: value}}; unknown sections or keys raise ValueError."""
        if not isinstance(raw, dict):
            raise ValueError(f"a config must be a table of sections, got {type(raw).__name__}")
        unknown = [k for k in raw if k not in _SECTIONS]
        if unknown:
            raise ValueError(
                f"unknown config section(s) {unknown}; valid sections: {', '.join(_SECTIONS)}"
                " (top-level keys must go inside a [section])"
            )
        sections = {}
        for name, section_cls in _SECTIONS.items():
            values = raw.get(name, {})
            if not isinstance(values, dict):
                raise ValueError(f"[{name}] must be a table of keys, got {values!r}")
            values = _resolve_keys(name, values)
            if name == "model":
                values = _apply_preset(values)
            sections[name] = section_cls(**values)
        return cls(**sections)


def _valid_keys(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(_SECTIONS[section])]


def _resolve_keys(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """Map aliases to field names and reject unknown keys with the list of valid ones."""
    valid = _valid_keys(section)
    aliases = _ALIASES.get(section, {})
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = aliases.get(key, key)
        if name not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {section}.{close[0]}?)" if close else ""
            raise ValueError(
                f"unknown key {section}.{key}{hint}; valid keys of [{section}]: {', '.join(valid)}"
            )
        if name in out:
            raise ValueError(f"{section}.{name} is given twice (once as {key!r}); keep one")
        out[name] = value
    return out


def _apply_preset(values: dict[str, Any]) -> dict[str, Any]:
    """Preset values first (taco.models.PRESETS), then the explicit keys of the [model] table on top."""
    preset = values.get("preset", "")
    if not preset:
        return values
    if preset not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"model.preset = {preset!r}: unknown preset; known presets: {known}")
    base = dict(PRESETS[preset])
    if "kind" in values and str(values["kind"]).lower() != base["kind"]:
        raise ValueError(
            f"model.kind = {values['kind']!r} contradicts model.preset = {preset!r} "
            f"(a {base['kind']} preset): drop one of them"
        )
    base.update(values)
    return base
