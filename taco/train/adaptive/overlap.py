"""`parallel.tp_overlap = "auto"`: split micro-batches into overlapping pieces only where it pays
(docs/design.md 1.3 "Overlap where it pays").

Why this file exists: batch-split overlap (`taco.parallel.batch_split`) hides a TP collective's
time on the wire under another piece's compute. Where there is such time (a capped or slow link),
it wins by a wide margin; where the transfer itself is compute (a fast link, or loopback on the
cores that also compute), there is nothing to hide and the split only adds its cost: twice the
kernel launches on half the rows, and the turns between pieces. Which case a run is in depends on
the link and the machine, so the run measures it, as `compression.when = "auto"` does for codecs.

After `start` steps (the codec policy's own probe and check included), the next `2 * pairs` steps
alternate split and unsplit in pairs, in A B / B A order (drift cancels in the pairs). Each step's
seconds are max-reduced over the whole job (the slowest rank sets the step), so every rank sees the
same numbers and makes the same decision: the split is kept iff the median of the paired gains
(unsplit - split) and their lower bound (`autopolicy.gain_bound`) both clear `margin` of the
unsplit median; otherwise every micro-batch runs whole from then on. One collective, once, at the
decision step; nothing on the hot path.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .autopolicy import gain_bound
from .observers import StepEnd

WARM_STEPS = 3
"""Steps before any probe step: the first steps of a run pay one-off costs (allocations, first calls)."""

MARGIN = 0.02
"""The split is kept when it saves more than this share of the unsplit step (both bounds)."""


class OverlapProbe:
    """The step observer that times split and unsplit steps, then keeps the faster (module doc).

    `set_pieces(k)`: the stage runs its next micro-batches in k pieces (1: whole); `pieces`: the
    split's piece count (`parallel.tp_overlap_chunks`); `start`: steps of this run before the probe;
    `pairs`: split/unsplit pairs timed; `group`: whose step times are max-reduced (None: the world).
    """

    def __init__(
        self,
        set_pieces: Callable[[int], None],
        pieces: int,
        *,
        start: int,
        pairs: int,
        device: torch.device | str,
        group: Any = None,
        margin: float = MARGIN,
        log: bool = False,
    ) -> None:
        if pieces < 2 or pairs < 1 or start < 0:
            raise ValueError(f"overlap probe: pieces {pieces} (>= 2), pairs {pairs} (>= 1), start {start}")
        self.set_pieces, self.pieces, self.start, self.pairs = set_pieces, pieces, start, pairs
        self.device, self.group, self.margin, self.log = torch.device(device), group, margin, log
        self.seen = 0
        """steps of this run that ended"""
        self.times: list[float] = []
        """the probe's step seconds on this rank, in probe order"""
        self.decision: dict[str, Any] | None = None
        """the outcome once decided (`summary`)"""
        self.set_pieces(pieces)  # before the probe: split, the mode asked for

    def split_at(self, i: int) -> bool:
        """Whether probe step i (0-based) runs split: pair j = i // 2 runs (split, whole) for even j,
        (whole, split) for odd j."""
        j, second = divmod(i, 2)
        return (j % 2 == 0) != bool(second)

    def on_step_end(self, end: StepEnd) -> None:
        self.seen += 1
        if self.decision is not None:
            return
        i = self.seen - self.start - 1  # the probe step that just ended (negative: not yet)
        if 0 <= i < 2 * self.pairs:
            self.times.append(end.step_s)
            end.record["tp_overlap_pieces"] = self.pieces if self.split_at(i) else 1
        nxt = i + 1
        if nxt < 2 * self.pairs:
            if nxt >= 0:
                self.set_pieces(self.pieces if self.split_at(nxt) else 1)
            return
        self._decide()

    def _decide(self) -> None:
        t = torch.tensor(self.times, dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        times = t.tolist()
        split = [s for i, s in enumerate(times) if self.split_at(i)]
        whole = [s for i, s in enumerate(times) if not self.split_at(i)]
        gains = [w - s for w, s in zip(whole, split, strict=True)]  # pair by pair
        whole_s, split_s = statistics.median(whole), statistics.median(split)
        need = self.margin * whole_s
        low = gain_bound(gains)
        keep = statistics.median(gains) > need and low > need
        self.set_pieces(self.pieces if keep else 1)
        self.decision = {
            "kept": keep, "pieces": self.pieces if keep else 1, "pairs": self.pairs,
            "split_step_s": split_s, "whole_step_s": whole_s, "gain_low_s": low, "margin": self.margin,
        }  # fmt: skip
        if self.log:
            verdict = f"kept ({self.pieces} pieces)" if keep else "off (micro-batches run whole)"
            print(
                f"[taco] tp_overlap auto: batch-split {verdict}: median step {split_s * 1e3:.1f} ms split vs "
                f"{whole_s * 1e3:.1f} ms whole over {self.pairs} pairs, gain lower bound "
                f"{low * 1e3:+.1f} ms (needs > {need * 1e3:.1f} ms)",
                flush=True,
            )

    def summary(self) -> dict[str, Any]:
        """The decision for summary.json (before it: the probe's state)."""
        if self.decision is not None:
            return dict(self.decision)
        return {"kept": None, "pieces": self.pieces, "probe_steps_done": len(self.times), "pairs": self.pairs}
