"""The training loop of one rank of a (dp, pp, tp) mesh: model stage, AdamW, eval, checkpoints.

Each rank builds the full model from the seed, shards it for TP (compressed collectives), keeps
its pipeline stage (`taco.parallel.pipeline`, compressed send/recv), wraps the stage in DDP over
the DP group (`taco.parallel.data_parallel`, compressed gradient buckets), and runs a step as a
pipeline schedule of micro-batches (pp = 1: gradient accumulation). `launch(cfg)` runs it on
every rank: it spawns local gloo (or NCCL) ranks itself, or under torchrun runs as one rank of a
bigger job. Rank 0 logs to stdout, `metrics.jsonl` and TensorBoard.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from taco.comm import CommPolicy
from taco.parallel import (
    ParallelDims,
    PipelineEngine,
    PipelineStage,
    apply_tensor_parallel,
    build_optimizer,
    embedding_group,
    sync_tied_grads,
    sync_tp_partial_grads,
    vocab_parallel_cross_entropy,
    wrap_data_parallel,
)
from taco.parallel.data_parallel import DP_SITE, load_optimizer_state, optimizer_state, plain_allreduce_bytes
from taco.parallel.tags import is_pp_copy, is_tp_sharded, tp_context
from taco.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from taco.train.config import Config
from taco.train.data import TokenDataset


def build_model(cfg: Config, vocab_size: int) -> nn.Module:
    """The full (unsharded) model of `cfg.model`, initialised from `train.seed` or an HF checkpoint."""
    from taco.models import build_model as build
    from taco.models import load_hf_checkpoint
    from taco.models.presets import SIZE_KEYS

    m = cfg.model
    if m.init_from:
        model, _ = load_hf_checkpoint(m.init_from)
        if model.tok_emb.num_embeddings != vocab_size:
            raise ValueError(
                f"model.init_from has vocab {model.tok_emb.num_embeddings} but the data's tokenizer has "
                f"{vocab_size}: prepare data with the checkpoint's tokenizer"
            )
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
        codec=codec, overrides=overrides, min_bytes=c.min_bytes, slices=c.slices, check_sizes=False
    )


def build_axis_policy(cfg: Config, axis: str) -> CommPolicy:
    """The PP or DP policy of `[compression]`: `{axis}_codec` with its options, for every site."""
    c = cfg.compression
    name = getattr(c, f"{axis}_codec")
    return CommPolicy(
        codec=name,
        options=getattr(c, f"{axis}_codec_options") if name != "none" else {},
        min_bytes=c.min_bytes,
        slices=c.slices,
        check_sizes=False,
    )


def sent_bytes(policy: CommPolicy) -> tuple[int, int]:
    """(wire, raw) bytes this rank sent through `policy` (receiving sites `*.recv` excluded)."""
    sites = [s for name, s in policy.stats.sites.items() if not name.endswith(".recv")]
    return sum(s.wire_bytes for s in sites), sum(s.raw_bytes for s in sites)


AXES = ("tp", "pp", "dp")


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine decay from train.lr to train.min_lr."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    frac = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    wire_bytes: dict[str, float]
    """per axis: bytes one rank put on the wire this step, averaged over all ranks"""
    raw_bytes: dict[str, float]
    """per axis: the same traffic uncompressed (the input dtype)"""
    seconds: float


class Trainer:
    """Owns the model stage, optimizer, data and logging of one rank."""

    def __init__(
        self, cfg: Config, dims: ParallelDims, data_dir: Path, log: bool, zero: bool = False
    ) -> None:
        self.cfg, self.dims, self.log = cfg, dims, log
        t, p = cfg.train, cfg.parallel
        self.train_ds = TokenDataset(data_dir, "train", cfg.model.seq_len, seed=t.seed)
        self.val_ds = TokenDataset(data_dir, "val", cfg.model.seq_len, seed=t.seed)
        # Megatron-style padding: a multiple of 128 shards evenly for any tp <= 128 and keeps the
        # model identical across TP sizes (the extra rows are never targets and learn to stay low).
        vocab = cfg.model.vocab_size or -(-self.train_ds.vocab_size // 128) * 128
        self.policy = build_policy(cfg)
        self.policies = {
            "tp": self.policy,
            "pp": build_axis_policy(cfg, "pp"),
            "dp": build_axis_policy(cfg, "dp"),
        }
        self.model = apply_tensor_parallel(
            build_model(cfg, vocab), None, dims, self.policy, comm_dtype=tp_comm_dtype(cfg)
        )
        self.stage = PipelineStage(self.model, dims.pp_rank, dims.pp)  # keeps this stage's layers
        self.emb_group = embedding_group(dims, self.stage.tied)
        self.dp_group = dims.group("dp")
        c = cfg.compression
        self.module = wrap_data_parallel(
            self.stage, self.dp_group, c.dp_codec, c.dp_codec_options, policy=self.policies["dp"]
        )
        self.plain_dp_bytes = 0 if c.dp_codec != "none" else plain_allreduce_bytes(self.stage, self.dp_group)
        self.autocast = t.dtype.value == "bf16"
        self.engine = PipelineEngine(
            self.stage,
            dims,
            module=self.module,
            policy=self.policies["pp"],
            schedule=p.pp_schedule.value,
            autocast=self.autocast,
        )
        self.tp_group = dims.group("tp")
        params = list(self.stage.parameters())
        decay = [q for q in params if q.dim() >= 2]
        no_decay = [q for q in params if q.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        self.opt = build_optimizer(groups, self.dp_group, zero, lr=t.lr, betas=(t.beta1, t.beta2))
        self.step = 0
        self.out_dir = Path(t.out_dir)
        self.mesh = {"dp": dims.dp, "pp": dims.pp, "tp": dims.tp, "sp": int(dims.sp)}

    # -- one step -----------------------------------------------------------------------------
    def _seed_step(self, step: int) -> None:
        s = (self.cfg.train.seed * 1_000_003 + step * 7919 + self.dims.dp_rank) % (2**31)
        torch.manual_seed(s)
        random.seed(s)
        np.random.seed(s)

    def _loss_fn(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, y, self.tp_group).mean()  # logits [b, s, V/tp]

    def _dp_mean(self, v: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None:
            dist.all_reduce(v, group=self.dp_group)
            v /= self.dims.dp
        return v

    def train_step(self) -> StepStats:
        cfg, dims = self.cfg, self.dims
        t0 = time.perf_counter()
        self._seed_step(self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, cfg)
        before = self._bytes()
        x, y = self.train_ds.get_batch(self.step, cfg.train.batch_size, dims.dp_rank, dims.dp)
        self.opt.zero_grad(set_to_none=True)
        loss = self.engine.train_step(x, y, cfg.parallel.microbatches, self._loss_fn)
        sync_tp_partial_grads(self.model)
        sync_tied_grads(self.stage, self.emb_group)
        if self.plain_dp_bytes:  # DDP's own all-reduce: counted, not measured
            site = self.policies["dp"].stats.site(DP_SITE)
            site.calls += 1
            site.wire_bytes += self.plain_dp_bytes
            site.raw_bytes += self.plain_dp_bytes
        loss = self._dp_mean(loss).item()
        norm = self._clip(cfg.train.grad_clip)
        self.opt.step()
        self.step += 1
        wire, raw = self._per_rank_mean(before, self._bytes())
        return StepStats(loss, norm, wire, raw, time.perf_counter() - t0)

    def _bytes(self) -> list[int]:
        return [b for a in AXES for b in sent_bytes(self.policies[a])]

    def _per_rank_mean(self, before: list[int], after: list[int]) -> tuple[dict, dict]:
        """Bytes per axis this step, averaged over every rank of the job (ranks differ with PP)."""
        d = torch.tensor([a - b for a, b in zip(after, before)], dtype=torch.float64)
        if dist.get_world_size() > 1:
            dist.all_reduce(d)
            d /= dist.get_world_size()
        v = d.tolist()
        return {a: v[2 * i] for i, a in enumerate(AXES)}, {a: v[2 * i + 1] for i, a in enumerate(AXES)}

    def _clip(self, max_norm: float) -> float:
        """Global grad norm: TP-sharded slices summed over TP, replicas once, stages summed over PP
        (the last stage's tied-embedding copy skipped); DP replicas hold the same gradients."""
        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        params = [p for p in self.stage.parameters() if p.grad is not None]
        for p in params:
            if is_pp_copy(p):
                continue
            sq = p.grad.double().square().sum()
            if is_tp_sharded(p):
                sharded += sq
            else:
                replicated += sq
        if self.tp_group is not None:
            dist.all_reduce(sharded, group=self.tp_group)
        total = sharded + replicated
        if self.dims.pp > 1:
            dist.all_reduce(total, group=self.dims.group("pp"))
        norm = math.sqrt(total.item())
        if max_norm > 0 and norm > max_norm:
            for p in params:
                p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    # -- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over train.eval_steps fixed batches, with plain (uncompressed) TP
        collectives and PP transfers: the trained weights are judged, not the codec's error."""
        ctx = tp_context(self.model)
        saved, ctx.policy = ctx.policy, None
        mb = self.cfg.parallel.microbatches
        try:
            losses = []
            for i in range(self.cfg.train.eval_steps):
                x, y = self.val_ds.get_batch(i, self.cfg.train.batch_size, self.dims.dp_rank, self.dims.dp)
                losses.append(self.engine.eval_step(x, y, mb, self._loss_fn).item())
        finally:
            ctx.policy = saved
        return self._dp_mean(torch.tensor([sum(losses) / len(losses)])).item()

    # -- checkpoints --------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),  # this rank's stage and TP shard
            "opt": optimizer_state(self.opt),
            "step": self.step,
            "mesh": self.mesh,
        }

    def save(self) -> Path:
        return save_checkpoint(self.out_dir, self.step, dist.get_rank(), self.state())

    def maybe_resume(self) -> None:
        d = find_checkpoint(self.cfg.train.resume, self.out_dir)
        if d is None:
            return
        st = load_checkpoint(d, dist.get_rank(), self.mesh)
        self.model.load_state_dict(st["model"])
        load_optimizer_state(self.opt, st["opt"])
        self.step = st["step"]
        if self.log:
            print(f"resumed from {d} at step {self.step}", flush=True)
