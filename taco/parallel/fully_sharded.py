"""Sharded data parallelism: FSDP2 over the DP group, weights and gradients through our codecs.

Why this file exists: with `parallel.dp_shard = true` the DP axis of the mesh (docs/design.md 1.5)
runs torch's FSDP2 (`fully_shard`) instead of DDP, so every rank keeps only 1/dp of its TP shard
of the weights, gradients and AdamW state. FSDP2 takes user communication per parameter group
(`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`); the two classes here plug
`taco.comm` and `taco.codec` into it, SDP4Bit-style (arXiv 2410.15526):

- `DiffAllGather` (forward, site `dp.weight`): weights travel as quantized DIFFERENCES against a
  reference. Per FSDP parameter group every DP rank holds the same fp32 reference R of the whole
  gathered flat buffer ([N*m], rank j's slot R_j = [j*m, (j+1)*m)). The first call sends the
  weights exactly (plain all-gather) and sets R = those weights. Every later call, rank j sends
  the bytes b_j = E(cast(x_j - R_j)) (x_j: its flat shard in the all-gather dtype, E: the weight
  codec); every rank receives every b_j (own included), decodes them, and sets
  R_j <- R_j + fp32(D(b_j)) for all j, in fp32, elementwise; the gathered weights FSDP computes
  with are cast(R). R is therefore a function of the exchanged bytes only: identical on every
  rank of the DP group (same bytes, same deterministic decode, same fp32 adds), and its error
  does not accumulate: the next difference x - R carries the previous quantization error, so
  |x_j - R_j| after a call is one quantization error of the latest difference (error feedback),
  not a sum of them. Memory: R costs one fp32 copy of the unsharded parameters of each group.
- `CodecReduceScatter` (backward, site `dp.grad`): the flat gradient buffer is reduce-scattered
  through `taco.comm.reduce_scatter` (encode the N-1 foreign chunks -> all-to-all -> decode and
  sum in fp32, own chunk exact) with a Hadamard + integer codec ("int8-hadamard",
  "int4-hadamard"). With `ranks_per_node = k` (1 < k < N) it is two-shot: an intra-node
  reduce-scatter over the k ranks of a node (`dp.grad.intra`, e.g. 8-bit) leaves each local rank
  l the node's partial sums of the chunks {n*k + l}, then an inter-node reduce-scatter over the
  N/k ranks with local index l (`dp.grad.inter`, e.g. 4-bit) gives rank r its chunk r.
Codec "none" in either direction is the plain collective through `taco.comm` (bit-identical).
Payloads are uint8 on the wire (gloo has no fp8 type); bytes are counted in the DP policy's
statistics like every other site (raw = the plain collective's bytes in the input dtype).

Micro-batches: `set_gradient_sync(module, last)` before each backward keeps the gathered
weights and accumulates unsharded gradients until the step's last backward, so each step
gathers each group's weights once and reduce-scatters its gradients once (forward and backward
see the same weights). Checkpoints hold local shards (`checkpoint_state` / `load_checkpoint_state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from taco import comm
from taco.codec import Codec, CodecSpec, build_codec

from .dims import ParallelDims
from .torch_private import AllGather, ReduceScatter, local_tensor

WEIGHT_SITE = "dp.weight"
GRAD_SITE = "dp.grad"


class _Alloc:
    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class DiffAllGather(_Alloc, AllGather):
    """FSDP2 all-gather of one parameter group: weight differences against a shared reference."""

    def __init__(self, codec: Codec | None, policy: comm.CommPolicy | None, site: str = WEIGHT_SITE) -> None:
        self.codec, self.policy, self.site = codec, policy, site
        self.ref: torch.Tensor | None = None
        """fp32 [N*m]: the reference of every rank's slot, the same on every rank (None: not yet sent)"""
        self.exact = False
        """True: plain gathers that leave the reference alone (evaluation, see `exact_gathers`)"""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        # input_tensor is this rank's slot of output_tensor: read it before writing the output.
        plain = self.codec is None or self.exact or not input_tensor.is_floating_point()  # e.g. fp8 bytes
        if plain or self.ref is None or self.ref.numel() != output_tensor.numel():
            y = comm.all_gather(input_tensor, group, codec=None, site=self.site, policy=self.policy)
            if not plain:
                self.ref = y.float()  # exact weights: the first reference
            output_tensor.copy_(y)
            return None
        m, r = input_tensor.numel(), dist.get_rank(group)
        diff = (input_tensor.float() - self.ref[r * m : (r + 1) * m]).to(input_tensor.dtype)  # [m]
        dec = comm.all_gather(diff, group, codec=self.codec, site=self.site, policy=self.policy)  # [N*m]
        self.ref += dec.float()  # every rank adds the same decoded bytes
        output_tensor.copy_(self.ref)
        return None


