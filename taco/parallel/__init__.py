"""Parallelism on top of `taco.comm`: the mesh, TP/SP mappings and layers, vocab-parallel loss.

`taco.parallel.pipeline` and `taco.parallel.data_parallel` compose them with compressed
pipeline and data parallelism (the 3D mesh, docs/design.md 1.5).
"""

from .cross_entropy import gather_logits, vocab_parallel_cross_entropy
from .data_parallel import build_optimizer, wrap_data_parallel
from .dims import ParallelDims
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from .pipeline import PipelineEngine, PipelineStage, embedding_group, stage_layers, sync_tied_grads
from .regions import TPContext
from .tensor_parallel import apply_tensor_parallel, sync_tp_partial_grads, tp_partial_params

__all__ = [
    "ColumnParallelLinear",
    "ParallelDims",
    "PipelineEngine",
    "PipelineStage",
    "RowParallelLinear",
    "TPContext",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "build_optimizer",
    "copy_to_tensor_parallel_region",
    "embedding_group",
    "gather_from_sequence_parallel_region",
    "gather_logits",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "stage_layers",
    "sync_tied_grads",
    "sync_tp_partial_grads",
    "tp_partial_params",
    "vocab_parallel_cross_entropy",
    "wrap_data_parallel",
]
