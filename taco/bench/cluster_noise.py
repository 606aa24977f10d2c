"""The noise floor of `taco bench cluster`: an A/A control and a 95% interval for every speedup.

Why this file exists: on a shared machine two runs of the same job differ by several percent, so a
speedup read off one pair of runs can be noise (docs/design.md 3, "noise"). With `--repeats N` the
sweep runs every (mode, codec) N times in alternating order, and the baseline twice per round: as
itself (A) and as the control `CONTROL` (A', the same job under another label). Per round i and
row, the ratio baseline_i / run_i of the rounds' mean step times is one paired sample (runs of one
round ran next to each other, so slow drift of the box cancels in it); the row's interval is the
Student-t 95% interval of the mean of log(ratio) over the rounds, mapped back with exp. The noise
floor of a link is the A/A control's half-width; the sweep's is the largest over its links. A row
whose interval contains 1.0 measured no effect.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from .cluster_records import LinkResult

CONTROL = "none (A/A)"
"""the label of the baseline's second run in each round: an A/A control, never a codec"""

# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (then the normal's 1.96)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t95(dof: int) -> float:
    """The two-sided 95% quantile of Student's t with `dof` degrees of freedom."""
    if dof < 1:
        raise ValueError(f"a t interval needs at least 2 samples, got {dof + 1}")
    return _T95[dof - 1] if dof <= len(_T95) else 1.96


def round_means(results: list[LinkResult], warmup: int) -> dict[tuple, list[float]]:
    """Per (mode, rate, codec): the mean timed step seconds of each of its runs, in run order (the
    rounds of `--repeats`; the uncapped sets before and after a sweep continue the count)."""
    out: dict[tuple, list[float]] = defaultdict(list)
    for res in results:
        for run in res.runs:
            steps = run.steps[warmup:] or run.steps
            out[(run.mode, res.rate_mbit, run.codec)].append(statistics.fmean(s.step_s for s in steps))
    return dict(out)


def ratio_interval(base: list[float], run: list[float]) -> tuple[float, float] | None:
    """The 95% interval of the speedup base / run from paired rounds (None with fewer than two)."""
    n = min(len(base), len(run))
    if n < 2:
        return None
    logs = [math.log(b / r) for b, r in zip(base[:n], run[:n])]
    mean, half = statistics.fmean(logs), t95(n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(mean - half), math.exp(mean + half)


def half_width(ci: tuple[float, float]) -> float:
    """Half the width of a speedup interval (0.02: +-2%)."""
    return (ci[1] - ci[0]) / 2


def no_effect(ci: tuple[float, float] | None) -> bool:
    """Whether an interval says "no effect measured" (it contains 1.0)."""
    return ci is not None and ci[0] <= 1.0 <= ci[1]


def noise_floors(rounds: dict[tuple, list[float]]) -> dict[tuple, float]:
    """Per (mode, rate) with a control: the A/A speedup's 95% half-width."""
    out = {}
    for (mode, rate, codec), times in rounds.items():
        if codec == CONTROL and (base := rounds.get((mode, rate, "none"))):
            ci = ratio_interval(base, times)
            if ci is not None:
                out[(mode, rate)] = half_width(ci)
    return out
