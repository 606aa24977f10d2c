"""Pipeline parallelism: cut a model into stages and run micro-batches through them (1F1B, GPipe).

Why this file exists: the PP axis of the 3D mesh (docs/design.md 1.5). A `PipelineStage` keeps the
layers of one contiguous range (embedding on the first stage, final norm and head on the last);
a `PipelineEngine` runs a schedule of micro-batches over the stages, moving activations forward
and activation gradients backward with `taco.comm.send/recv`, through a codec per direction
(sites `pp.act` and `pp.grad`; the receiving side records `pp.act.recv` / `pp.grad.recv`).

Schedules are data: per stage a list of actions (`fwd`, `bwd`, `send_fwd`, `recv_fwd`,
`send_bwd`, `recv_bwd`, each with its micro-batch), so the order of point-to-point operations is
written once and tested for deadlock freedom without processes (tests/parallel/test_pipeline.py).
Ordering assumptions, NCCL's (the strictest backend's; docs/design.md 1.3): a send completes only
once its receiver has posted the matching receive, and a rank's transfers on the PP group run one
after another in the order they are posted (`taco.comm` posts each as one
`batch_isend_irecv` batch, so one communicator carries them all). GPipe only sends one way at a
time. 1F1B (Megatron, arXiv 2104.04473) has two steady-state exchanges in which neighbours send
to each other (Megatron's `send_forward_recv_backward` and `send_backward_recv_forward`); there
even stages send first and odd stages receive first, so each pair (p, p+1) always has one sender
and one receiver, and blocking transfers in this order never wait in a cycle (tests/parallel/test_pipeline.py
checks every schedule under rendezvous semantics without processes). With `overlap_p2p`
(default) a send and a receive with the same neighbour that are adjacent on both neighbours
(`exchanges`: mirrored) run as one `taco.comm.send_recv` on both sides, one batch whose send and
receive progress together, so neither neighbour's receive queues behind its own send. A pair
whose matching transfers the neighbour makes apart (with compute between, near the pipeline's
ends) stays two blocking transfers in the even/odd order: as an exchange, its header batch (size
check) would wait for a header the neighbour sends only after this rank's payload has arrived.
tests/parallel/test_pipeline_nccl.py runs the engine under a shim with NCCL's point-to-point semantics.
Within a direction, messages between two ranks match in order (same tag), and every TP rank of
a stage runs the same actions.
With TP inside a stage the activation [b, s, h] is replicated over the TP group (with SP each TP
rank holds [b, s/tp, h]): TP rank t of stage i sends to TP rank t of stage i+1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from taco import comm
from taco.codec import Codec

from .batch_split import run_pieces
from .dims import ParallelDims
from .dp_sync import DPSync, NoDPSync
from .fully_sharded import local_tensor
from .tags import mark_pp_copy, tp_context
from .torch_private import run_backward

Action = tuple[str, int]
"""(kind, micro-batch): kind in fwd, bwd, send_fwd, recv_fwd, send_bwd, recv_bwd."""
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""the loss of a micro-batch: (logits, targets) -> a scalar"""
SCHEDULES = ("1f1b", "gpipe")
_WHAT = {"send_fwd": "act", "recv_fwd": "act", "send_bwd": "grad", "recv_bwd": "grad"}
# a send and a receive with the same neighbour, in either order, run as one exchange (overlap_p2p)
_EXCHANGE = {
    "send_fwd": "recv_bwd", "recv_bwd": "send_fwd", "send_bwd": "recv_fwd", "recv_fwd": "send_bwd",
}  # fmt: skip
_STEP = {"send_fwd": 1, "recv_bwd": 1, "send_bwd": -1, "recv_fwd": -1}  # the neighbour: stage + step
_MATCH = {"send_fwd": "recv_fwd", "recv_fwd": "send_fwd", "send_bwd": "recv_bwd", "recv_bwd": "send_bwd"}


