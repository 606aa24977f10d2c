"""The training loop of one rank of a (dp, pp, tp) mesh: steps, evaluation, checkpoints, metrics.

The run is built by `taco.train.build.build_run` (model -> TP/SP -> PP -> DP/FSDP -> optimizer ->
compression policy and its observers); `Trainer.fit()` is the loop over its steps, in the manner of
picotron's train.py: step, let the observers act, evaluate, checkpoint, log. `taco.train.launch`
only starts the ranks and their process group. Rank 0 logs to stdout, `metrics.jsonl` and
TensorBoard. Per step the host reads the loss, the gradient norm and the stop request once (in
`Run.step`); the per-rank byte counters and peak memory are reduced over the job once per logged
window (`taco.train.window`), not per step.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from taco.parallel import ParallelDims
from taco.train import dcp
from taco.train.build import build_run
from taco.train.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from taco.train.config import Config, config_to_toml
from taco.train.metrics import MetricsLogger
from taco.train.perf import device_peak_flops
from taco.train.run import AXES, STAT_KEYS, Run
from taco.train.window import StepRecords


class Trainer:
    """The loop over one rank's `Run`: what `taco train` runs on every rank."""

    def __init__(
        self,
        cfg: Config,
        dims: ParallelDims,
        data_dir: Path,
        log: bool,
        device: torch.device | str = "cpu",
        observers: Sequence[Any] = (),
    ) -> None:
        """`dims`: the built mesh; `log`: this rank writes the outputs (rank 0); `device`: where
        this rank computes; `observers`: extra observers of the run (`build_run`)."""
        self.cfg, self.dims, self.log = cfg, dims, log
        self.run: Run = build_run(cfg, dims, data_dir, device=device, log=log, observers=observers)
        self.out_dir = Path(cfg.train.out_dir)
        t = cfg.train  # reshardable checkpoints (taco.train.dcp), saved asynchronously where asked
        self.dcp = dcp.DCPWriter(self.out_dir, t.checkpoint_async) if t.checkpoint_format == "dcp" else None

    def close(self) -> None:
        """Stop the run's DP hook worker (before the process groups go)."""
        self.run.close()

    # -- checkpoints ------------------------------------------------------------------------------
    def save(self) -> Path:
        if self.dcp is not None:  # reshardable (taco.train.dcp)
            return self.dcp.save(self.run)
        return save_checkpoint(self.out_dir, self.run.iteration, dist.get_rank(), self.run.state())

    def maybe_resume(self) -> None:
        d = find_checkpoint(self.cfg.train.resume, self.out_dir)
        if d is None:
            return
        if dcp.is_dcp(d):  # written at any layout
            st = dcp.load(self.run, d, self.dcp.group if self.dcp is not None else None)
            self.run.iteration = st["step"]
            for site, spec in st.get("site_codecs", {}).items():
                self.run.policy.set_site_codec(site, spec)
        else:
            self.run.load_state(load_checkpoint(d, dist.get_rank(), self.dims.mesh()), d)
        if self.log:
            print(f"resumed from {d} at step {self.run.iteration}", flush=True)

    def _banner(self) -> float:
        """Rank 0 writes config.toml and prints the run's line; returns one device's peak FLOP/s
        (for MFU; 0 on the other ranks, which do not log it)."""
        if not self.log:
            return 0.0
        cfg, run, p, c = self.cfg, self.run, self.cfg.parallel, self.cfg.compression
        (self.out_dir / "config.toml").write_text(config_to_toml(cfg))
        n = sum(q.numel() for q in run.model.parameters())
        print(
            f"[taco] {cfg.model.kind} {self.dims} world={dist.get_world_size()} device={run.device} "
            f"params/rank={n / 1e6:.2f}M microbatches={p.microbatches} schedule={p.pp_schedule} "
            f"codecs: tp={c.tp_codec} pp={c.pp_codec} dp={run.dp_codecs()} out={self.out_dir}",
            flush=True,
        )
        peak, source = device_peak_flops(run.device, run.dtype, cfg.train.peak_tflops)
        print(f"[taco] MFU against {source}", flush=True)
        return peak

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to `train.steps` (resuming first if `train.resume` says so); returns the summary.

        Per step: one optimizer step, the observers' turn (calibration, auto policy, telemetry),
        a metrics record (loss, lr, bytes per axis, MFU, peak memory; written when its window is
        reduced: log, evaluation and checkpoint steps), evaluation every `eval_interval` steps and
        at the end, checkpoints every `checkpoint_interval` steps and at the end. A stop request
        (SIGINT/SIGTERM, `taco.train.stopping`) ends the loop after the step in which any rank saw
        it, with a checkpoint of that step; the summary then names it (`stopped_at`, `checkpoint`).
        Rank 0 writes `config.toml`, `metrics.jsonl`, TensorBoard, `comm_stats.txt` and
        `summary.json` to `train.out_dir`. The summary's bytes are per step and per rank, averaged
        over the job.
        """
        cfg, t, run = self.cfg, self.cfg.train, self.run
        self.maybe_resume()
        logger = MetricsLogger(self.out_dir, self.log, t.steps, start_step=run.iteration)
        peak = self._banner()
        tokens_per_step = t.batch_size * cfg.model.seq_len
        ideal_s = run.flops_per_token * tokens_per_step / (dist.get_world_size() * peak or 1.0)  # at peak
        records = StepRecords(AXES, STAT_KEYS, run.device, logger.write, t.recompute.value != "none")
        t_train, steps_done, start_step, val, saved = 0.0, 0, run.iteration, float("nan"), None
        while run.iteration < t.steps:
            st = run.step()
            step = run.iteration
            t_train += st.seconds
            steps_done += 1
            rec: dict[str, Any] = {
                "step": step,
                "loss": st.loss,
                "lr": run.opt.param_groups[0]["lr"],
                "grad_norm": st.grad_norm,
                "step_s": st.seconds,
                "mfu": ideal_s / st.seconds if peak else 0.0,
            }
            run.end_step(rec)  # the observers act at the boundary, collectively
            if (t.eval_interval and step % t.eval_interval == 0) or step == t.steps:  # 0: at the end
                rec["val_loss"] = val = run.evaluate()
            stop = st.stop and step < t.steps  # SIGINT/SIGTERM: every rank saves this step and stops
            ckpt = step == t.steps or (t.checkpoint_interval and step % t.checkpoint_interval == 0) or stop
            if ckpt:
                saved = self.save()
            records.add(st, rec)
            # the same steps on every rank: the window's one collective, then its records
            if step % t.log_interval == 0 or step == t.steps or "val_loss" in rec or ckpt:
                records.flush()
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
            "steps": run.iteration,
            **({"stopped_at": run.iteration, "checkpoint": str(saved)} if run.iteration < t.steps else {}),
            "resumed_from": start_step,
            "tokens_per_s": tokens_per_step * steps_done / max(t_train, 1e-9),
            **{f"{a}_wire_bytes_per_step": records.wire_sum[a] / n for a in AXES},
            **{f"{a}_raw_bytes_per_step": records.raw_sum[a] / n for a in AXES},
            **self._describe(),
        }
        if self.log:
            self._write_outputs(summary)
        return summary

    def _describe(self) -> dict[str, Any]:
        p, c, wing = self.cfg.parallel, self.cfg.compression, self.run.wing
        return {
            "mesh": str(self.dims),
            "device": str(self.run.device),
            "microbatches": p.microbatches,
            "pp_schedule": str(p.pp_schedule),
            "tp_codec": c.tp_codec,
            "pp_codec": c.pp_codec,
            "dp_codec": self.run.dp_codecs(),
            **({"auto": wing.auto.summary()} if wing.auto is not None else {}),
            **({"ladder": wing.ladder.summary()} if wing.ladder is not None else {}),
            **({"tp_overlap": wing.overlap.summary()} if wing.overlap is not None else {}),
        }

    def _write_outputs(self, summary: dict[str, Any]) -> None:
        """Rank 0: comm_stats.txt (per axis, recompute, fidelity, auto) and summary.json."""
        policies, wing = self.run.policies, self.run.wing
        stats = "\n\n".join(f"[{a}]\n{policies[a].stats.summary()}" for a in AXES)
        if policies["tp"].recompute_stats.sites:  # re-run by activation recompute, not in [tp]
            stats += f"\n\n[tp recompute]\n{policies['tp'].recompute_stats.summary()}"
        if wing.fidelity is not None:  # per-site SQNR of the telemetry steps, the guard's switches
            stats += f"\n\n[tp fidelity]\n{wing.fidelity.summary()}"
        stats += f"\n\n[auto]\n{wing.auto.format_table()}" if wing.auto is not None else ""
        if wing.ladder is not None:  # each site's codec at the end, its moves, its last measure
            stats += f"\n\n[ladder]\n{wing.ladder.format_table()}"
            print(f"[taco] {wing.ladder.format_table()}", flush=True)
        (self.out_dir / "comm_stats.txt").write_text(stats + "\n")
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
