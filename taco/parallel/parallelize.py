"""Apply the parallelisms to a model, in order: TP/SP -> PP stage -> recompute -> device, compile,
dtype -> DP (DDP or FSDP2) -> the pipeline engine.

Why this file exists: the order matters (the pipeline cuts a TP-sharded model; recompute wraps
blocks before DP wraps them; FSDP2 shards parameters where they already are; process groups are
created in the same order on every rank), so it is written once, here, like torchtitan's
`parallelize_llama`. The trainer (`taco.train.build.build_run`), the 3D tests and the benchmarks
all build through `parallelize`; it knows nothing of configs, only of the options below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from taco import comm
from taco.comm.policy import CodecSpec
from taco.kernels.inductor import fit_cpu_codegen_to_aten

from .batch_split import check_piece_counts
from .data_parallel import wrap_data_parallel
from .dims import ParallelDims
from .dp_sync import DPSync, dp_sync_for
from .pipeline import PipelineEngine, PipelineStage, embedding_group, sync_tied_grads
from .recompute import apply_recompute
from .tags import tp_context
from .tensor_parallel import apply_tensor_parallel, sync_tp_partial_grads


@dataclass
class ParallelOptions:
    """How each parallelism is applied (defaults: the plain reference path)."""

    device: torch.device | str = "cpu"
    """where this rank computes; the model is built and sharded on the CPU, then moved here"""
    comm_dtype: torch.dtype | None = None
    """the dtype TP collectives send (None: as the tensors come)"""
    overlap_wgrad: bool = True
    """TP without SP: weight gradients computed while the input gradient's all-reduce is in flight"""
    recompute: str = "none"
    """activation recompute of the stage's blocks: none, full or selective"""
    compile: bool = False
    """torch.compile each block of the stage (the wgrad overlap is then off)"""
    master_bf16: bool = False
    """cast the stage to bf16 and keep its fp32 init for master weights (`Parallelized.fp32_init`)"""
    dp_shard: bool = False
    """FSDP2 over the DP group instead of DDP"""
    dp_codec: CodecSpec = None
    """DDP's gradient codec (None/"none": DDP's own all-reduce)"""
    dp_codec_options: dict[str, Any] = field(default_factory=dict)
    overlap_dp: bool = True
    """DDP with a codec: buckets reduced by a worker thread while backward goes on"""
    fsdp_codecs: dict[str, CodecSpec] = field(default_factory=dict)
    """FSDP2: weight_codec, grad_codec, grad_intra_codec (`fully_shard_stage`)"""
    dp_ranks_per_node: int = 0
    """FSDP2: DP ranks per node, for the two-level gradient reduction (0: flat)"""
    fsdp_dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None)
    """FSDP2 mixed precision: (param dtype, reduce dtype)"""
    schedule: str = "1f1b"
    """the pipeline schedule (1f1b, gpipe)"""
    overlap_p2p: bool = True
    act_dtype: torch.dtype = torch.float32
    """the dtype activations and their gradients travel in between stages"""
    autocast: bool = False
    """each micro-batch's forward under bf16 autocast"""
    tp_overlap_chunks: int = 1
    """batch-split TP overlap: pieces per micro-batch (1: off; `batch_split.py`)"""
    tp_chunked: bool = False
    """chunked SP overlap: all-gather+matmul and matmul+reduce-scatter as rings (`chunked.py`)"""


@dataclass
class Parallelized:
    """One rank's share of the model, and what runs it."""

    model: nn.Module
    """the TP-sharded model (this stage's layers, the others passed through)"""
    stage: PipelineStage
    module: nn.Module
    """what the forward calls: the stage or its DP wrapper"""
    dp_sync: DPSync
    engine: PipelineEngine
    emb_group: dist.ProcessGroup | None
    """the (first, last) stage pair of tied embeddings, or None"""
    sharded: bool
    """FSDP2 holds 1/dp of every parameter and gradient"""
    fp32_init: dict[int, torch.Tensor]
    """parameter id -> its fp32 init where the stage was cast to bf16 (master weights), else {}"""

    def reduce_grads(self) -> None:
        """After the pipeline's backward: TP partial gradients summed over TP, tied embedding
        copies summed over the (first, last) stage pair. DP reduced inside the backward already."""
        sync_tp_partial_grads(self.model)
        sync_tied_grads(self.stage, self.emb_group)


