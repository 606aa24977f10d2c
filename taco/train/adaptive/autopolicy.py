"""`compression.when = "auto"`: compress a TP site only where it pays (docs/design.md 1.4).

Why this file exists: a compressed collective trades codec time for wire time, and which one wins
depends on the link, the message size and the codec's speed on this machine; so the run measures it.
During the first `auto_warmup_steps` steps (compressed as configured) its observer of the TP policy
learns each site's collective, message shape, dtype, codec and calls per step. At that step boundary
every distinct message is timed on the real TP group, plain and compressed (`taco.comm`, so the
codec's in-training speed counts), a few interleaved repeats after a warm-up. Per rank: the medians,
and a lower bound of the gain from the repeats' paired differences (plain - compressed, each pair
timed back to back; `gain_bound`); max-reduced over the TP group (the bound min-reduced), so every
rank of it decides the same. A site keeps its codec iff the gain clears `auto_margin` of the plain
time both by the medians and by that bound: a gain inside the probe's own spread (a fast link, where
plain and compressed calls cost about the same) keeps the plain collective. The others get
`set_site_codec(site, "none")`.

The decision predicts the step time: the measured one before it plus, per site, calls per step x the
change of that site's collective time. When the median of the next `auto_check_steps` steps is slower
than that by more than `auto_tolerance` on any rank, every TP group probes and decides again (at most
`auto_max_redecisions` times). Rank 0 prints the table; `summary()` goes to summary.json and
`format_table()` to comm_stats.txt.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from taco import comm
from taco.codec import Codec
from taco.comm import CommPolicy
from taco.comm.stats import sync_device
from taco.parallel.regions import SEQ_DIM

from .observers import StepEnd

PROBED_OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Message:
    """One site's collective as the observer saw it, with the codec the configuration gives it."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    codec: Codec

    @property
    def nbytes(self) -> int:
        """Input bytes of one call."""
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class Timing:
    """Seconds of one call of a site's collective, plain and with its codec (max over the TP group);
    `gain_low_s`: a lower bound of the gain per call, plain - compressed, from the probe's repeats
    (`gain_bound`; min over the TP group), None where no spread is known (then the medians decide)."""

    plain_s: float
    compressed_s: float
    gain_low_s: float | None = None

    def seconds(self, compress: bool) -> float:
        return self.compressed_s if compress else self.plain_s

    def pays(self, margin: float) -> bool:
        """Whether compression wins by `margin` of the plain time, by the medians and by the bound."""
        need = self.plain_s * margin
        by_medians = self.plain_s - self.compressed_s > need
        return by_medians and (self.gain_low_s is None or self.gain_low_s > need)


GAIN_LEVEL = 0.10
"""`gain_bound`: the chance that the true median gain lies below the bound (one-sided, 90%)."""


def gain_bound(diffs: list[float], level: float = GAIN_LEVEL) -> float:
    """A distribution-free lower bound of the median of paired differences: the k-th smallest, k the
    largest with P(Binomial(n, 1/2) < k) <= `level` (at least the smallest; n = 7: the 2nd, 94%)."""
    d, n = sorted(diffs), len(diffs)
    k, below = 1, 0.5**n  # P(X <= k - 1) for k = 1
    while k < n:
        nxt = below + math.comb(n, k) * 0.5**n  # P(X <= k)
        if nxt > level:
            break
        k, below = k + 1, nxt
    return d[k - 1]


def decide(timings: Mapping[str, Timing], margin: float) -> dict[str, bool]:
    """Per site: True (keep the codec) iff compression pays by `margin` (`Timing.pays`)."""
    return {s: t.pays(margin) for s, t in timings.items()}


def predict_step_s(
    reference_s: float,
    calls: Mapping[str, float],
    timings: Mapping[str, Timing],
    before: Mapping[str, bool],
    after: Mapping[str, bool],
) -> float:
    """Step seconds with choices `after`, from a step of `reference_s` measured with choices `before`:
    per site, calls per step x (its time under the new choice - its time under the old one)."""
    delta = sum(
        calls.get(s, 0.0) * (t.seconds(after[s]) - t.seconds(before.get(s, True))) for s, t in timings.items()
    )
    return reference_s + delta


