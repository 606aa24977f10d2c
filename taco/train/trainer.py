"""The training loop of one rank of a (dp, pp, tp) mesh: model stage, AdamW, eval, checkpoints.

Each rank builds the full model from the seed (on the CPU, so every device starts from the same
weights), shards it for TP (compressed collectives), keeps its pipeline stage
(`taco.parallel.pipeline`, compressed send/recv), moves the stage to its device, wraps it in DDP
over the DP group (`taco.parallel.data_parallel`, compressed gradient buckets), and runs a step as
a pipeline schedule of micro-batches (pp = 1: gradient accumulation). `Trainer.fit()` is the loop:
steps, evaluation, checkpoints, metrics; `taco.train.launch` only starts the ranks and their
process group. Rank 0 logs to stdout, `metrics.jsonl` and TensorBoard.

Devices: one `torch.device` per rank, given to the trainer; the model, every batch, scalar and
buffer live there. Per step the host reads the loss, the gradient norm and the stop request once
(for the log), never per collective; the per-rank byte counters and peak memory are reduced over
the job once per logged window (`taco.train.window`), not per step.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from taco.parallel import (
    ParallelDims,
    PipelineEngine,
    PipelineStage,
    apply_tensor_parallel,
    embedding_group,
    fully_sharded,
    sync_tied_grads,
    sync_tp_partial_grads,
    vocab_parallel_cross_entropy,
    wrap_data_parallel,
)
from taco.parallel.data_parallel import DP_SITE, load_optimizer_state, optimizer_state, plain_allreduce_bytes
from taco.parallel.master_weights import MasterWeightsOptimizer
from taco.parallel.recompute import apply_recompute
from taco.parallel.tags import is_pp_copy, is_tp_sharded, tp_context
from taco.train import dcp, stopping
from taco.train.autopolicy import AutoPolicy
from taco.train.build import (
    AXES,
    build_axis_policy,
    build_model,
    build_policy,
    build_stage_optimizer,
    lr_at,
    model_vocab,
    prepare_stage,
    sent_bytes,
    shard_data_parallel,
    tp_comm_dtype,
    train_dtype,
)
from taco.train.calibration import attach_calibration
from taco.train.checkpoint import check_shapes, find_checkpoint, load_checkpoint, save_checkpoint
from taco.train.config import Config, config_to_toml
from taco.train.data import TokenDataset
from taco.train.errors import CheckpointError
from taco.train.fidelity import FidelityTelemetry
from taco.train.metrics import MetricsLogger, capture_fn
from taco.train.perf import device_peak_flops, flops_per_token, peak_memory_bytes
from taco.train.window import StatsWindow, StepStats

_Grads = list[tuple[torch.nn.Parameter, torch.Tensor]]
"""(parameter, its local gradient) pairs"""
STAT_KEYS = (*AXES, "tp_recompute")
"""the per-step byte counters: each axis, then the TP traffic re-sent by activation recompute"""
# whether this torch's _foreach_norm takes an output dtype (bf16 gradients accumulated in fp32)
_NORM_DTYPE = "dtype" in str(torch.ops.aten._foreach_norm.Scalar._schema)


def sum_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[1] fp32 on `device`: the sum of the squares of every element of `grads`, from one
    `_foreach_norm` in fp32 (a few kernels for all parameters, no float64 copies, no host sync)."""
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    if _NORM_DTYPE:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    else:  # older torch: fp32 copies of the gradients that are not fp32 already
        norms = torch._foreach_norm([g.float() for g in grads], 2)
    return torch.stack(norms).square().sum().reshape(1)


