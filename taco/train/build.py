"""What a run is built from: the model, the communication policies, the parallel options, the
optimizer, the learning-rate schedule.

Why this file exists: these are pure functions of the config (no loop state), the pieces
`taco.train.run.build_run` puts together in order, shared with the benchmarks and tests that build
one piece of a run.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from taco.comm import CommPolicy
from taco.parallel.parallelize import ParallelOptions
from taco.train.config import Config

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


def build_policy(cfg: Config) -> CommPolicy:
    """The TP communication policy of `[compression]` (codec "none" keeps plain collectives + stats;
    its options, e.g. a config file's group_size kept for a baseline run, are then ignored)."""
    import taco

    c = cfg.compression
    codec = None if c.tp_codec == "none" else taco.get_codec(c.tp_codec, **c.tp_codec_options)
    # Only sites matching compression.tp_sites are compressed; the first matching glob wins.
    overrides: dict = {} if "*" in c.tp_sites else {**{g: codec for g in c.tp_sites}, "*": None}
    return CommPolicy(
        codec=codec, overrides=overrides, min_bytes=c.min_bytes, slices=c.slices,
        min_slice_bytes=c.min_slice_bytes, all_reduce_algo=c.tp_all_reduce, check_sizes=False,
    )  # fmt: skip


def build_axis_policy(cfg: Config, axis: str) -> CommPolicy:
    """The PP or DP policy of `[compression]`: `{axis}_codec` with its options, for every site."""
    c = cfg.compression
    name = getattr(c, f"{axis}_codec")
    return CommPolicy(
        codec=name,
        options=getattr(c, f"{axis}_codec_options") if name != "none" else {},
        min_bytes=c.min_bytes,
        slices=c.slices,
        min_slice_bytes=c.min_slice_bytes,
        check_sizes=False,
    )


def sent_bytes(policy: CommPolicy, recompute: bool = False) -> tuple[int, int]:
    """(wire, raw) bytes this rank sent through `policy` (receiving sites `*.recv` excluded);
    `recompute`: those that activation recompute re-sent, counted apart."""
    stats = policy.recompute_stats if recompute else policy.stats
    sites = [s for name, s in stats.sites.items() if not name.endswith(".recv")]
    return sum(s.wire_bytes for s in sites), sum(s.raw_bytes for s in sites)


AXES = ("tp", "pp", "dp")


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine decay from train.lr to train.min_lr."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    frac = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


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