def disagrees(measured_s: float, predicted_s: float, tolerance: float) -> bool:
    """Whether a measured step time contradicts the prediction: slower by more than `tolerance` (of
    the measurement). Faster is no contradiction: the decision paid at least what it promised (the
    warm-up steps of the reference are often slower than the steady state)."""
    return measured_s - predicted_s > tolerance * measured_s


class SiteRecorder:
    """The observer: each site's first compressed message and its calls while `counting`."""

    def __init__(self) -> None:
        self.messages: dict[str, Message] = {}
        self.calls: dict[str, int] = {}
        self.counting = True

    def __call__(self, site: str, op: str, x: torch.Tensor, codec: Codec | None) -> None:
        if not self.counting:
            return
        self.calls[site] = self.calls.get(site, 0) + 1  # host-side counters only: no device work
        if codec is not None and op in PROBED_OPS and site not in self.messages:
            self.messages[site] = Message(op, tuple(x.shape), x.dtype, codec)


class AutoPolicy:
    """`compression.when = "auto"` for one rank's TP policy (see the module doc): an observer
    (`taco.train.adaptive.observers`) that records messages and decides at step ends."""

    def __init__(
        self,
        policy: CommPolicy,
        group: dist.ProcessGroup | None,
        device: torch.device,
        cfg: Any,
        log: bool,
        after: Any = None,
    ) -> None:
        """`cfg`: the [compression] section (auto_* fields); `log`: this rank prints the tables;
        `after`: something whose `sampling` is True while another observer is still choosing the
        sites' codecs (calibration): the warm-up starts after it."""
        self.policy, self.group, self.device, self.log = policy, group, torch.device(device), log
        self.warmup, self.margin, self.repeats = cfg.auto_warmup_steps, cfg.auto_margin, cfg.auto_repeats
        self.check_steps, self.tolerance = cfg.auto_check_steps, cfg.auto_tolerance
        self.max_redecisions = cfg.auto_max_redecisions
        self.recorder = SiteRecorder()
        self.after = after
        # probes go through a policy of their own (its statistics are not the run's) that shares the
        # run's buffer cache, slicing and size checks, so a probe allocates as training does
        self.probe_policy = CommPolicy(
            codec=None, slices=policy.slices, min_slice_bytes=policy.min_slice_bytes,
            all_reduce_algo=policy.all_reduce_algo, check_sizes=policy.check_sizes, nonfinite_check_every=0,
        )  # fmt: skip
        self.probe_policy.buffers = policy.buffers
        self.measure: Callable[[Message], Timing] = self.time_message
        """this rank's timing of one message (tests replace it to inject timings)"""
        self.steps = 0
        self.phase = "observe"  # -> "check" after each decision -> "done"
        self.before_s: list[float] = []
        self.after_s: list[float] = []
        self.choice: dict[str, bool] = {}
        self.timings: dict[str, Timing] = {}
        self.calls_per_step: dict[str, float] = {}
        self.predicted_s = 0.0
        self.redecisions = 0
        self.history: list[dict[str, Any]] = []

    # -- measuring ------------------------------------------------------------------------------
    def _call(self, m: Message, x: torch.Tensor, codec: Codec | None) -> None:
        world = dist.get_world_size(self.group)
        kw: dict[str, Any] = dict(group=self.group, codec=codec, policy=self.probe_policy)
        if m.op == "all_reduce":
            comm.all_reduce(x, **kw)
            return
        dims = [d for d in (SEQ_DIM, *range(x.dim())) if d < x.dim()]
        d = next((d for d in dims if x.shape[d] % world == 0), 0) if m.op == "reduce_scatter" else dims[0]
        (comm.all_gather if m.op == "all_gather" else comm.reduce_scatter)(x, dim=d, **kw)

    def time_message(self, m: Message) -> Timing:
        """This rank's median seconds of `m`'s collective, plain and compressed, and the bound of the
        gain from the pairs (interleaved repeats, plain then compressed, after one warm-up call of
        each, the ranks aligned by a barrier before each call)."""
        g = torch.Generator(device=self.device).manual_seed(0)
        x = torch.randn(m.shape, generator=g, device=self.device, dtype=torch.float32).to(m.dtype)
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(self.repeats + 1):
            for compress in (False, True):
                dist.barrier(group=self.group)
                sync_device(self.device)
                t0 = time.perf_counter()
                self._call(m, x, m.codec if compress else None)
                sync_device(self.device)
                if i:  # the first round warms buffers and kernels up
                    times[compress].append(time.perf_counter() - t0)
        diffs = [p - c for p, c in zip(times[False], times[True])]
        return Timing(statistics.median(times[False]), statistics.median(times[True]), gain_bound(diffs))

    def probe(self) -> dict[str, Timing]:
        """Per site: the timing of its message, each distinct message timed once, max over the TP group."""
        msgs = self.recorder.messages if self.group is not None else {}  # tp = 1: nothing travels
        keys = list(dict.fromkeys((m.op, m.shape, m.dtype, m.codec.spec) for m in msgs.values()))
        first = {(m.op, m.shape, m.dtype, m.codec.spec): m for m in reversed(msgs.values())}
        local = [self.measure(first[k]) for k in keys]
        # the bound travels negated (inf: none known), so one MAX reduction takes its minimum
        bounds = [-math.inf if x.gain_low_s is None else -x.gain_low_s for x in local]
        rows = [[x.plain_s, x.compressed_s, b] for x, b in zip(local, bounds)]
        t = torch.tensor(rows, dtype=torch.float64, device=self.device)
        if self.group is not None and t.numel():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        worst = {k: Timing(p, c, None if math.isinf(g) else -g) for k, (p, c, g) in zip(keys, t.tolist())}
        return {s: worst[(m.op, m.shape, m.dtype, m.codec.spec)] for s, m in msgs.items()}

    # -- deciding -------------------------------------------------------------------------------
    def on_message(self, site: str, op: str, x: torch.Tensor, codec: Codec | None, step: int) -> None:
        self.recorder(site, op, x, codec)

    def on_step_end(self, end: StepEnd) -> None:
        """Observe, decide at the end of the warm-up, check the prediction after."""
        rec = end.record
        if self.phase == "observe" and self.after is not None and self.after.sampling:
            # compression.calibrate is still choosing the sites' codecs: the warm-up (and the codec
            # each site is probed with) starts from the steps after its choice
            self.recorder.messages.clear()
            self.recorder.calls.clear()
            return
        self.steps += 1
        step_s = float(end.step_s)
        if self.phase == "observe":
            if self.steps > 1:  # the first step carries the start-up cost
                self.before_s.append(step_s)
            if self.steps >= self.warmup:
                self.recorder.counting = False
                n = self.steps
                self.calls_per_step = {s: c / n for s, c in self.recorder.calls.items()}
                self.choice = dict.fromkeys(self.recorder.messages, True)
                self._decide(rec, "initial", statistics.median(self.before_s or [step_s]))
        elif self.phase == "check":
            self.after_s.append(step_s)
            if len(self.after_s) >= self.check_steps:
                self._check(rec)

    def _decide(self, rec: dict[str, Any], reason: str, reference_s: float) -> None:
        t0 = time.perf_counter()
        timings = self.probe()
        probe_s = time.perf_counter() - t0  # outside every timed step: reported, never hidden
        new = decide(timings, self.margin)
        self.predicted_s = predict_step_s(reference_s, self.calls_per_step, timings, self.choice, new)
        for site, keep in new.items():
            if keep != self.choice.get(site, True):
                self.policy.set_site_codec(site, self.recorder.messages[site].codec if keep else "none")
        self.timings, self.choice = timings, new
        self.history.append(dict(step=self.steps, reason=reason, reference_step_s=reference_s,
                                 predicted_step_s=self.predicted_s, measured_step_s=None, probe_s=probe_s,
                                 compressed_sites=sum(new.values()), sites=len(new)))  # fmt: skip
        rec["auto_compressed_sites"] = sum(new.values())
        rec["auto_predicted_step_s"] = self.predicted_s
        self.phase, self.after_s = "check", []
        if self.log:
            print(self.format_table(), flush=True)

    def _check(self, rec: dict[str, Any]) -> None:
        """Compare the measured step time with the prediction; re-probe (collectively) if any rank's
        measurement contradicts it and re-decisions are left."""
        measured = statistics.median(self.after_s)
        self.history[-1]["measured_step_s"] = measured
        rec["auto_measured_step_s"] = measured
        bad = disagrees(measured, self.predicted_s, self.tolerance)
        flag = torch.tensor([float(bad)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank takes the same branch
        bad = bool(flag.item())  # one host sync, at a step boundary after the check steps
        again = bad and self.redecisions < self.max_redecisions
        if self.log:
            verdict = "re-deciding" if again else ("disagrees" if bad else "agrees")
            print(f"[taco] auto policy: step {measured * 1e3:.1f} ms measured over {len(self.after_s)} "
                  f"steps, {self.predicted_s * 1e3:.1f} ms predicted: {verdict}", flush=True)  # fmt: skip
        if again:
            self.redecisions += 1
            self._decide(rec, f"re-decision {self.redecisions}", measured)
        else:
            self.phase = "done"

    # -- reporting ------------------------------------------------------------------------------
    def site_rows(self) -> dict[str, dict[str, Any]]:
        """Per site: the numbers behind its current decision."""
        out = {}
        for site, t in self.timings.items():
            m = self.recorder.messages[site]
            out[site] = dict(op=m.op, bytes=m.nbytes, calls_per_step=self.calls_per_step.get(site, 0.0),
                             codec=m.codec.spec, plain_ms=t.plain_s * 1e3, compressed_ms=t.compressed_s * 1e3,
                             gain_low_ms=None if t.gain_low_s is None else t.gain_low_s * 1e3,
                             compressed=self.choice[site])  # fmt: skip
        return out

    def summary(self) -> dict[str, Any]:
        """The decisions and the per-site numbers (summary.json's "auto")."""
        return dict(margin=self.margin, redecisions=self.redecisions, decisions=self.history,
                    sites=self.site_rows())  # fmt: skip

    def format_table(self) -> str:
        """The latest decision as text: one line per site, the numbers behind it."""
        if not self.history:
            return "auto policy: no decision yet"
        lines = [
            f"[taco] auto policy ({h['reason']}, after step {h['step']}): {h['compressed_sites']} of "
            f"{h['sites']} sites compressed; {h['reference_step_s'] * 1e3:.1f} ms -> "
            f"{h['predicted_step_s'] * 1e3:.1f} ms predicted, {h['measured_step_s'] * 1e3:.1f} ms measured"
            for h in self.history[:-1]
        ]
        h = self.history[-1]
        lines += [
            f"[taco] auto policy ({h['reason']}, after step {h['step']}): {h['compressed_sites']} of "
            f"{h['sites']} TP sites compressed (margin {self.margin:.0%}); step "
            f"{h['reference_step_s'] * 1e3:.1f} ms measured -> "
            f"{h['predicted_step_s'] * 1e3:.1f} ms predicted (probe {h['probe_s']:.2f} s)",
            f"  {'site':<28} {'op':<14} {'bytes':>9} {'calls':>5} {'plain ms':>9} {'codec ms':>9} "
            f"{'gain >= ms':>10}  decision",
        ]
        for site, r in self.site_rows().items():
            choice = r["codec"] if r["compressed"] else "none"
            low = "-" if r["gain_low_ms"] is None else f"{r['gain_low_ms']:.3f}"
            lines.append(
                f"  {site:<28} {r['op']:<14} {r['bytes']:>9} {r['calls_per_step']:>5.1f} "
                f"{r['plain_ms']:>9.3f} {r['compressed_ms']:>9.3f} {low:>10}  {choice}"
            )
        return "\n".join(lines)
