"""Blocks of logical tensors through stock torch.distributed.checkpoint (DCP).

Why this file exists: DCP reshards DTensors and ShardedTensors, whose placements describe where a
rank's shard sits. Our blocks (a fused q/k/v cut into its logical q, k and v, vocabulary rows
without the tp padding, FSDP2 rows of a TP shard) have no placement, so each travels as a `Chunk`
(its tensor, offsets and the logical size: DCP's checkpointable protocol), written and read by
the two planners here. `dcp.py` decides which blocks a run has; this is how DCP moves them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, TensorWriteData, WriteItem, WriteItemType

from taco.train.errors import CheckpointError


class Chunk:
    """This rank's block ``tensor`` of a logical tensor of shape ``size``, at ``offsets``: DCP's
    checkpointable protocol (what DTensor implements), for blocks no placement describes."""

    def __init__(self, tensor: torch.Tensor, offsets: tuple[int, ...], size: tuple[int, ...]) -> None:
        self.tensor, self.offsets, self.global_size = tensor, torch.Size(offsets), torch.Size(size)

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=self.offsets, sizes=self.tensor.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        data = TensorWriteData(
            chunk=self._chunk(),
            properties=TensorProperties.create_from_tensor(self.tensor),
            size=self.global_size,
        )
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD, tensor_data=data)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.tensor


class BlockSavePlanner(DefaultSavePlanner):
    """Writes `Chunk`s as the blocks they are."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.tensor if isinstance(obj, Chunk) else super().lookup_object(index)


class BlockLoadPlanner(DefaultLoadPlanner):
    """Reads blocks into `Chunk`s; refuses a logical tensor of another shape, or one the checkpoint
    does not cover where this rank needs it (DCP alone would leave such a block as it was)."""

    def __init__(self, where: Path) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.where = where

    def set_up_planner(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, Chunk)}
        super().set_up_planner(state_dict, *args, **kwargs)  # its meta-tensor pass drops other types
        state_dict.update(chunks)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.tensor if isinstance(obj, Chunk) else super().lookup_tensor(index)

    def create_local_plan(self) -> LoadPlan:
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if (
                isinstance(obj, Chunk)
                and isinstance(md, TensorStorageMetadata)
                and md.size != obj.global_size
            ):
                raise CheckpointError(
                    f"{self.where}: {fqn} has shape {list(md.size)} in the checkpoint but "
                    f"{list(obj.global_size)} in this model: the model sizes differ; resume with "
                    "the [model] sizes of the run that wrote it (its config.toml)"
                )
        plan = super().create_local_plan()
        covered: dict[str, int] = {}
        for item in plan.items:
            fqn = item.dest_index.fqn
            covered[fqn] = covered.get(fqn, 0) + math.prod(int(n) for n in item.lengths)
        for fqn, obj in self.state_dict.items():
            want = obj.tensor.numel() if isinstance(obj, Chunk) else 0
            if want and covered.get(fqn, 0) != want:
                raise CheckpointError(
                    f"{self.where} does not hold all of {fqn} at {list(obj.offsets)} + "
                    f"{list(obj.tensor.shape)} (partial or damaged checkpoint); resume from another one"
                )
        return plan