class CodecReduceScatter(_Alloc, ReduceScatter):
    """FSDP2 reduce-scatter of one parameter group's flat gradients, flat or two-shot (per node)."""

    def __init__(
        self,
        codec: Codec | None,
        policy: comm.CommPolicy | None,
        *,
        intra_codec: Codec | None = None,
        node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup, int] | None = None,
        site: str = GRAD_SITE,
    ) -> None:
        """`node_groups`: (intra-node group, inter-node group, ranks per node k) or None (flat)."""
        self.codec, self.intra_codec, self.policy, self.site = codec, intra_codec, policy, site
        self.node_groups = node_groups

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        n = dist.get_world_size(group)
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"CodecReduceScatter supports SUM and AVG, got {op}")
        if self.node_groups is None:
            y = comm.reduce_scatter(input_tensor, group, codec=self.codec, site=self.site, policy=self.policy)
        else:
            intra, inter, k = self.node_groups
            m = input_tensor.numel() // n
            # chunk j = (node j // k, local j % k): local rank l first gets every node's chunk l
            by_local = input_tensor.view(n // k, k, m).transpose(0, 1).reshape(-1)  # [k * N/k * m]
            part = comm.reduce_scatter(
                by_local, intra, codec=self.intra_codec, site=self.site + ".intra", policy=self.policy
            )  # [N/k * m]: this node's sums of chunks (n', l) for every node n'
            y = comm.reduce_scatter(
                part, inter, codec=self.codec, site=self.site + ".inter", policy=self.policy
            )  # [m]: the sum of chunk r over every rank
        if op == dist.ReduceOp.AVG:
            y.div_(n)
        output_tensor.copy_(y)
        return None


def dp_node_groups(dims: ParallelDims, ranks_per_node: int) -> tuple[Any, Any, int] | None:
    """(intra-node group, inter-node group, k) of this rank's DP group, nodes of k consecutive DP
    ranks; None when flat (k in {0, 1, dp}). Collective: every rank creates every group in order."""
    k, n = ranks_per_node, dims.dp
    if k in (0, 1) or k >= n:
        return None
    if n % k:
        raise ValueError(f"parallel.dp = {n} is not divisible by parallel.dp_ranks_per_node = {k}")
    me, mine = dist.get_rank(), [None, None]
    for p in range(dims.pp):
        for t in range(dims.tp):
            dp_ranks = [dims.rank_of(d, p, t) for d in range(n)]
            lists = [(0, dp_ranks[i : i + k]) for i in range(0, n, k)]  # one node each
            lists += [(1, dp_ranks[lo::k]) for lo in range(k)]  # one local index each
            for which, ranks in lists:
                g = dist.new_group(ranks)
                if me in ranks:
                    mine[which] = g
    return mine[0], mine[1], k


def fully_shard_stage(
    stage: nn.Module,
    blocks: Iterable[nn.Module],
    group: dist.ProcessGroup | None,
    *,
    weight_codec: CodecSpec = None,
    grad_codec: CodecSpec = None,
    grad_intra_codec: CodecSpec = None,
    node_groups: tuple[Any, Any, int] | None = None,
    policy: comm.CommPolicy | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    one_unit: bool = False,
) -> nn.Module:
    """FSDP2 over `group`: each of `blocks` its own parameter group, then `stage` (the rest); returns
    `stage` (now an FSDPModule; the module itself when the group is None: dp == 1).

    Parameters must already be on their device (FSDP shards them where they are); each rank shards
    the tensors it holds (its TP shard) along dim 0. `grad_intra_codec` None: `grad_codec`.
    `one_unit`: the whole stage is one parameter group (batch-split TP overlap: FSDP2's hooks then
    sit on the stage only, so they run once per micro-batch on the caller's thread, not once per
    piece on a piece's worker; docs/design.md 1.3 "Overlap across pieces").
    """
    if group is None or dist.get_world_size(group) == 1:
        return stage
    device = next(stage.parameters()).device
    mesh = DeviceMesh.from_group(group, device.type)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    units = [] if one_unit else [b for b in blocks if any(True for _ in b.parameters())]
    units.append(stage)
    for u in units:  # reshard_after_forward=False: one gather per step (see set_gradient_sync)
        fully_shard(u, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    wc, gc = build_codec(weight_codec), build_codec(grad_codec)
    ic = build_codec(grad_intra_codec) if grad_intra_codec not in (None, "") else gc
    for u in units:
        u.set_custom_all_gather(DiffAllGather(wc, policy))
        u.set_custom_reduce_scatter(CodecReduceScatter(gc, policy, intra_codec=ic, node_groups=node_groups))
    return stage


def is_fully_sharded(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _fsdp_modules(root: nn.Module) -> list[tuple[str, FSDPModule]]:
    return [(n, m) for n, m in root.named_modules() if isinstance(m, FSDPModule)]


def set_gradient_sync(root: nn.Module, last: bool) -> None:
    """Before a micro-batch's backward: reduce-scatter and reshard only on the step's last one."""
    root.set_requires_gradient_sync(last)
    root.set_reshard_after_backward(last)


@contextlib.contextmanager
def exact_gathers(root: nn.Module) -> Iterator[None]:
    """Evaluation: plain weight gathers that leave the references as training left them (so a run
    that evaluates at a step and one that does not continue identically), then every gathered
    weight freed (the next training step gathers, through the codec, the weights it updates)."""
    comms = [c for _, m in _fsdp_modules(root) if (c := _all_gather_comm(m)) is not None]
    for c in comms:
        c.exact = True
    try:
        yield
    finally:
        for c in comms:
            c.exact = False
        for _, m in _fsdp_modules(root):
            m.reshard()


def _all_gather_comm(m: FSDPModule) -> DiffAllGather | None:
    groups = m._get_fsdp_state()._fsdp_param_groups
    c = groups[0]._all_gather_comm if groups else None
    return c if isinstance(c, DiffAllGather) else None


def references(root: nn.Module) -> dict[str, torch.Tensor | None]:
    """The weight-difference reference of every FSDP parameter group, by module name ("" = root)."""
    out: dict[str, torch.Tensor | None] = {}
    for name, m in _fsdp_modules(root):
        c = _all_gather_comm(m)
        if c is not None:
            out[name] = c.ref
    return out


def set_references(root: nn.Module, refs: dict[str, torch.Tensor | None]) -> None:
    """Restore `references` (by module name; a group missing from `refs` starts exact again)."""
    for name, m in _fsdp_modules(root):
        c = _all_gather_comm(m)
        if c is not None:
            ref = refs.get(name)
            c.ref = None if ref is None else ref.to(next(m.parameters()).device)


def _to_local(obj: Any) -> Any:
    if isinstance(obj, DTensor):
        return obj.to_local().detach().clone()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local(v) for v in obj]
    return obj


def checkpoint_state(root: nn.Module, model: nn.Module, opt_state: dict[str, Any]) -> dict[str, Any]:
    """This rank's checkpoint entries: the model's and optimizer's local shards, which keys are
    DP-sharded (for export), and the difference references (identical on every DP rank)."""
    sd = model.state_dict()
    refs = {k: (None if v is None else v.clone()) for k, v in references(root).items()}
    return {
        "model": _to_local(sd),
        "opt": _to_local(opt_state),
        "dp_sharded_keys": sorted(k for k, v in sd.items() if isinstance(v, DTensor)),
        "dp_refs": refs,
    }


@torch.no_grad()
def load_checkpoint_state(root: nn.Module, model: nn.Module, opt: torch.optim.Optimizer, st: dict) -> None:
    """Inverse of `checkpoint_state` on the same mesh: shards copied in place, the optimizer state
    made DTensors like its parameters again, the references restored."""
    own = model.state_dict()
    if set(own) != set(st["model"]):
        raise ValueError(f"checkpoint keys differ from the model's: {sorted(set(own) ^ set(st['model']))}")
    for k, v in own.items():
        local_tensor(v).copy_(st["model"][k])
    opt.load_state_dict(st["opt"])
    for p, s in opt.state.items():
        if not isinstance(p, DTensor):
            continue
        shard = local_tensor(p).shape
        for k, v in s.items():  # exp_avg, exp_avg_sq: shards like p ("step" is a plain scalar)
            if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.shape == shard:
                s[k] = DTensor.from_local(
                    v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
    saved = st.get("dp_refs", {})
    for name, m in _fsdp_modules(root):
        c = _all_gather_comm(m)
        if c is not None:
            ref = saved.get(name)
            c.ref = None if ref is None else ref.to(next(m.parameters()).device)
