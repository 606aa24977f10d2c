"""The [parallel] section: the (dp, pp, tp) mesh and how each axis runs and overlaps its communication.

Why this file exists: the parallel knobs grow with the layouts and overlap modes the trainer runs
(docs/design.md 1.3, 1.5: FSDP2, pipeline schedules, batch-split and chunked TP overlap); they live
apart from the other sections of `schema.py`, on the same `_Section` base (typed coercion,
per-field docs in `metadata["doc"]`, checks in `_check`), as `compression.py` does for codecs.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from taco.parallel.dims import ParallelDims
from taco.train.config.choices import Backend, CommDtype, PPSchedule, TPOverlap
from taco.train.config.schema import _Section


@dataclass
class ParallelConfig(_Section):
    """[parallel]: the (dp, pp, tp) process mesh, TP innermost; world size = dp * pp * tp."""

    SECTION: typing.ClassVar[str] = "parallel"

    dp: int = field(default=1, metadata={
        "doc": "Data-parallel degree (model replicas; gradients all-reduced through compression.dp_codec)."})
    pp: int = field(default=1, metadata={
        "doc": "Pipeline-parallel degree (stages; activations sent through compression.pp_codec)."})
    tp: int = field(default=1, metadata={"doc": (
        "Tensor-parallel degree (Megatron column/row-parallel layers; traffic through "
        "compression.tp_codec).")})
    sp: bool = field(default=False, metadata={"doc": (
        "Sequence parallelism: replace each TP all-reduce by all-gather + reduce-scatter and keep the "
        "norms/dropout sharded along the sequence (arXiv 2205.05198). A no-op when tp = 1.")})
    microbatches: int = field(default=1, metadata={"doc": (
        "Micro-batches per step per data-parallel rank (pipeline depth; gradient accumulation when "
        "pp = 1). The per-rank batch is split into this many equal parts.")})
    zero: bool = field(default=False, metadata={"doc": (
        "Shard the optimizer state over the data-parallel group (ZeRO-1, torch's "
        "ZeroRedundancyOptimizer); only meaningful with dp > 1.")})
    dp_shard: bool = field(default=False, metadata={"doc": (
        "Sharded data parallelism: run the DP axis on FSDP2 (torch fully_shard over the DP group) "
        "instead of DDP, so each rank keeps 1/dp of its TP shard of weights, gradients and optimizer "
        "state; weights are all-gathered through compression.dp_weight_codec (as differences against "
        "a reference every rank holds identically) and gradients reduce-scattered through "
        "compression.dp_grad_codec (docs/design.md 1.5). Excludes parallel.zero and compression.dp_codec.")})
    dp_ranks_per_node: int = field(default=0, metadata={"doc": (
        "With dp_shard: DP ranks per node (consecutive DP ranks share a node). 1 < k < dp makes the "
        "gradient reduce-scatter two-shot: compression.dp_grad_intra_codec inside a node, then "
        "compression.dp_grad_codec across nodes (SDP4Bit, arXiv 2410.15526). 0 = one level.")})
    pp_schedule: PPSchedule = field(default=PPSchedule.ONE_F_ONE_B, metadata={"doc": (
        'Pipeline schedule: "1f1b" (one-forward-one-backward, bounded activation memory) or "gpipe" '
        "(all forwards then all backwards; the reference).")})
    overlap_dp: bool = field(default=True, metadata={"doc": (
        "Reduce compressed DP gradient buckets on a worker thread while backward continues (the DDP "
        "hook returns a pending future); off: inside the hook. Results are identical.")})
    overlap_tp_wgrad: bool = field(default=True, metadata={"doc": (
        "Without SP: compute the column-parallel weight gradients while the input-gradient "
        "all-reduce is in flight (Megatron's overlap); off: after it. Results are identical.")})
    overlap_p2p: bool = field(default=True, metadata={"doc": (
        "Post each 1F1B send/receive pair with the same neighbour that both neighbours make back "
        "to back as one batch (batch_isend_irecv, then waited) instead of one blocking transfer "
        "after the other; results are identical (docs/design.md 1.3).")})
    tp_overlap: TPOverlap = field(default=TPOverlap.NONE, metadata={"doc": (
        '"none": each TP collective stalls the compute after it; "batch-split" (Domino-style): each '
        "micro-batch's blocks run as parallel.tp_overlap_chunks pieces along the batch, interleaved "
        "layer by layer, so that one piece's (compressed) forward collectives travel while the next "
        "piece computes; the same math (docs/design.md 1.3 \"Overlap across pieces\"). With "
        "parallel.dp_shard, FSDP2 shards the stage as one unit (one weight gather and one gradient "
        'reduce-scatter per step, not per block). Not with train.compile yet. "auto": batch-split '
        "where it pays: after the codec policy's probe, tp_overlap_probe_pairs pairs of steps run "
        "split and whole, and the split is kept only if it saves time beyond the pairs' spread "
        '(docs/design.md 1.3 "Overlap where it pays"; a fast link has no wire time to hide). '
        '"chunked" (needs parallel.sp): each SP all-gather+matmul and matmul+reduce-scatter runs as '
        "a ring of parallel.tp steps, one sequence shard's (compressed) hop in flight while another "
        'shard\'s GEMM runs (docs/design.md 1.3 "Chunked sequence-parallel overlap"); not with '
        "train.compile.")})
    tp_overlap_chunks: int = field(default=2, metadata={"doc": (
        'Pieces per micro-batch with tp_overlap = "batch-split" or "auto"; must divide the micro-batch '
        "size.")})
    tp_overlap_probe_pairs: int = field(default=6, metadata={"doc": (
        'With tp_overlap = "auto": pairs of steps (one split, one whole) timed before deciding.')})
    tp_comm_dtype: CommDtype = field(default=CommDtype.AUTO, metadata={"doc": (
        'Dtype of the tensor-parallel collectives\' inputs (before any codec): "auto" = train.dtype '
        "(bf16 training communicates bf16, as Megatron does; under bf16 autocast the backward gradients "
        'would otherwise travel in fp32), "input" = whatever dtype reaches the collective, "fp32" or '
        '"bf16" = cast to that dtype and back.')})
    backend: Backend = field(default=Backend.AUTO, metadata={"doc": (
        'torch.distributed backend: "auto" (nccl when CUDA is available, else gloo), "gloo" or "nccl".')})
    timeout_s: float = field(default=100.0, metadata={"doc": (
        "Seconds a rank waits for its peers in a collective (and when joining the process group) "
        "before the run fails: a rank that hangs, is stopped or dies ends the job after about this "
        "long. Raise it if steps, evaluation or checkpoint writes of one rank can take longer; under "
        "torchrun it also bounds the wait for rank 0 to prepare the data set (run `taco data "
        "prepare` first).")})

    def dims(self) -> ParallelDims:
        """The mesh as `taco.parallel.ParallelDims` (groups not built yet: call `.build()` on every rank)."""
        return ParallelDims(dp=self.dp, pp=self.pp, tp=self.tp, sp=self.sp)

    @property
    def world_size(self) -> int:
        """Number of ranks the run needs."""
        return self.dims().world_size

    def __str__(self) -> str:
        return str(self.dims())  # "DP2-PP2-TP2-SP" (no "-SP" when tp = 1: nothing to shard)

    @property
    def splits_batch(self) -> bool:
        """Whether micro-batches run as tp_overlap_chunks pieces ("batch-split", or "auto" until its
        probe decides)."""
        return self.tp_overlap in (TPOverlap.BATCH_SPLIT, TPOverlap.AUTO)

    def _check(self) -> None:
        for name in ("dp", "pp", "tp", "microbatches", "tp_overlap_chunks", "tp_overlap_probe_pairs"):
            if getattr(self, name) < 1:
                self._fail(name, "must be >= 1")
        if self.dp_shard and self.zero:
            self._fail("zero", "and parallel.dp_shard both shard the optimizer state: keep one")
        k = self.dp_ranks_per_node
        if k < 0 or (k > 0 and self.dp % k):
            self._fail("dp_ranks_per_node", f"must be 0 or divide parallel.dp = {self.dp}")
        if not self.timeout_s > 0:
            self._fail("timeout_s", "must be > 0 (seconds)")
