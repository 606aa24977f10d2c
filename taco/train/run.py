"""One rank's built run and its step.

Why this file exists: `taco.train.build.build_run` builds a run top to bottom, in order (data ->
model -> TP/SP plan -> PP stage -> DP/FSDP -> optimizer -> compression policy and its observers),
and returns a `Run`; here is what the loop (`taco.train.trainer.Trainer.fit`) and the benchmarks
do with it. `Run.step` is one optimizer step: the pipeline schedule of micro-batches (gradient
accumulation at pp = 1) with the DP reduction inside the last backward, the TP and tied-embedding
sums, clipping, AdamW at the learning rate of `lr_at`.

Devices: one `torch.device` per rank; the model, every batch, scalar and buffer live there. Per
step the host reads the loss, the gradient norm and the stop request once, never per collective.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from taco.comm import CommPolicy
from taco.parallel import ParallelDims, fully_sharded, vocab_parallel_cross_entropy
from taco.parallel.data_parallel import (
    DP_SITE,
    close_data_parallel,
    load_optimizer_state,
    optimizer_state,
    plain_allreduce_bytes,
)
from taco.parallel.master_weights import MasterWeightsOptimizer
from taco.parallel.parallelize import Parallelized
from taco.parallel.tags import tp_context
from taco.train import stopping
from taco.train.adaptive import StepEnd, Wing
from taco.train.checkpoint import check_shapes
from taco.train.config import Config
from taco.train.data import TokenDataset
from taco.train.errors import CheckpointError
from taco.train.grads import MeshGrads
from taco.train.perf import peak_memory_bytes
from taco.train.window import StepStats


def sent_bytes(policy: CommPolicy, recompute: bool = False) -> tuple[int, int]:
    """(wire, raw) bytes this rank sent through `policy` (receiving sites `*.recv` excluded);
    `recompute`: those that activation recompute re-sent, counted apart."""
    stats = policy.recompute_stats if recompute else policy.stats
    sites = [s for name, s in stats.sites.items() if not name.endswith(".recv")]
    return sum(s.wire_bytes for s in sites), sum(s.raw_bytes for s in sites)


AXES = ("tp", "pp", "dp")
"""the axes whose bytes a run counts"""


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine decay from train.lr to train.min_lr."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    frac = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


STAT_KEYS = (*AXES, "tp_recompute")
"""the per-step byte counters: each axis, then the TP traffic re-sent by activation recompute"""
Batch = tuple[torch.Tensor, torch.Tensor]
"""token ids x [b, s] and targets y [b, s] of this DP rank, on its device"""


class Run:
    """One rank's built run: its stage, optimizer, policies and observers; `iteration` steps done."""

    def __init__(
        self,
        cfg: Config,
        dims: ParallelDims,
        device: torch.device,
        log: bool,
        data: tuple[TokenDataset, TokenDataset],
        loss_vocab: int | None,
        flops_per_token: float,
        policies: dict[str, CommPolicy],
        par: Parallelized,
        opt: Any,
        wing: Wing,
        dtype: torch.dtype,
    ) -> None:
        """Built by `taco.train.build.build_run`: the pieces, in the order they were built;
        `dtype`: the training dtype (bf16 or fp32)."""
        self.cfg, self.dims, self.device, self.log, self.dtype = cfg, dims, device, log, dtype
        self.train_ds, self.val_ds = data
        self.loss_vocab, self.flops_per_token = loss_vocab, flops_per_token
        self.policies, self.policy = policies, policies["tp"]
        self.model, self.stage, self.module, self.engine = par.model, par.stage, par.module, par.engine
        self.par, self.sharded, self.opt, self.wing = par, par.sharded, opt, wing
        self.grads = MeshGrads(par.stage, dims, par.sharded, device)
        self.dp_group, self.tp_group = dims.group("dp"), dims.group("tp")
        plain = cfg.compression.dp_codec == "none" and not self.sharded  # DDP's own all-reduce: counted here
        self.plain_dp_bytes = plain_allreduce_bytes(self.stage, self.dp_group) if plain else 0
        self.iteration = 0
        self.stop_votes = torch.zeros((), device=device)

    # -- one step -------------------------------------------------------------------------------
    def batch(self, k: int | None = None, val: bool = False) -> Batch:
        """Batch k (default: the current step's) of the train or validation split, on the device."""
        ds = self.val_ds if val else self.train_ds
        k = self.iteration if k is None else k
        x, y = ds.get_batch(k, self.cfg.train.batch_size, self.dims.dp_rank, self.dims.dp)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _loss_fn(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, y, self.tp_group, self.loss_vocab).mean()  # [b, s, V/tp]

    def _dp_mean(self, v: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None:
            dist.all_reduce(v, group=self.dp_group)
            v /= self.dims.dp
        return v

    def _seed(self) -> None:
        s = (self.cfg.train.seed * 1_000_003 + self.iteration * 7919 + self.dims.dp_rank) % (2**31)
        torch.manual_seed(s)
        random.seed(s)
        np.random.seed(s)

    def compute_gradients(
        self, batch: Batch | None = None, clip: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward and every gradient reduction of the current step, then clipping to
        `clip` (None: `train.grad_clip`; 0: off). Returns (mean loss over the global batch, global
        gradient norm before clipping) as 0-d tensors on the device: nothing here waits for the
        device. The stop requests of every rank ride on the norm's and the loss's reductions:
        `self.stop_votes` (> 0 when any rank of the job was asked to stop)."""
        self._seed()
        x, y = batch if batch is not None else self.batch()
        self.wing.begin_step(self.iteration + 1)
        self.opt.zero_grad(set_to_none=True)
        loss = self.engine.train_step(x, y, self.cfg.parallel.microbatches, self._loss_fn)
        if isinstance(self.opt, MasterWeightsOptimizer):
            self.opt.finish_grads()  # fp32 micro-batch sums -> p.grad
        self.par.reduce_grads()  # TP partial sums, tied embedding copies (DP: inside the backward)
        if self.plain_dp_bytes:  # DDP's own all-reduce: counted, not measured
            site = self.policies["dp"].stats.site(DP_SITE)
            site.calls += 1
            site.wire_bytes += self.plain_dp_bytes
            site.raw_bytes += self.plain_dp_bytes
        max_norm = self.cfg.train.grad_clip if clip is None else clip
        norm, votes = self.grads.clip(max_norm, float(stopping.requested() > 0))
        both = self._dp_mean(torch.stack((loss.float(), votes)))  # [2]: one all-reduce over DP
        self.stop_votes = both[1]
        return both[0], norm

    def step(self, batch: Batch | None = None) -> StepStats:
        """One optimizer step on `batch` (default: the current step's): `compute_gradients`, AdamW;
        this rank's byte counters and one host read of (loss, norm, stop votes), for the log."""
        t0 = time.perf_counter()
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.iteration, self.cfg)
        before = self.byte_counters()
        loss, norm = self.compute_gradients(batch)
        self.opt.step()
        self.iteration += 1
        d = [a - b for a, b in zip(self.byte_counters(), before)]
        wire = {a: float(d[2 * i]) for i, a in enumerate(STAT_KEYS)}
        raw = {a: float(d[2 * i + 1]) for i, a in enumerate(STAT_KEYS)}
        lo, no, votes = torch.stack((loss, norm, self.stop_votes)).tolist()  # waits for the step
        mem = float(peak_memory_bytes(self.device))
        return StepStats(lo, no, wire, raw, time.perf_counter() - t0, mem, votes > 0)

    def end_step(self, record: dict[str, Any]) -> None:
        """The step boundary: the observers act (collectively) and may add fields to `record`."""
        self.wing.end_step(StepEnd(self.iteration, float(record["step_s"]), record, grads=self))

    def byte_counters(self) -> list[int]:
        """(wire, raw) per axis, then the TP traffic of activation recompute (counted apart)."""
        return [b for a in AXES for b in sent_bytes(self.policies[a])] + [*sent_bytes(self.policy, True)]

    # -- the gradient view of observers (`taco.train.adaptive.observers.Gradients`) ---------------
    def grad_sums(self, terms: Callable[[torch.nn.Parameter, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`MeshGrads.sums` of this run's gradients (collective over the mesh, stays on the device)."""
        return self.grads.sums(terms)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.stage.parameters()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    @contextmanager
    def tp_policy(self, policy: CommPolicy | None) -> Iterator[None]:
        """The TP collectives use `policy` inside (None: plain), the run's own again after."""
        ctx = tp_context(self.model)
        saved, ctx.policy = ctx.policy, policy
        try:
            yield
        finally:
            ctx.policy = saved

    # -- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over train.eval_steps fixed batches, with plain (uncompressed) TP
        collectives and PP transfers: the trained weights are judged, not the codec's error."""
        mb = self.cfg.parallel.microbatches
        exact = fully_sharded.exact_gathers(self.stage) if self.sharded else nullcontext()  # FSDP weights
        losses = []
        with self.tp_policy(None), exact:
            for i in range(self.cfg.train.eval_steps):
                x, y = self.batch(i, val=True)
                losses.append(self.engine.eval_step(x, y, mb, self._loss_fn))
        return self._dp_mean(torch.stack(losses).mean()).item()

    # -- checkpoints ----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        st = {
            "model": self.model.state_dict(),  # this rank's stage and TP shard
            "opt": optimizer_state(self.opt),
            "step": self.iteration,
            "mesh": self.dims.mesh(),
            "dp_shard": self.sharded,
            "site_codecs": self.policy.site_codecs(),  # exact-site TP codecs (the guard's, calibration's)
        }
        if self.sharded:  # local DP shards of both, and the weight-difference references
            st.update(fully_sharded.checkpoint_state(self.stage, self.model, st["opt"]))
        return st

    def load_state(self, st: dict[str, Any], path: Path) -> None:
        """Restore `state()` read from checkpoint folder `path` (this rank's file of it)."""
        if st.get("dp_shard", False) != self.sharded:
            raise CheckpointError(
                f"{path}: parallel.dp_shard differs from the run that wrote it; use the same"
            )
        if self.sharded:
            fully_sharded.load_checkpoint_state(self.stage, self.model, self.opt, st)
        else:
            check_shapes(path / f"rank{dist.get_rank()}.pt", st["model"], self.model.state_dict())
            self.model.load_state_dict(st["model"])
            load_optimizer_state(self.opt, st["opt"])
        self.iteration = st["step"]
        for site, spec in st.get("site_codecs", {}).items():
            self.policy.set_site_codec(site, spec)

    def dp_codecs(self) -> str:
        c = self.cfg.compression
        return f"fsdp(weight={c.dp_weight_codec},grad={c.dp_grad_codec})" if self.sharded else c.dp_codec

    def close(self) -> None:
        """Stop DP's hook worker (before the process groups go)."""
        close_data_parallel(self.module)