class Trainer:
    """Owns the model stage, optimizer, data and logging of one rank."""

    def __init__(
        self,
        cfg: Config,
        dims: ParallelDims,
        data_dir: Path,
        log: bool,
        device: torch.device | str = "cpu",
    ) -> None:
        """`dims`: the built mesh; `log`: this rank writes the outputs (rank 0); `device`: where
        this rank computes (its process group must be able to move tensors there)."""
        self.cfg, self.dims, self.log = cfg, dims, log
        self.device = torch.device(device)
        t, p = cfg.train, cfg.parallel
        self.train_ds = TokenDataset(data_dir, "train", cfg.model.seq_len, seed=t.seed)
        self.val_ds = TokenDataset(data_dir, "val", cfg.model.seq_len, seed=t.seed)
        # Megatron-style padding so the vocabulary shards evenly (build.model_vocab); a checkpoint's
        # padded logits are masked out of the loss (loss_vocab), so it trains as the unpadded model.
        vocab, self.loss_vocab = model_vocab(cfg, self.train_ds.vocab_size)
        self.policy = build_policy(cfg)
        # called as hook(trainer, record) after each step, before the record is written: the TP-site
        # features of the [compression] section (calibration, the auto policy, fidelity telemetry)
        # act at step boundaries here, collectively on every rank, and may add fields to the record
        self.step_hooks: list[Callable[[Trainer, dict[str, Any]], None]] = []
        self.fidelity = FidelityTelemetry(self) if cfg.compression.telemetry_every else None
        if self.fidelity is not None:
            self.step_hooks.append(self.fidelity)
        self.policies = {
            "tp": self.policy,
            "pp": build_axis_policy(cfg, "pp"),
            "dp": build_axis_policy(cfg, "dp"),
        }
        full, m = build_model(cfg, vocab), cfg.model
        self.flops_per_token = flops_per_token(full, m.n_layer, m.n_head * m.head_size, m.seq_len)  # MFU
        self.model = apply_tensor_parallel(
            full, None, dims, self.policy, comm_dtype=tp_comm_dtype(cfg), overlap_wgrad=p.overlap_tp_wgrad,
        )
        self.stage = PipelineStage(self.model, dims.pp_rank, dims.pp)  # keeps this stage's layers
        layers = [self.model.layers[i] for i in self.stage.layers]
        apply_recompute(layers, t.recompute.value, tp_context(self.model))  # before DP wraps the blocks
        self.stage.to(self.device)  # built and sharded on the CPU: the same weights on every device
        self.sharded = p.dp_shard and dims.group("dp") is not None  # FSDP2 (taco.parallel.fully_sharded)
        fp32_init = prepare_stage(cfg, self.stage, self.model, self.sharded)  # compile, bf16 cast
        self.master = bool(fp32_init)
        bf16 = t.dtype.value == "bf16"
        self.emb_group = embedding_group(dims, self.stage.tied)
        self.dp_group = dims.group("dp")
        c = cfg.compression
        if self.sharded:
            self.module = shard_data_parallel(cfg, dims, self.stage, self.policies["dp"])
        else:
            self.module = wrap_data_parallel(
                self.stage, self.dp_group, c.dp_codec, c.dp_codec_options, policy=self.policies["dp"],
                overlap=p.overlap_dp,
            )
        plain = c.dp_codec == "none" and not self.sharded  # DDP's own all-reduce: counted here
        self.plain_dp_bytes = plain_allreduce_bytes(self.stage, self.dp_group) if plain else 0
        self.autocast = bf16 and t.mixed_precision.value == "autocast"  # FSDP2's master recipe: neither
        self.engine = PipelineEngine(
            self.stage,
            dims,
            module=self.module,
            policy=self.policies["pp"],
            schedule=p.pp_schedule.value,
            overlap_p2p=p.overlap_p2p,
            act_dtype=train_dtype(cfg),
            autocast=self.autocast,
            device=self.device,
        )
        self.tp_group = dims.group("tp")
        self.auto = AutoPolicy.for_trainer(self) if c.when == "auto" else None  # compress where it pays
        if self.auto is not None:
            self.step_hooks.append(self.auto)
        self.opt = build_stage_optimizer(cfg, self.stage, self.dp_group, fp32_init)
        self.step = 0
        self.out_dir = Path(t.out_dir)
        self.mesh = dims.mesh()
        self.calibration = attach_calibration(self)  # compression.calibrate/.calibration: per-site TP codecs
        self.dcp = dcp.DCPWriter(self.out_dir, t.checkpoint_async) if t.checkpoint_format == "dcp" else None

    # -- one step -----------------------------------------------------------------------------
    def _seed_step(self, step: int) -> None:
        s = (self.cfg.train.seed * 1_000_003 + step * 7919 + self.dims.dp_rank) % (2**31)
        torch.manual_seed(s)
        random.seed(s)
        np.random.seed(s)

    def _loss_fn(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, y, self.tp_group, self.loss_vocab).mean()  # [b, s, V/tp]

    def _dp_mean(self, v: torch.Tensor) -> torch.Tensor:
        if self.dp_group is not None:
            dist.all_reduce(v, group=self.dp_group)
            v /= self.dims.dp
        return v

    def _batch(self, ds: TokenDataset, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch k of `ds` for this DP rank, on this rank's device: ids x [b, s], targets y [b, s]."""
        x, y = ds.get_batch(k, self.cfg.train.batch_size, self.dims.dp_rank, self.dims.dp)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def compute_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward and every gradient reduction of the current step, then clipping.

        Returns (mean loss over the global batch, global gradient norm before clipping) as
        0-d tensors on this rank's device: nothing here waits for the device. The stop requests of
        every rank ride on the norm's and the loss's reductions (no collective of their own):
        `self.stop_votes` (0-d, > 0 when any rank of the job was asked to stop).
        """
        cfg = self.cfg
        self._seed_step(self.step)
        x, y = self._batch(self.train_ds, self.step)
        self.opt.zero_grad(set_to_none=True)
        loss = self.engine.train_step(x, y, cfg.parallel.microbatches, self._loss_fn)
        if isinstance(self.opt, MasterWeightsOptimizer):
            self.opt.finish_grads()  # fp32 micro-batch sums -> p.grad
        sync_tp_partial_grads(self.model)
        sync_tied_grads(self.stage, self.emb_group)
        if self.plain_dp_bytes:  # DDP's own all-reduce: counted, not measured
            site = self.policies["dp"].stats.site(DP_SITE)
            site.calls += 1
            site.wire_bytes += self.plain_dp_bytes
            site.raw_bytes += self.plain_dp_bytes
        norm, votes = self._clip(cfg.train.grad_clip)
        both = self._dp_mean(torch.stack((loss.float(), votes)))  # [2]: one all-reduce over DP
        self.stop_votes = both[1]
        return both[0], norm

    def train_step(self) -> StepStats:
        """One optimiser step: `compute_gradients`, AdamW; this rank's byte counters (host numbers)
        and one host read of (loss, norm, stop votes), for the log. No collective for statistics."""
        t0 = time.perf_counter()
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, self.cfg)
        before = self._bytes()
        loss, norm = self.compute_gradients()
        self.opt.step()
        self.step += 1
        d = [a - b for a, b in zip(self._bytes(), before)]
        wire = {a: float(d[2 * i]) for i, a in enumerate(STAT_KEYS)}
        raw = {a: float(d[2 * i + 1]) for i, a in enumerate(STAT_KEYS)}
        lo, no, votes = torch.stack((loss, norm, self.stop_votes)).tolist()  # waits for the step
        mem = float(peak_memory_bytes(self.device))
        return StepStats(lo, no, wire, raw, time.perf_counter() - t0, mem, votes > 0)

    def _bytes(self) -> list[int]:
        """(wire, raw) per axis, then the TP traffic of activation recompute (counted apart)."""
        return [b for a in AXES for b in sent_bytes(self.policies[a])] + [*sent_bytes(self.policy, True)]

    def _local_grads(self) -> tuple[_Grads, _Grads]:
        """(TP-sharded, replicated) parameters with a gradient, each with its local gradient (FSDP:
        this rank's shard); the last stage's tied-embedding copy is left out (counted on the first)."""
        sharded: _Grads = []
        replicated: _Grads = []
        for p in self.stage.parameters():
            if p.grad is not None and not is_pp_copy(p):
                (sharded if is_tp_sharded(p) else replicated).append((p, fully_sharded.local_tensor(p.grad)))
        return sharded, replicated

    def _over_mesh(self, sharded: torch.Tensor, replicated: torch.Tensor) -> torch.Tensor:
        """Sums of TP-sharded slices (summed over TP) plus sums of replicas (once), then summed over
        FSDP's DP shards and over the PP stages. Collective over the mesh; no host sync."""
        if self.tp_group is not None:
            dist.all_reduce(sharded, group=self.tp_group)
        total = sharded + replicated
        if self.sharded:  # each DP rank holds 1/dp of every gradient
            dist.all_reduce(total, group=self.dp_group)
        if self.dims.pp > 1:
            dist.all_reduce(total, group=self.dims.group("pp"))
        return total

    def grad_sums(self, terms: Callable[[torch.nn.Parameter, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Sums over the whole model of `terms(param, local grad)` (a float64 vector, the same length
        for every parameter): TP-sharded slices summed over TP, replicas once, stages summed over PP
        (the last stage's tied-embedding copy skipped); DP replicas hold the same gradients, FSDP
        shards are summed over DP. Collective over the mesh; the result stays on the device."""
        sums: list[torch.Tensor | float] = []
        for part in self._local_grads():
            acc: torch.Tensor | float = 0.0
            for p, g in part:
                acc = acc + terms(p, g)
            sums.append(acc)
        like = next((t for t in sums if isinstance(t, torch.Tensor)), None)
        n = 1 if like is None else like.numel()
        z = torch.zeros(n, dtype=torch.float64, device=self.device)
        return self._over_mesh(z + sums[0], z + sums[1])  # a stage without gradients: zeros

    def _clip(self, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Global grad norm (fp32: `sum_squares` of each part, `_over_mesh`); clips to `max_norm`
        (0 = off) without reading the norm on the host. Also returns this rank's stop request
        summed over the same reductions (TP, FSDP's DP, PP), riding in the same all-reduces."""
        sharded, replicated = (sum_squares([g for _, g in part], self.device) for part in self._local_grads())
        vote = torch.full((1,), float(stopping.requested() > 0), device=self.device)
        sums = self._over_mesh(torch.cat((sharded, vote)), torch.cat((replicated, torch.zeros_like(vote))))
        norm, votes = sums[0].sqrt(), sums[1]
        if max_norm > 0:  # scale by max_norm / norm when above the bound, else by exactly 1
            scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), torch.ones_like(norm))
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in self.stage.parameters():  # the tied copy too: every gradient the optimizer sees
                if p.grad is not None:
                    by_dtype.setdefault(p.grad.dtype, []).append(fully_sharded.local_tensor(p.grad))
            for dtype, grads in by_dtype.items():
                torch._foreach_mul_(grads, scale.to(dtype))
        return norm, votes

    # -- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over train.eval_steps fixed batches, with plain (uncompressed) TP
        collectives and PP transfers: the trained weights are judged, not the codec's error."""
        ctx = tp_context(self.model)
        saved, ctx.policy = ctx.policy, None
        mb = self.cfg.parallel.microbatches
        exact = fully_sharded.exact_gathers(self.stage) if self.sharded else nullcontext()  # FSDP weights
        try:
            losses = []
            with exact:
                for i in range(self.cfg.train.eval_steps):
                    x, y = self._batch(self.val_ds, i)
                    losses.append(self.engine.eval_step(x, y, mb, self._loss_fn))
        finally:
            ctx.policy = saved
        return self._dp_mean(torch.stack(losses).mean()).item()

    # -- checkpoints --------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        st = {
            "model": self.model.state_dict(),  # this rank's stage and TP shard
            "opt": optimizer_state(self.opt),
            "step": self.step,
            "mesh": self.mesh,
            "dp_shard": self.sharded,
            "site_codecs": self.policy.site_codecs(),  # exact-site TP codecs (the guard's, calibration's)
        }
        if self.sharded:  # local DP shards of both, and the weight-difference references
            st.update(fully_sharded.checkpoint_state(self.stage, self.model, st["opt"]))
        return st

    def save(self) -> Path:
        if self.dcp is not None:  # reshardable (taco.train.dcp)
            return self.dcp.save(self)
        return save_checkpoint(self.out_dir, self.step, dist.get_rank(), self.state())

    def maybe_resume(self) -> None:
        d = find_checkpoint(self.cfg.train.resume, self.out_dir)
        if d is None:
            return
        if dcp.is_dcp(d):  # written at any layout
            st = dcp.load(self, d, self.dcp.group if self.dcp is not None else None)
        else:
            st = self._load_rank_files(d)
        self.step = st["step"]
        for site, spec in st.get("site_codecs", {}).items():
            self.policy.set_site_codec(site, spec)
        if self.log:
            print(f"resumed from {d} at step {self.step}", flush=True)

    def _load_rank_files(self, d: Path) -> dict[str, Any]:
        st = load_checkpoint(d, dist.get_rank(), self.mesh)
        if st.get("dp_shard", False) != self.sharded:
            raise CheckpointError(f"{d}: parallel.dp_shard differs from the run that wrote it; use the same")
        if self.sharded:
            fully_sharded.load_checkpoint_state(self.stage, self.model, self.opt, st)
        else:
            check_shapes(d / f"rank{dist.get_rank()}.pt", st["model"], self.model.state_dict())
            self.model.load_state_dict(st["model"])
            load_optimizer_state(self.opt, st["opt"])
        return st

    def _dp_codecs(self) -> str:
        c = self.cfg.compression
        return f"fsdp(weight={c.dp_weight_codec},grad={c.dp_grad_codec})" if self.sharded else c.dp_codec

    # -- the loop -----------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to `train.steps` (resuming first if `train.resume` says so); returns the summary.

        Per step: one optimiser step, a metrics record (loss, lr, bytes per axis, MFU, peak memory;
        written when its window is reduced: log, evaluation and checkpoint steps), evaluation
        every `eval_interval` steps and at the end, checkpoints every `checkpoint_interval` steps
        and at the end. A stop request (SIGINT/SIGTERM, `taco.train.stopping`) ends the loop after
        the step in which any rank saw it, with a checkpoint of that step; the summary then names
        it (`stopped_at`, `checkpoint`). Rank 0 writes `config.toml`, `metrics.jsonl`, TensorBoard,
        `comm_stats.txt` and `summary.json` to `train.out_dir`. The summary's bytes are per step
        and per rank, averaged over the job.
        """
        cfg, t, p, c = self.cfg, self.cfg.train, self.cfg.parallel, self.cfg.compression
        self.maybe_resume()
        if t.capture_dir and self.dims.tp_rank == 0 and self.dims.dp_rank == 0:
            hook = capture_fn(Path(t.capture_dir), t.capture_interval, lambda: self.step)
            tp_context(self.model).capture = hook
        logger = MetricsLogger(self.out_dir, self.log, t.steps, start_step=self.step)
        if self.log:
            (self.out_dir / "config.toml").write_text(config_to_toml(cfg))
            n = sum(q.numel() for q in self.model.parameters())
            print(
                f"[taco] {cfg.model.kind} {self.dims} world={dist.get_world_size()} device={self.device} "
                f"params/rank={n / 1e6:.2f}M microbatches={p.microbatches} schedule={p.pp_schedule} "
                f"codecs: tp={c.tp_codec} pp={c.pp_codec} dp={self._dp_codecs()} out={self.out_dir}",
                flush=True,
            )
        tokens_per_step = t.batch_size * cfg.model.seq_len
        peak = 0.0  # FLOP/s of one device, for MFU (taco.train.perf); rank 0 logs, so measures
        if self.log:
            peak, source = device_peak_flops(self.device, train_dtype(cfg), t.peak_tflops)
            print(f"[taco] MFU against {source}", flush=True)
        ideal_s = self.flops_per_token * tokens_per_step / (dist.get_world_size() * peak or 1.0)  # at peak
        t_train, steps_done, start_step, val, saved = 0.0, 0, self.step, float("nan"), None
        wire_sum, raw_sum = dict.fromkeys(AXES, 0.0), dict.fromkeys(AXES, 0.0)
        window, pending = StatsWindow(STAT_KEYS, self.device), []  # records wait for their window's reduction
        while self.step < t.steps:
            st = self.train_step()
            step = self.step
            t_train += st.seconds
            steps_done += 1
            window.add(st)
            rec: dict[str, Any] = {
                "step": step,
                "loss": st.loss,
                "lr": self.opt.param_groups[0]["lr"],
                "grad_norm": st.grad_norm,
                "step_s": st.seconds,
                "mfu": ideal_s / st.seconds if peak else 0.0,
            }
            for hook in self.step_hooks:
                hook(self, rec)
            if (t.eval_interval and step % t.eval_interval == 0) or step == t.steps:  # 0: at the end
                rec["val_loss"] = val = self.evaluate()
            stop = st.stop and step < t.steps  # SIGINT/SIGTERM: every rank saves this step and stops
            ckpt = step == t.steps or (t.checkpoint_interval and step % t.checkpoint_interval == 0) or stop
            if ckpt:
                saved = self.save()
            pending.append(rec)
            # the same steps on every rank: the window's one collective, then its records
            if step % t.log_interval == 0 or step == t.steps or "val_loss" in rec or ckpt:
                for r, (wire, raw, mem) in zip(pending, window.reduce()):
                    r["peak_mem_gib"] = mem / 2**30
                    for a in AXES:
                        wire_sum[a] += wire[a]
                        raw_sum[a] += raw[a]
                        r[f"{a}_wire_bytes"], r[f"{a}_raw_bytes"] = wire[a], raw[a]
                    if t.recompute.value != "none":  # recomputed TP traffic, not in tp_*
                        r["tp_recompute_wire_bytes"] = wire["tp_recompute"]
                        r["tp_recompute_raw_bytes"] = raw["tp_recompute"]
                    logger.write(r)
                pending = []
                eta = (t.steps - step) * t_train / steps_done
                mfu = ideal_s * steps_done / max(t_train, 1e-9) if peak else 0.0
                logger.progress(rec, tokens_per_step * steps_done / max(t_train, 1e-9), eta, mfu)
            if stop:
                if self.log:
                    print(f"[taco] stop requested: checkpoint of step {step} written to {saved}", flush=True)
                break
        if self.dcp is not None:
            self.dcp.wait()  # the last checkpoint written and committed
        logger.close()
        n = max(steps_done, 1)
        summary = {
            "final_val_loss": val,
            "steps": self.step,
            **({"stopped_at": self.step, "checkpoint": str(saved)} if self.step < t.steps else {}),
            "resumed_from": start_step,
            "tokens_per_s": tokens_per_step * steps_done / max(t_train, 1e-9),
            **{f"{a}_wire_bytes_per_step": wire_sum[a] / n for a in AXES},
            **{f"{a}_raw_bytes_per_step": raw_sum[a] / n for a in AXES},
            "mesh": str(self.dims),
            "device": str(self.device),
            "microbatches": p.microbatches,
            "pp_schedule": str(p.pp_schedule),
            "tp_codec": c.tp_codec,
            "pp_codec": c.pp_codec,
            "dp_codec": self._dp_codecs(),
            **({"auto": self.auto.summary()} if self.auto is not None else {}),
        }
        if self.log:
            stats = "\n\n".join(f"[{a}]\n{self.policies[a].stats.summary()}" for a in AXES)
            if self.policies["tp"].recompute_stats.sites:  # re-run by activation recompute, not in [tp]
                stats += f"\n\n[tp recompute]\n{self.policies['tp'].recompute_stats.summary()}"
            if self.fidelity is not None:  # per-site SQNR of the telemetry steps, the guard's switches
                stats += f"\n\n[tp fidelity]\n{self.fidelity.summary()}"
            stats += f"\n\n[auto]\n{self.auto.format_table()}" if self.auto is not None else ""
            (self.out_dir / "comm_stats.txt").write_text(stats + "\n")
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
