"""The (dp, pp, tp) device mesh: one validated dataclass that builds every process group.

TP is innermost (docs/design.md 1.5): global rank = (dp_rank * pp + pp_rank) * tp + tp_rank, so
the ranks of one TP group are contiguous and share the fastest links.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass
class ParallelDims:
    """Degrees of parallelism. `sp` (sequence parallelism) needs tp > 1 to mean anything."""

    dp: int = 1
    """Data-parallel replicas."""
    pp: int = 1
    """Pipeline stages."""
    tp: int = 1
    """Tensor-parallel ranks (innermost)."""
    sp: bool = False
    """Sequence parallelism: shard norms/dropout along the sequence inside each TP group."""
    groups: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for k in ("dp", "pp", "tp"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{k} must be a positive int, got {v!r}")
        if self.sp and self.tp == 1:
            self.sp = False  # nothing to shard: SP is a no-op without TP

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def __str__(self) -> str:
        return f"DP{self.dp}-PP{self.pp}-TP{self.tp}" + ("-SP" if self.sp else "")

    def mesh(self) -> dict[str, int]:
        """The degrees as checkpoints record them: {"dp", "pp", "tp", "sp" (0/1)}."""
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp, "sp": int(self.sp)}

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Global rank -> (dp_rank, pp_rank, tp_rank)."""
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank_of(self, dp: int, pp: int, tp: int) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    def build(self, timeout: datetime.timedelta | None = None) -> ParallelDims:
        """Create the TP, PP and DP groups (collective: every rank must call it). Returns self.

        `timeout`: how long their collectives wait for a peer. Give the one of init_process_group:
        None is torch's default for new groups (30 min on gloo), not the default group's timeout."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build() needs torch.distributed initialised first")
        world = dist.get_world_size()
        if world != self.world_size:
            raise ValueError(
                f"dp*pp*tp = {self.dp}*{self.pp}*{self.tp} = {self.world_size} but the world size is "
                f"{world}: change parallel.dp/pp/tp or the number of ranks"
            )
        me = dist.get_rank()
        d, p, t = self.coords(me)
        R = range
        axes = {
            "tp": [[self.rank_of(a, b, c) for c in R(self.tp)] for a in R(self.dp) for b in R(self.pp)],
            "pp": [[self.rank_of(a, b, c) for b in R(self.pp)] for a in R(self.dp) for c in R(self.tp)],
            "dp": [[self.rank_of(a, b, c) for a in R(self.dp)] for b in R(self.pp) for c in R(self.tp)],
        }
        for axis, lists in axes.items():
            for ranks in lists:  # every rank creates every group, in the same order
                g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if me in ranks:
                    self.groups[axis] = g
                    self.groups[axis + "_ranks"] = ranks
        self.groups["coords"] = (d, p, t)
        return self

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of `axis` ("tp", "pp", "dp") containing this rank (None if size 1)."""
        if "coords" not in self.groups:
            raise RuntimeError("call ParallelDims.build() before asking for groups")
        return self.groups[axis]

    def ranks(self, axis: str) -> list[int]:
        return self.groups[axis + "_ranks"]

    @property
    def tp_rank(self) -> int:
        return self.groups["coords"][2] if self.groups else 0

    @property
    def pp_rank(self) -> int:
        return self.groups["coords"][1] if self.groups else 0

    @property
    def dp_rank(self) -> int:
        return self.groups["coords"][0] if self.groups else 0
