"""Parallelism on top of `taco.comm`: the mesh, TP/SP mappings and layers, vocab-parallel loss.

`taco.parallel.pipeline` and `taco.parallel.data_parallel` (3D composition) build on these.
"""

from .cross_entropy import gather_logits, vocab_parallel_cross_entropy
from .dims import ParallelDims
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    TPContext,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from .tensor_parallel import apply_tensor_parallel, sync_tp_partial_grads, tp_partial_params

__all__ = [
    "ColumnParallelLinear",
    "ParallelDims",
    "RowParallelLinear",
    "TPContext",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_logits",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "sync_tp_partial_grads",
    "tp_partial_params",
    "vocab_parallel_cross_entropy",
]