def stage_layers(n_layer: int, n_stages: int, stage: int) -> range:
    """The layers of `stage`: contiguous, balanced; the first `n_layer % n_stages` stages get one more."""
    if n_stages > n_layer:
        raise ValueError(
            f"parallel.pp = {n_stages} is larger than the number of layers ({n_layer}): every stage "
            f"needs at least one layer; use parallel.pp <= {n_layer} or a deeper model"
        )
    base, extra = divmod(n_layer, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class _Elsewhere(nn.Module):
    """Stands in for a layer another stage owns: passes x through, keeps global layer names."""

    def forward(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return x


def _hidden(model: nn.Module) -> int:
    cfg = model.config
    return getattr(cfg, "n_embd", None) or cfg.hidden_size


class PipelineStage(nn.Module):
    """One stage of a GPT/Qwen model: embed (first stage), its layers, head (last stage).

    Cut a model after `apply_tensor_parallel` (the TP hooks of dropped layers go with them).
    Parameter names stay global (`model.layers.5.attn.q.weight` on the stage that owns layer 5).
    Tied embeddings with several stages: the last stage keeps its own copy of the (TP-sharded)
    embedding weight as `lm_head.weight`, equal at start; `sync_tied_grads` sums the two copies'
    gradients over the (first, last) pair so that they stay equal (Megatron's embedding group).
    """

    def __init__(self, model: nn.Module, stage: int, n_stages: int) -> None:
        super().__init__()
        self.stage, self.n_stages = stage, n_stages
        self.layers = stage_layers(len(model.layers), n_stages, stage)
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.hidden = _hidden(model)
        self.tied = model.lm_head.weight is model.tok_emb.weight
        for i in range(len(model.layers)):
            if i not in self.layers:
                model.layers[i] = _Elsewhere()
        if not self.is_first:
            model.tok_emb = None
            if getattr(model, "pos_emb", None) is not None:
                model.pos_emb = None
        if not self.is_last:
            model.norm = None
            model.lm_head = None
        self.model = model
        self.pieces = 1
        """batch-split TP overlap: each micro-batch's blocks run as this many pieces (batch_split.py)"""
        if self.tied and n_stages > 1 and self.is_last:
            mark_pp_copy(model.lm_head.weight)  # counted once in norms (on the first stage)

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of a tied embedding weight shared with another stage (else None)."""
        if not self.tied or self.n_stages == 1 or not (self.is_first or self.is_last):
            return None
        return self.model.tok_emb.weight if self.is_first else self.model.lm_head.weight

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: token ids [b, s] (first stage) or activations [b, s(/tp), h]; positions: [s] (full)."""
        split = self.pieces > 1  # batch-split: the pieces' gradients come back through one node
        embed = self.is_first  # the first stage embeds; split, inside the pieces (its all-reduce too)

        def layers(h: torch.Tensor) -> torch.Tensor:  # token ids [b, s] or [b, s(/tp), h]
            return self.model.run_layers(self.model.embed(h) if embed else h, positions)

        # collected here, inside forward: under FSDP2 (the stage one unit) its pre-forward hook has
        # already put the unsharded parameters in place, the ones the pieces compute with
        params = [p for i in self.layers for p in self.model.layers[i].parameters()] if split else []
        if split and embed:
            params += [p for m in self.model.embeddings() for p in m.parameters()]
        if split and any(isinstance(p, DTensor) for p in params):
            raise ValueError(
                "batch-split TP overlap: the blocks' parameters are still sharded when the stage runs; "
                "FSDP2 must shard the stage as one unit (fully_shard_stage(..., one_unit=True))"
            )
        x = run_pieces(layers, x, self.pieces, params)  # [b, s(/tp with SP), h]
        # logits [b, s, V/tp] in the model's dtype (the vocab-parallel loss widens them to fp32 in its
        # one full-size buffer; its backward returns the gradient in their dtype), or [b, s(/tp), h]
        return self.model.head(x, upcast=False) if self.is_last else x


def embedding_group(dims: ParallelDims, tied: bool) -> dist.ProcessGroup | None:
    """The (first, last) stage pair of this rank's (dp, tp) coordinates, for tied embeddings.

    Collective: every rank calls it (new groups are created in the same order everywhere).
    None when there is nothing to sum (pp == 1, untied weights, or a middle stage).
    """
    if dims.pp == 1 or not tied:
        return None
    if dims.pp == 2:
        return dims.group("pp")
    mine = None
    for d in range(dims.dp):
        for t in range(dims.tp):
            ranks = [dims.rank_of(d, 0, t), dims.rank_of(d, dims.pp - 1, t)]
            g = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = g
    return mine


def sync_tied_grads(stage: PipelineStage, group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of the two tied-embedding copies over the (first, last) pair (plain)."""
    w = stage.tied_weight
    if group is None or w is None:
        return
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    dist.all_reduce(local_tensor(w.grad), group=group)  # FSDP: both copies hold the same DP shard


# -- schedules ----------------------------------------------------------------------------------
def gpipe_actions(stage: int, n_stages: int, n_micro: int) -> list[Action]:
    """All forwards, then all backwards (GPipe, arXiv 1811.06965); sends flow one way at a time."""
    first, last = stage == 0, stage == n_stages - 1
    acts: list[Action] = []
    for k in range(n_micro):
        acts += [("recv_fwd", k)] * (not first) + [("fwd", k)] + [("send_fwd", k)] * (not last)
    for k in range(n_micro):
        acts += [("recv_bwd", k)] * (not last) + [("bwd", k)] + [("send_bwd", k)] * (not first)
    return acts


def one_f_one_b_actions(stage: int, n_stages: int, n_micro: int) -> list[Action]:
    """1F1B: warm up with n_stages - stage - 1 forwards, alternate, cool down with the backwards.

    At most n_stages - stage micro-batches are in flight on a stage (bounded activation memory).
    """
    first, last = stage == 0, stage == n_stages - 1
    warm = min(n_stages - stage - 1, n_micro)
    steady = n_micro - warm
    acts: list[Action] = []

    def one(kind: str, k: int) -> list[Action]:
        skip = (first and kind in ("recv_fwd", "send_bwd")) or (last and kind in ("send_fwd", "recv_bwd"))
        return [] if skip else [(kind, k)]

    def pair(send: Action, recv: Action) -> list[Action]:
        a, b = one(*send), one(*recv)
        return a + b if stage % 2 == 0 else b + a  # even stages send first, odd stages receive first

    for k in range(warm):
        acts += one("recv_fwd", k) + [("fwd", k)] + one("send_fwd", k)
    if steady:
        acts += one("recv_fwd", warm)
    for i in range(steady):
        k = warm + i
        acts += [("fwd", k)] + pair(("send_fwd", k), ("recv_bwd", i)) + [("bwd", i)]
        acts += one("send_bwd", i) if i == steady - 1 else pair(("send_bwd", i), ("recv_fwd", k + 1))
    for i in range(steady, n_micro):
        acts += one("recv_bwd", i) + [("bwd", i)] + one("send_bwd", i)
    return acts


def exchanges(plans: list[list[Action]], stage: int) -> set[int]:
    """Where `plans[stage]` (one plan per stage) runs two transfers as one exchange: indices i
    such that actions i and i+1 are a send and a receive with the same neighbour whose matching
    actions are adjacent in the neighbour's plan too (mirrored), so both sides post them as one
    `taco.comm.send_recv` (module docstring)."""
    plan, out, i = plans[stage], set(), 0
    while i + 1 < len(plan):
        (a, ka), (b, kb) = plan[i], plan[i + 1]
        if _EXCHANGE.get(a) == b:
            peer = plans[stage + _STEP[a]]
            if abs(peer.index((_MATCH[a], ka)) - peer.index((_MATCH[b], kb))) == 1:
                out.add(i)
                i += 2
                continue
        i += 1
    return out


def schedule_actions(name: str, stage: int, n_stages: int, n_micro: int) -> list[Action]:
    if name == "1f1b":
        return one_f_one_b_actions(stage, n_stages, n_micro)
    if name == "gpipe":
        return gpipe_actions(stage, n_stages, n_micro)
    raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULES}")


def _free(t: torch.Tensor) -> None:
    """Drop an output's storage once it is sent; its autograd node stays (Megatron's trick)."""
    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)


def _backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    # The engine directly: `torch.autograd.backward` would compare grad's shape with the freed out.
    g = grad if grad is not None else torch.ones_like(out)  # the last stage: d loss / d loss
    run_backward(out, g)


class PipelineEngine:
    """Runs one step's micro-batches through this rank's stage by a schedule.

    `module` is what the forward calls: the stage, or its DP wrapper (DDP or FSDP2). `dp_sync`
    (`taco.parallel.dp_sync`) holds the wrapper's gradient reduction back until the step's last
    backward; the engine calls it and never asks which wrapper it has (required with a wrapper).
    `policy` (a `taco.comm.CommPolicy`) picks the codec of sites `pp.act` and `pp.grad` and keeps
    their statistics; None: plain send/recv. `act_dtype`: the dtype activations and their gradients
    travel in between stages (the trainer passes the training dtype: bf16 training sends bf16, as
    TP does). `device`: where received tensors and the loss are made (default: the stage's).
    `overlap_p2p`: a send and a receive with the same neighbour that follow each other in the
    schedule on both neighbours (1F1B's steady-state pairs, `exchanges`) are posted together
    (`taco.comm.send_recv`) and then waited on, instead of one blocking transfer after the other;
    results are identical.
    """

    def __init__(
        self,
        stage: PipelineStage,
        dims: ParallelDims,
        *,
        module: nn.Module | None = None,
        dp_sync: DPSync | None = None,
        policy: comm.CommPolicy | None = None,
        schedule: str = "1f1b",
        act_dtype: torch.dtype = torch.float32,
        autocast: bool = False,
        device: torch.device | str | None = None,
        overlap_p2p: bool = True,
    ) -> None:
        schedule_actions(schedule, 0, 1, 1)  # validates the name
        self.overlap_p2p = overlap_p2p
        self.stage, self.dims, self.policy, self.schedule = stage, dims, policy, schedule
        if module is not None and module is not stage and dp_sync is None:
            raise ValueError(
                "PipelineEngine: a wrapped module needs its DP sync, dp_sync=dp_sync_for(module) "
                "(taco.parallel.dp_sync), or the wrapper would reduce on every micro-batch"
            )
        self.module = module if module is not None else stage
        self.dp_sync = dp_sync if dp_sync is not None else NoDPSync()
        self.act_dtype, self.autocast = act_dtype, autocast
        # where received activations, gradients and the loss live (default: the stage's parameters)
        self.device = torch.device(device) if device is not None else next(stage.parameters()).device
        self.group = dims.group("pp") if dims.pp > 1 else None
        ranks = dims.ranks("pp") if dims.pp > 1 else [None]
        p = stage.stage
        self.prev = ranks[p - 1] if p > 0 else None
        self.next = ranks[p + 1] if p < len(ranks) - 1 else None
        tp = tp_context(stage.model)
        self.seq_shards = tp.size if tp is not None and tp.sp else 1

    # -- point to point ----------------------------------------------------------------------
    def _codec(self, what: str, like: torch.Tensor, policy: comm.CommPolicy | None) -> Codec | None:
        # Resolved by the sending site's name on both ends, so sender and receiver always agree.
        return policy.codec_for(f"pp.{what}", like.numel(), like.dtype) if policy is not None else None

    def _send(self, t: torch.Tensor, what: str, policy: comm.CommPolicy | None) -> None:
        peer = self.next if what == "act" else self.prev
        codec = self._codec(what, t, policy)
        comm.send(t, peer, self.group, codec=codec, site=f"pp.{what}", policy=policy)

    def _recv(self, what: str, shape: tuple[int, ...], policy: comm.CommPolicy | None) -> torch.Tensor:
        peer = self.prev if what == "act" else self.next
        like = torch.empty((), dtype=self.act_dtype, device=self.device).expand(shape)  # shape, dtype, device
        codec = self._codec(what, like, policy)
        return comm.recv(like, peer, self.group, codec=codec, site=f"pp.{what}.recv", policy=policy)

    def _exchange(
        self, t: torch.Tensor, send_kind: str, shape: tuple[int, ...], policy: comm.CommPolicy | None
    ) -> torch.Tensor:
        """Send t to and receive from the same neighbour as one exchange (`taco.comm.send_recv`,
        which the neighbour makes mirrored): `send_forward_recv_backward` for send_fwd,
        `send_backward_recv_forward` for send_bwd."""
        what = _WHAT[send_kind]
        back = "grad" if what == "act" else "act"
        peer = self.next if what == "act" else self.prev
        like = torch.empty((), dtype=self.act_dtype, device=self.device).expand(shape)
        h = comm.send_recv(
            t, peer, like, peer, self.group,
            send_codec=self._codec(what, t, policy), recv_codec=self._codec(back, like, policy),
            send_site=f"pp.{what}", recv_site=f"pp.{back}.recv", policy=policy,
        )  # fmt: skip
        return h.wait()

    # -- running a schedule ------------------------------------------------------------------
    def _run(
        self,
        actions: list[Action],
        fused: set[int],
        x: torch.Tensor,
        y: torch.Tensor,
        n_micro: int,
        loss_fn: LossFn,
        policy: comm.CommPolicy | None,
        train: bool,
    ) -> torch.Tensor:
        if x.shape[0] % n_micro:
            raise ValueError(f"batch of {x.shape[0]} sequences is not divisible by {n_micro} micro-batches")
        xs, ys = x.chunk(n_micro), y.chunk(n_micro)  # [b/M, s] each
        s = x.shape[1]
        positions = torch.arange(s, device=x.device)  # [s]
        shape = (xs[0].shape[0], s // self.seq_shards, self.stage.hidden)  # [b/M, s(/tp), h]
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        sync = self.dp_sync if train else NoDPSync()  # DP reduces once, after the last backward
        module = self.module if train else self.stage
        last_bwd = n_micro - 1
        def send_tensor(kind: str, k: int) -> torch.Tensor:
            if kind == "send_fwd":
                return (outputs[k] if train else outputs.pop(k)).detach()  # freed after the send
            return inputs.pop(k).grad

        def sent(kind: str, k: int) -> None:
            if kind == "send_fwd" and k in outputs:
                _free(outputs[k])  # backward needs the output's graph, not its values

        def received(kind: str, k: int, t: torch.Tensor) -> None:
            if kind == "recv_fwd":
                inputs[k] = t.requires_grad_(train)
            else:
                grads[k] = t

        i = 0
        while i < len(actions):
            kind, k = actions[i]
            if i in fused:  # 1F1B, mirrored on the neighbour: one batch, then waited
                pair = actions[i + 1]
                (snd, ks), (rcv, kr) = (actions[i], pair) if kind.startswith("send") else (pair, actions[i])
                received(rcv, kr, self._exchange(send_tensor(snd, ks), snd, shape, policy))
                sent(snd, ks)
                i += 2
                continue
            i += 1
            if kind in ("recv_fwd", "recv_bwd"):
                received(kind, k, self._recv(_WHAT[kind], shape, policy))
            elif kind == "fwd":
                inp = xs[k] if self.stage.is_first else inputs[k]
                amp = torch.autocast(x.device.type, torch.bfloat16, enabled=self.autocast)
                with amp, sync.forward():
                    out = module(inp, positions)
                if self.stage.is_last:
                    out = loss_fn(out, ys[k]) / n_micro  # scalar
                    total += out.detach().float()
                else:
                    out = out.to(self.act_dtype)  # [b/M, s(/tp), h]
                outputs[k] = out
                if not train:
                    inputs.pop(k, None)
            elif kind in ("send_fwd", "send_bwd"):
                self._send(send_tensor(kind, k), _WHAT[kind], policy)
                sent(kind, k)
            elif kind == "bwd":
                sync.before_backward(outputs[k], k == last_bwd)
                _backward(outputs.pop(k), grads.pop(k, None))
        if self.group is not None:  # the loss lives on the last stage; share it with the others
            dist.all_reduce(total, group=self.group)
        return total

    def train_step(self, x: torch.Tensor, y: torch.Tensor, n_micro: int, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of batch x [b, s] -> targets y [b, s] in n_micro micro-batches.

        Gradients accumulate into the stage's parameters (the mean loss over the batch);
        returns that mean loss on every stage.
        """
        n = self.stage.n_stages
        plans = [schedule_actions(self.schedule, s, n, n_micro) for s in range(n)]
        fused = exchanges(plans, self.stage.stage) if self.overlap_p2p else set()
        return self._run(plans[self.stage.stage], fused, x, y, n_micro, loss_fn, self.policy, train=True)

    @torch.no_grad()
    def eval_step(self, x: torch.Tensor, y: torch.Tensor, n_micro: int, loss_fn: LossFn) -> torch.Tensor:
        """The mean loss of a batch, forward only, plain (uncompressed) send/recv."""
        acts = [a for a in gpipe_actions(self.stage.stage, self.stage.n_stages, n_micro) if "fwd" in a[0]]
        return self._run(acts, set(), x, y, n_micro, loss_fn, None, train=False)
