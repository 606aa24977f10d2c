"""The training loop of one rank: model, TP/SP with compressed collectives, AdamW, eval, checkpoints.

`launch(cfg)` runs it on every rank: it spawns local gloo (or NCCL) ranks itself, or under
torchrun runs as one rank of a bigger job. Rank 0 logs to stdout, `metrics.jsonl` and TensorBoard.
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

from taco.parallel import (
    ParallelDims,
    apply_tensor_parallel,
    sync_tp_partial_grads,
    vocab_parallel_cross_entropy,
)
from taco.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from taco.train.config import Config, ModelKind
from taco.train.data import TokenDataset


def build_model(cfg: Config, vocab_size: int) -> nn.Module:
    """The full (unsharded) model of `cfg.model`, initialised from `train.seed` or an HF checkpoint."""
    from taco.models import GPT, GPTConfig, Qwen, QwenConfig, load_hf_checkpoint

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
    if m.kind == ModelKind.GPT:
        return GPT(
            GPTConfig(
                vocab_size=vocab_size,
                n_layer=m.n_layer,
                n_head=m.n_head,
                n_embd=m.hidden,
                block_size=m.seq_len,
                dropout=m.dropout,
                tie_embeddings=m.tie_embeddings,
                layer_norm_eps=m.norm_eps,
            )
        )
    return Qwen(
        QwenConfig(
            vocab_size=vocab_size,
            hidden_size=m.hidden,
            intermediate_size=m.ffn_size,
            num_hidden_layers=m.n_layer,
            num_attention_heads=m.n_head,
            num_key_value_heads=m.kv_heads,
            head_dim=m.head_size,
            rope_theta=m.rope_theta,
            rms_norm_eps=m.norm_eps,
            max_position_embeddings=m.seq_len,
            tie_word_embeddings=m.tie_embeddings,
            qk_norm=m.qk_norm,
        )
    )


def build_policy(cfg: Config) -> Any:
    """The TP communication policy of `[compression]` (codec "none" keeps plain collectives + stats)."""
    import taco
    from taco.comm import CommPolicy

    c = cfg.compression
    codec = taco.get_codec(c.tp_codec, **c.tp_codec_options)
    # Only sites matching compression.tp_sites are compressed; the first matching glob wins.
    overrides: dict = {} if "*" in c.tp_sites else {**{g: codec for g in c.tp_sites}, "*": None}
    return CommPolicy(
        codec=codec, overrides=overrides, min_bytes=c.min_bytes, slices=c.slices, check_sizes=False
    )


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
    wire_bytes: int
    raw_bytes: int
    seconds: float


class Trainer:
    """Owns the model shard, optimizer, data and logging of one rank."""

    def __init__(self, cfg: Config, dims: ParallelDims, data_dir: Path, log: bool) -> None:
        self.cfg, self.dims, self.log = cfg, dims, log
        t = cfg.train
        self.train_ds = TokenDataset(data_dir, "train", cfg.model.seq_len, seed=t.seed)
        self.val_ds = TokenDataset(data_dir, "val", cfg.model.seq_len, seed=t.seed)
        # Megatron-style padding: a multiple of 128 shards evenly for any tp <= 128 and keeps the
        # model identical across TP sizes (the extra rows are never targets and learn to stay low).
        vocab = cfg.model.vocab_size or -(-self.train_ds.vocab_size // 128) * 128
        self.policy = build_policy(cfg)
        self.model = apply_tensor_parallel(build_model(cfg, vocab), None, dims, self.policy)
        self.tp_group = dims.group("tp")
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
        )
        self.step = 0
        self.out_dir = Path(t.out_dir)
        self.mesh = {"dp": dims.dp, "pp": dims.pp, "tp": dims.tp, "sp": int(dims.sp)}
        self.autocast = t.dtype.value == "bf16"

    # -- one step -----------------------------------------------------------------------------
    def _seed_step(self, step: int) -> None:
        s = (self.cfg.train.seed * 1_000_003 + step * 7919 + self.dims.dp_rank) % (2**31)
        torch.manual_seed(s)
        random.seed(s)
        np.random.seed(s)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu" if not x.is_cuda else "cuda", torch.bfloat16, enabled=self.autocast):
            logits = self.model(x)  # [b, s, V/tp]
        return vocab_parallel_cross_entropy(logits, y, self.tp_group).mean()

    def train_step(self) -> StepStats:
        cfg, dims = self.cfg, self.dims
        t0 = time.perf_counter()
        self._seed_step(self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, cfg)
        before = self._bytes()
        x, y = self.train_ds.get_batch(self.step, cfg.train.batch_size, dims.dp_rank, dims.dp)
        mb = cfg.parallel.microbatches
        total = 0.0
        self.opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(mb), y.chunk(mb)):
            loss = self._loss(xm, ym) / mb
            loss.backward()
            total += loss.item()
        sync_tp_partial_grads(self.model)
        if dims.dp > 1:
            self._dp_all_reduce()
            t = torch.tensor([total])
            dist.all_reduce(t, group=dims.group("dp"))
            total = t.item() / dims.dp
        norm = self._clip(cfg.train.grad_clip)
        self.opt.step()
        self.step += 1
        after = self._bytes()
        return StepStats(total, norm, after[0] - before[0], after[1] - before[1], time.perf_counter() - t0)

    def _bytes(self) -> tuple[int, int]:
        if self.policy is None:
            return 0, 0
        t = self.policy.stats.total()
        return t.wire_bytes, t.raw_bytes

    def _dp_all_reduce(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]) / self.dims.dp
        dist.all_reduce(flat, group=self.dims.group("dp"))
        off = 0
        for g in grads:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()

    def _clip(self, max_norm: float) -> float:
        """Global grad norm over the TP-sharded model (sharded slices summed over TP, replicas once)."""
        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            sq = p.grad.double().square().sum()
            if getattr(p, "_taco_tp_sharded", False):
                sharded += sq
            else:
                replicated += sq
        if self.tp_group is not None:
            dist.all_reduce(sharded, group=self.tp_group)
        norm = math.sqrt((sharded + replicated).item())
        if max_norm > 0 and norm > max_norm:
            for p in params:
                p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    # -- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over train.eval_steps fixed batches, with plain (uncompressed) TP
        collectives: the trained weights are judged, not the codec's inference error."""
        ctx = self.model._taco_tp
        saved, ctx.policy = ctx.policy, None
        try:
            losses = []
            for i in range(self.cfg.train.eval_steps):
                x, y = self.val_ds.get_batch(i, self.cfg.train.batch_size, self.dims.dp_rank, self.dims.dp)
                losses.append(self._loss(x, y).item())
        finally:
            ctx.policy = saved
        v = torch.tensor([sum(losses) / len(losses)])
        if self.dims.dp > 1:
            dist.all_reduce(v, group=self.dims.group("dp"))
            v /= self.dims.dp
        return v.item()

    # -- checkpoints --------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
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
        self.opt.load_state_dict(st["opt"])
        self.step = st["step"]
        if self.log:
            print(f"resumed from {d} at step {self.step}", flush=True)