def _shard_dp(stage: PipelineStage, dims: ParallelDims, opts: ParallelOptions, policy: Any) -> nn.Module:
    group = dims.group("dp")
    if not opts.dp_shard:
        # the DP policy's codec, built once from the config (build_policy); without a policy, the options'
        codec = policy.default_codec if policy is not None else opts.dp_codec
        return wrap_data_parallel(
            stage, group, codec, opts.dp_codec_options, policy=policy, overlap=opts.overlap_dp
        )
    from .fully_sharded import dp_node_groups, fully_shard_stage

    layers = stage.model.layers
    param_dtype, reduce_dtype = opts.fsdp_dtypes
    # batch-split: the stage is one FSDP2 unit, gathered before the pieces start and reduced after
    # their joint backward (docs/design.md 1.3 "Overlap across pieces")
    return fully_shard_stage(
        stage, [layers[i] for i in stage.layers], group, **opts.fsdp_codecs,
        node_groups=dp_node_groups(dims, opts.dp_ranks_per_node), policy=policy,
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, one_unit=stage.pieces > 1,
    )  # fmt: skip


def _compile_and_cast(
    stage: PipelineStage, model: nn.Module, compile: bool, cast: bool
) -> dict[int, torch.Tensor]:
    if compile:  # the TP regions are custom ops (`compiled_ops`): a block is one graph
        if (ctx := tp_context(model)) is not None:
            ctx.overlap_wgrad = False
        fit_cpu_codegen_to_aten()  # inductor's CPU code under a forced ATEN_CPU_CAPABILITY
        for i in stage.layers:
            stage.model.layers[i].compile()
    if not cast:
        return {}
    fp32_init = {id(q): q.detach().clone() for q in stage.parameters()}
    stage.to(torch.bfloat16)  # the same Parameter objects, now bf16
    return fp32_init


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    policies: dict[str, comm.CommPolicy | None],
    opts: ParallelOptions | None = None,
) -> Parallelized:
    """Shard the full `model` (built identically on every rank, on the CPU) over the built mesh
    `dims`, in order; `policies`: the "tp", "pp" and "dp" communication policies. Collective: every
    rank calls it (process groups are created in the same order everywhere)."""
    opts = opts or ParallelOptions()
    model = apply_tensor_parallel(  # 1. TP/SP: layers swapped by the model's plan
        model, None, dims, policies.get("tp"), comm_dtype=opts.comm_dtype, overlap_wgrad=opts.overlap_wgrad
    )
    if opts.tp_chunked:  # chunked SP overlap: the SP collectives become rings
        if not dims.sp or opts.compile or opts.tp_overlap_chunks > 1:
            raise ValueError(
                "chunked TP overlap needs sequence parallelism on, and runs without compile and "
                "without batch-split"
            )
        if (tctx := tp_context(model)) is not None:
            tctx.chunked = True
    stage = PipelineStage(model, dims.pp_rank, dims.pp)  # 2. PP: keep this stage's layers
    if opts.tp_overlap_chunks > 1:  # batch-split overlap: the same piece count on every TP rank
        if opts.compile:
            raise ValueError("batch-split TP overlap does not run with compile yet")
        check_piece_counts(opts.tp_overlap_chunks, dims.group("tp"), opts.device)
        stage.pieces = opts.tp_overlap_chunks
    ctx = tp_context(model)
    apply_recompute([model.layers[i] for i in stage.layers], opts.recompute, ctx)  # 3. before DP wraps
    stage.to(torch.device(opts.device))  # 4. the same weights on every device
    sharded = opts.dp_shard and dims.group("dp") is not None
    # FSDP2 keeps its own mixed precision: no master cast there
    fp32_init = _compile_and_cast(stage, model, opts.compile, opts.master_bf16 and not sharded)
    emb_group = embedding_group(dims, stage.tied)
    module = _shard_dp(stage, dims, opts, policies.get("dp"))  # 5. DP: DDP or FSDP2
    dp_sync = dp_sync_for(module)
    engine = PipelineEngine(  # 6. the schedule that runs micro-batches through the stage
        stage, dims, module=module, dp_sync=dp_sync, policy=policies.get("pp"), schedule=opts.schedule,
        overlap_p2p=opts.overlap_p2p, act_dtype=opts.act_dtype, autocast=opts.autocast, device=opts.device,
    )  # fmt: skip
    return Parallelized(model, stage, module, dp_sync, engine, emb_group, sharded, fp32_init)
