"""How a run is built: `build_run`, top to bottom, and the pieces it is built from.

Why this file exists: a reader following a run finds its construction in one place, in order
(picotron's train.py, torchtitan's parallelize_llama):

    data -> model -> TP/SP plan -> PP stage -> recompute, device, dtype -> DP/FSDP -> optimizer
         -> compression policy and its observers (the adaptive wing)

`build_run` does exactly that and returns a `taco.train.run.Run`; the pieces above it are pure
functions of the config (no loop state), shared with the benchmarks and tests that build one
piece of a run. The trainer, the cluster benchmark and the tests all build runs through
`build_run` (docs/design.md 2.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taco.codec import build_codec
from taco.comm import CommPolicy
from taco.parallel.dims import ParallelDims
from taco.parallel.parallelize import ParallelOptions, parallelize
from taco.train.adaptive import OverlapProbe, build_wing
from taco.train.adaptive.overlap import WARM_STEPS
from taco.train.config import Config
from taco.train.data import TokenDataset
from taco.train.perf import flops_per_token
from taco.train.run import AXES, Run

VOCAB_MULTIPLE = 128
"""Vocabularies are padded to a multiple of this (Megatron's make-vocab-size-divisible-by)."""


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """`vocab_size` rounded up to a multiple of `multiple`."""
    return -(-vocab_size // multiple) * multiple


def model_vocab(cfg: Config, data_vocab: int) -> tuple[int, int | None]:
    """(rows of the model's embedding and head, the real vocabulary the loss masks to or None).

    Random init: `model.vocab_size`, or 0 = the data's tokenizer padded to a multiple of 128 (the
    padded rows are part of the model, never targets, and learn to stay low; the model is the same
    for every tp); an explicit `model.vocab_size` that tp does not divide (GPT-2's 50257) is padded
    to a multiple of 128 * tp and masked as a checkpoint's. `model.init_from`: the checkpoint's
    vocabulary padded to a multiple of 128 * tp, the padded logits masked out of the loss, so
    training is exactly the unpadded model's.
    """
    m = cfg.model
    if not m.init_from:
        tp = cfg.parallel.tp
        if m.vocab_size and m.vocab_size % tp:  # e.g. GPT-2's 50257 (a preset): padded as a checkpoint's
            return padded_vocab(m.vocab_size, VOCAB_MULTIPLE * tp), m.vocab_size
        return m.vocab_size or padded_vocab(data_vocab, VOCAB_MULTIPLE), None
    from taco.models import read_hf_config

    real = read_hf_config(m.init_from)[1].vocab_size
    if data_vocab > real:
        raise ValueError(
            f"the data's tokenizer has {data_vocab} tokens but the checkpoint model.init_from = "
            f"{m.init_from!r} has a vocabulary of {real}: tokenize with the checkpoint's tokenizer, "
            f"`taco data prepare --text PATH --tokenizer DIR` (DIR holding its tokenizer.json), "
            "or --data.tokenizer=DIR"
        )
    return padded_vocab(real, VOCAB_MULTIPLE * cfg.parallel.tp), real


def build_model(cfg: Config, vocab_size: int) -> nn.Module:
    """The full (unsharded) model of `cfg.model` with `vocab_size` token rows (`model_vocab`),
    initialised from `train.seed` or, padded with zero rows, from the HF checkpoint `model.init_from`."""
    from taco.models import build_model as build
    from taco.models import load_hf_checkpoint
    from taco.models.presets import SIZE_KEYS

    m = cfg.model
    if m.init_from:
        model, _ = load_hf_checkpoint(m.init_from)
        if vocab_size < model.tok_emb.num_embeddings:
            raise ValueError(
                f"vocab_size = {vocab_size} is smaller than the checkpoint's {model.tok_emb.num_embeddings}"
            )
        model.resize_vocab(vocab_size)
        return model
    torch.manual_seed(cfg.train.seed)
    sizes = {key: getattr(m, key) for key in SIZE_KEYS}  # the [model] names are the neutral size names
    return build(m.kind.value, **{**sizes, "vocab_size": vocab_size})


def tp_comm_dtype(cfg: Config) -> torch.dtype | None:
    """The dtype TP collectives send (`parallel.tp_comm_dtype`; "auto" follows `train.dtype`)."""
    name = cfg.parallel.tp_comm_dtype.value
    if name == "auto":
        name = cfg.train.dtype.value
    return {"input": None, "fp32": torch.float32, "bf16": torch.bfloat16}[name]


def build_policy(cfg: Config, axis: str = "tp") -> CommPolicy:
    """The communication policy of one axis ("tp", "pp" or "dp") from `[compression]`: the codec of
    `{axis}_codec` with `{axis}_codec_options` (`taco.codec.build_codec`; "none" keeps plain
    collectives and their statistics, its options, e.g. a config file's group_size kept for a
    baseline run, then ignored). TP compresses only the sites matching `tp_sites` (the first
    matching glob wins) and uses `tp_all_reduce`."""
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    c = cfg.compression
    codec = build_codec(getattr(c, f"{axis}_codec"), getattr(c, f"{axis}_codec_options"))
    overrides: dict = {}
    if axis == "tp" and "*" not in c.tp_sites:
        overrides = {**{g: codec for g in c.tp_sites}, "*": None}
    return CommPolicy(
        codec=codec, overrides=overrides, min_bytes=c.min_bytes, slices=c.slices,
        min_slice_bytes=c.min_slice_bytes, all_reduce_algo=c.tp_all_reduce if axis == "tp" else "auto",
        check_sizes=False,
    )  # fmt: skip


def train_dtype(cfg: Config) -> torch.dtype:
    """The compute dtype of `train.dtype`; pipeline activations and their gradients travel in it."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.train.dtype.value]


def parallel_options(cfg: Config, device: torch.device | str) -> ParallelOptions:
    """How `taco.parallel.parallelize` applies each parallelism, from `[parallel]`, `[train]` and
    the DP codecs of `[compression]`. bf16 with `train.mixed_precision = "master"`: the stage is cast
    to bf16 and the fp32 init kept for the masters; "autocast": each forward under bf16 autocast;
    FSDP2 (`parallel.dp_shard`) gathers bf16 weights and reduces fp32 gradients instead."""
    c, p, t = cfg.compression, cfg.parallel, cfg.train
    bf16, mp = t.dtype.value == "bf16", t.mixed_precision.value
    return ParallelOptions(
        device=device, comm_dtype=tp_comm_dtype(cfg), overlap_wgrad=p.overlap_tp_wgrad,
        recompute=t.recompute.value, compile=t.compile, master_bf16=bf16 and mp == "master",
        dp_shard=p.dp_shard, dp_codec=c.dp_codec, dp_codec_options=c.dp_codec_options,
        overlap_dp=p.overlap_dp,
        fsdp_codecs=dict(weight_codec=c.dp_weight_codec, grad_codec=c.dp_grad_codec,
                         grad_intra_codec=c.dp_grad_intra_codec or None),
        dp_ranks_per_node=p.dp_ranks_per_node,
        fsdp_dtypes=(torch.bfloat16, torch.float32) if bf16 else (None, None),
        schedule=p.pp_schedule.value, overlap_p2p=p.overlap_p2p, act_dtype=train_dtype(cfg),
        autocast=bf16 and mp == "autocast",
        tp_overlap_chunks=p.tp_overlap_chunks if p.splits_batch else 1,
        tp_chunked=p.tp_overlap.value == "chunked",
    )  # fmt: skip


def build_stage_optimizer(
    cfg: Config, stage: nn.Module, dp_group: Any, fp32_init: dict[int, torch.Tensor]
) -> Any:
    """AdamW (ZeRO with parallel.zero) over the stage, weight decay on matrices only; with fp32
    masters (`fp32_init` not empty) wrapped in `MasterWeightsOptimizer`, micro-batch gradients
    summed in fp32 where no DDP reducer owns them (no DP group)."""
    from taco.parallel import build_optimizer
    from taco.parallel.master_weights import MasterWeightsOptimizer

    t, p = cfg.train, cfg.parallel
    params = list(stage.parameters())
    groups = [
        {"params": [q for q in params if q.dim() >= 2], "weight_decay": t.weight_decay},
        {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0},
    ]

    def make(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return build_optimizer(groups, dp_group, p.zero, lr=t.lr, betas=(t.beta1, t.beta2))

    if not fp32_init:
        return make(groups)
    fp32_sum = p.microbatches > 1 and dp_group is None
    return MasterWeightsOptimizer(groups, make, accumulate_fp32=fp32_sum, init=fp32_init)


def overlap_probe(cfg: Config, stage: Any, device: torch.device, log: bool) -> OverlapProbe:
    """`parallel.tp_overlap = "auto"`: the probe that keeps the batch split only where it pays; it
    starts after the codec policy's own probe and check steps (`compression.when = "auto"`)."""
    c, p = cfg.compression, cfg.parallel
    start = WARM_STEPS + (c.auto_warmup_steps + c.auto_check_steps if c.when == "auto" else 0)

    def set_pieces(k: int) -> None:
        stage.pieces = k

    return OverlapProbe(
        set_pieces, p.tp_overlap_chunks, start=start, pairs=p.tp_overlap_probe_pairs, device=device, log=log
    )


def build_run(
    cfg: Config,
    dims: ParallelDims,
    data_dir: Path,
    *,
    device: torch.device | str = "cpu",
    log: bool = False,
    observers: Sequence[Any] = (),
) -> Run:
    """Build this rank's run of `cfg` on the built mesh `dims`, in order (module docstring).
    `log`: this rank prints and writes the run's files (rank 0); `observers`: extra observers of
    the TP policy after the config's own (e.g. `GradFidelity`). Collective: every rank calls it."""
    device, t, dtype = torch.device(device), cfg.train, train_dtype(cfg)
    train_ds = TokenDataset(data_dir, "train", cfg.model.seq_len, seed=t.seed)
    val_ds = TokenDataset(data_dir, "val", cfg.model.seq_len, seed=t.seed)
    # Megatron-style padding so the vocabulary shards evenly (build.model_vocab); a checkpoint's
    # padded logits are masked out of the loss (loss_vocab), so it trains as the unpadded model.
    vocab, loss_vocab = model_vocab(cfg, train_ds.vocab_size)
    policies = {a: build_policy(cfg, a) for a in AXES}
    full, m = build_model(cfg, vocab), cfg.model  # 1. the full model, the same on every rank
    fpt = flops_per_token(full, m.n_layer, m.n_head * m.head_size, m.seq_len)  # for MFU
    par = parallelize(full, dims, policies, parallel_options(cfg, device))  # 2.-6. TP, PP, DP, engine
    opt = build_stage_optimizer(cfg, par.stage, dims.group("dp"), par.fp32_init)  # 7. AdamW (ZeRO)
    wing = build_wing(  # 8. the TP policy's observers: calibration, auto policy, telemetry
        cfg, policies["tp"], tp_group=dims.group("tp"), device=device, log=log, extra=tuple(observers),
        decides=dims.dp_rank == 0 and dims.tp_rank == 0, captures=dims.tp_rank == 0 and dims.dp_rank == 0,
    )  # fmt: skip
    if cfg.parallel.tp_overlap.value == "auto" and par.stage.pieces > 1:  # 9. split where it pays
        wing.overlap = wing.register(overlap_probe(cfg, par.stage, device, log))
    data = (train_ds, val_ds)
    return Run(cfg, dims, device, log, data, loss_vocab, fpt, policies, par, opt, wing, dtype)
