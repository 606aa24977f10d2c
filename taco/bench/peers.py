"""The peers of `taco bench cluster`: the same training step with Megatron-Core's and DTensor's TP.

Why this file exists: a speedup over the project's own uncompressed run says little if that run is
slower than what users already have. `--peers megatron,dtensor` trains the bench's model (the
config's GPT: layers, hidden, heads, vocabulary, TP size, data, batch, steps, AdamW and its
schedule, gradient clipping) with another framework's tensor parallelism, uncompressed, in the
same alternating rounds as the project's runs (`cluster.py`), so every row of the report can say
how it compares with the best of them (docs/design.md 3):

- `megatron`: Megatron-Core's `VocabParallelEmbedding`, a fused q/k/v `ColumnParallelLinear`,
  `RowParallelLinear` for the attention and MLP outputs, the tied output layer as a
  `ColumnParallelLinear` over the embedding's weight and `vocab_parallel_cross_entropy`; its
  `parallel_state` initialised on the bench's gloo group. Megatron's mixed precision: bf16
  parameters and gradients with fp32 master weights in the optimizer, no autocast (its linear
  autograd functions are decorated for CUDA autocast only).
- `dtensor`: the project's own GPT (the same module and init) under a `parallelize_module` plan on
  a 1-D `DeviceMesh`: `RowwiseParallel` for the vocabulary-sharded embedding and for the attention
  and MLP outputs, `ColwiseParallel` for the fused q/k/v, the MLP input and the tied output layer
  (logits left vocabulary-sharded, the loss under `loss_parallel()`), bf16 parameters with fp32
  masters as above. The fused q/k/v weight's rows are ordered so that DTensor's even split gives
  each rank its own heads' q, k and v (one input-gradient all-reduce per block, as Megatron's).

Timed as the project's step is (`cluster_rounds.TimedRun`): learning rate, zero grads, forward, backward,
the global gradient norm (one TP all-reduce) and clipping, the optimizer, one host read of the loss.
Bytes: the peers' collectives do not pass through `taco.comm`, so a dispatch mode counts every
all-reduce of the first step (a warm-up step, never timed) and each step records that count: a
rank's share of a ring all-reduce, 2 (n - 1) / n of the message, the project's own accounting.
The time inside the peers' collectives is not measured (`comm_s` = 0 in their records): f, the
communication share of a row, is always the project's baseline's.
"""

from __future__ import annotations

import importlib.util
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

PEERS = {
    "megatron": "Megatron-Core TP layers (bf16 params, fp32 masters, fused qkv)",
    "dtensor": "DTensor ColwiseParallel/RowwiseParallel plan (bf16 params, fp32 masters)",
}
"""The peers `--peers` takes, each with what it runs."""
PREFIX = "peer:"
"""a peer run's label in the records (`peer:megatron`), never a codec name"""


def label(name: str) -> str:
    return PREFIX + name


def is_peer(label_: str) -> bool:
    return label_.startswith(PREFIX)


def peer_name(label_: str) -> str:
    return label_.removeprefix(PREFIX)


def split_labels(labels: list[str]) -> tuple[list[str], list[str]]:
    """(the codec labels, the peer names) of a saved sweep's run labels, in order."""
    return [c for c in labels if not is_peer(c)], [peer_name(c) for c in labels if is_peer(c)]


def runnable_peers(names: list[str]) -> tuple[list[str], list[str]]:
    """(the peers of `names` that can run here, one line per peer skipped saying why); the lines
    are printed as well."""
    names = list(dict.fromkeys(names))
    why = {n: unavailable(n) for n in names}
    skipped = [f"peer {n} skipped: {w}" for n, w in why.items() if w]
    for line in skipped:
        print(f"[cluster] {line}", flush=True)
    return [n for n in names if why[n] is None], skipped


def peer_specs(base: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    """One job per peer from the baseline's job `base` (`cluster.plan_runs`): its mode, config,
    data and timing; the run labelled `peer:NAME`."""
    return [dict(base, codec=label(n), peer=n) for n in names]


def unavailable(name: str) -> str | None:
    """Why peer `name` cannot run here (one line), or None when it can."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}: choose from {', '.join(PEERS)}")
    if name == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            return "megatron-core is not installed (pip install 'taco-tp[megatron]')"
        return None
    try:
        from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401
    except ImportError as e:
        return f"this torch has no DTensor tensor parallelism ({e})"
    return None


# ----------------------------------------------------------------------------- byte counting


class _CountCollectives(TorchDispatchMode):
    """Counts the all-reduces dispatched while active (c10d's and the functional ones), by dtype
    and size: calls and the bytes one rank sends in a ring all-reduce, 2 (n - 1) / n of each;
    `tp_bytes`: those of the TP messages proper (`tp_numel` elements, the sites the project's byte
    counters see; the loss's small all-reduces are left out there as here)."""

    def __init__(self, world: int, tp_numel: int) -> None:
        super().__init__()
        self.world, self.tp_numel, self.tp_bytes = world, tp_numel, 0
        self.sites: dict[str, dict[str, float]] = defaultdict(lambda: dict(calls=0, raw_bytes=0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.name()
        if "all_reduce" in name or "allreduce" in name:
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            for t in tensors:
                n = t.numel() * t.element_size()
                site = self.sites[f"all_reduce.{str(t.dtype).removeprefix('torch.')}.{t.numel()}"]
                site["calls"] += 1
                site["raw_bytes"] += 2 * (self.world - 1) * n // self.world
                site["wire_bytes"] = site["raw_bytes"]  # uncompressed
                if t.numel() == self.tp_numel:
                    self.tp_bytes += 2 * (self.world - 1) * n // self.world
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------- the models


def _megatron_model(cfg: Any, vocab: int, device: torch.device) -> tuple[nn.Module, Callable, Callable]:
    """The config's GPT in Megatron-Core layers: (model, loss(logits, y), is_sharded(param))."""
    import megatron.core.parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )

    m, tp = cfg.model, cfg.parallel.tp
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    dtype = torch.bfloat16 if cfg.train.dtype.value == "bf16" else torch.float32
    mp = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=dtype)
    h = m.hidden
    init = lambda w: nn.init.normal_(w, 0.0, 0.02)  # noqa: E731 - GPT-2's init, as the project's model
    scaled = lambda w: nn.init.normal_(w, 0.0, 0.02 / (2 * m.n_layer) ** 0.5)  # noqa: E731
    col = dict(config=mp, init_method=init, gather_output=False, bias=True)
    row = dict(config=mp, init_method=scaled, input_is_parallel=True, bias=True, skip_bias_add=False)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm, self.mlp_norm = nn.LayerNorm(h, dtype=dtype), nn.LayerNorm(h, dtype=dtype)
            self.qkv = ColumnParallelLinear(h, 3 * h, **col)  # fused: this rank's heads' q, k, v
            self.out = RowParallelLinear(h, h, **row)
            self.up = ColumnParallelLinear(h, 4 * h, **col)
            self.down = RowParallelLinear(4 * h, h, **row)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape  # x: [b, s, h]
            q, k, v = self.qkv(self.attn_norm(x))[0].chunk(3, dim=-1)  # 3 x [b, s, h/tp]
            q, k, v = (t.view(b, s, -1, m.head_size).transpose(1, 2) for t in (q, k, v))  # [b, nl, s, hd]
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(y.transpose(1, 2).reshape(b, s, -1))[0]  # all-reduce: [b, s, h]
            up = nn.functional.gelu(self.up(self.mlp_norm(x))[0], approximate="tanh")  # [b, s, 4h/tp]
            return x + self.down(up)[0]  # all-reduce: [b, s, h]

    class MegatronGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb = VocabParallelEmbedding(vocab, h, init_method=init, config=mp)
            self.pos_emb = nn.Embedding(m.seq_len, h, dtype=dtype)
            init(self.pos_emb.weight)
            self.layers = nn.ModuleList([Block() for _ in range(m.n_layer)])
            self.norm = nn.LayerNorm(h, dtype=dtype)
            tied = dict(col, bias=False, skip_weight_param_allocation=True)  # the embedding's weight
            self.lm_head = ColumnParallelLinear(h, vocab, **tied)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.tok_emb(idx) + self.pos_emb(pos)  # all-reduce: [b, s, h]
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x), weight=self.tok_emb.weight)[0]  # [b, s, V/tp]

    torch.manual_seed(cfg.train.seed)
    model = MegatronGPT().to(device)  # initialised on the CPU (the same weights on any device)

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, y).mean()

    return model, loss, lambda p: bool(getattr(p, "tensor_model_parallel", False))


def _qkv_rows(n: int, tp: int) -> torch.Tensor:
    """Row order of a fused [q; k; v] weight (3n rows) whose even split in tp gives rank r its
    [q_r; k_r; v_r] (`taco.models.decoder.fused_linear`'s shard layout)."""
    part = n // tp
    blocks = [torch.arange(j * n + r * part, j * n + (r + 1) * part) for r in range(tp) for j in range(3)]
    return torch.cat(blocks)


def _dtensor_model(cfg: Any, vocab: int, device: torch.device) -> tuple[nn.Module, Callable, Callable]:
    """The project's GPT under DTensor's TP plan: (model, loss(logits, y), is_sharded(param))."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    from taco.train.build import build_model

    model = build_model(cfg, vocab)  # seeded from train.seed, as the project's runs
    with torch.no_grad():
        for layer in model.layers:
            qkv = layer.attn.qkv
            order = _qkv_rows(qkv.weight.shape[0] // 3, cfg.parallel.tp)
            qkv.weight.copy_(qkv.weight[order])
            if qkv.bias is not None:
                qkv.bias.copy_(qkv.bias[order])
    if cfg.train.dtype.value == "bf16":
        model.to(torch.bfloat16)
    model.to(device)
    mesh = DeviceMesh(device.type, list(range(dist.get_world_size())))
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "layers.*.attn.qkv": ColwiseParallel(),
        "layers.*.attn.out": RowwiseParallel(),
        "layers.*.mlp.up": ColwiseParallel(),
        "layers.*.mlp.down": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, mesh, plan)
    if cfg.model.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight  # both Shard(0) of the same [V, h] weight

    def loss(logits: Any, y: torch.Tensor) -> torch.Tensor:  # under loss_parallel() (`_context`)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    def sharded(p: torch.Tensor) -> bool:
        return isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)

    model.loss_context = loss_parallel  # forward and backward of the vocabulary-parallel loss
    return model, loss, sharded


_BUILDERS = {"megatron": _megatron_model, "dtensor": _dtensor_model}


# ----------------------------------------------------------------------------- the loop


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _LocalMasters:
    """fp32 masters of the parameters' local shards under the optimizer (`MasterWeightsOptimizer`'s
    step, on plain tensors: a DTensor parameter's master is its local shard, as Megatron's are)."""

    def __init__(self, groups: list[dict[str, Any]], make: Callable[[list[dict[str, Any]]], Any]) -> None:
        self.params = [p for g in groups for p in g["params"]]
        self.masters = [nn.Parameter(_local(p).detach().float().clone()) for p in self.params]
        it = iter(self.masters)
        self.inner = make([{**g, "params": [next(it) for _ in g["params"]]} for g in groups])
        self.param_groups = self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        have = [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]
        for p, m in have:
            m.grad = _local(p.grad).float()
        self.inner.step()
        torch._foreach_copy_([_local(p) for p, _ in have], [m for _, m in have])  # round to bf16
        for _, m in have:
            m.grad = None


class PeerRun:
    """One rank's share of peer `name`'s run of `cfg` on `device` (this rank's; its process group
    must reach it), stepped like the project's runs (`cluster_rounds.TimedRun`): `step()` until
    `done`, then `finish()` for the record (per-step records, the validation loss, sites)."""

    def __init__(self, name: str, cfg: Any, data_dir: Path, device: torch.device | str = "cpu") -> None:
        from taco.parallel import build_optimizer
        from taco.train.build import model_vocab
        from taco.train.data import TokenDataset

        if cfg.parallel.dp > 1 or cfg.parallel.pp > 1 or cfg.parallel.sp or cfg.parallel.microbatches > 1:
            raise ValueError("the peers run TP only, one micro-batch (sp = false, pp = dp = 1)")
        self.name, self.cfg, t = name, cfg, cfg.train
        self.train_ds = TokenDataset(data_dir, "train", cfg.model.seq_len, seed=t.seed)
        self.val_ds = TokenDataset(data_dir, "val", cfg.model.seq_len, seed=t.seed)
        vocab, loss_vocab = model_vocab(cfg, self.train_ds.vocab_size)
        if loss_vocab is not None:
            raise ValueError("the peers train a vocabulary that tp divides (no masked padding)")
        self.group = dist.group.WORLD
        self.device = torch.device(device)
        with warnings.catch_warnings():  # Megatron's notes on CUDA-only fast paths, once per rank
            warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
            self.model, self.loss_fn, is_sharded = _BUILDERS[name](cfg, vocab, self.device)
        self.context = getattr(self.model, "loss_context", nullcontext)
        params = list(self.model.parameters())
        groups = [{"params": [q for q in params if q.dim() >= 2], "weight_decay": t.weight_decay},
                  {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}]  # fmt: skip

        def make(gs: list[dict[str, Any]]) -> torch.optim.Optimizer:
            return build_optimizer(gs, None, False, lr=t.lr, betas=(t.beta1, t.beta2))

        # bf16: fp32 masters; fp32: plain AdamW as the project's, except over DTensor parameters, whose
        # optimizer runs on the local shards (fp32 copies: one copy per step more than the project's)
        masters = t.dtype.value == "bf16" or name == "dtensor"
        self.opt: Any = _LocalMasters(groups, make) if masters else make(groups)
        self.sharded = [q for q in params if is_sharded(q)]
        self.replicated = [q for q in params if not is_sharded(q)]
        tp_numel = t.batch_size * cfg.model.seq_len * cfg.model.hidden  # one TP message: [b, s, h]
        self.counter = _CountCollectives(dist.get_world_size(self.group), tp_numel)
        self.steps: list[dict[str, Any]] = []
        self.per_step = dict(wire_bytes=0.0, raw_bytes=0.0)

    @property
    def done(self) -> bool:
        return len(self.steps) >= self.cfg.train.steps

    def _clip(self) -> torch.Tensor:
        """The global gradient norm (one all-reduce of the sharded parameters' sum of squares);
        gradients scaled to train.grad_clip when above it, without a host read."""
        from taco.train.grads import sum_squares

        parts = (self.sharded, self.replicated)
        grads = [[_local(q.grad) for q in part if q.grad is not None] for part in parts]
        s = sum_squares(grads[0], self.device)
        dist.all_reduce(s, group=self.group)
        norm = (s + sum_squares(grads[1], self.device))[0].sqrt()  # 0-d
        clip = self.cfg.train.grad_clip
        if clip > 0:
            scale = torch.where(norm > clip, clip / (norm + 1e-6), torch.ones_like(norm))
            for dtype in {g.dtype for g in grads[0] + grads[1]}:
                torch._foreach_mul_([g for g in grads[0] + grads[1] if g.dtype == dtype], scale.to(dtype))
        return norm

    def _batch(self, ds: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = ds.get_batch(k, self.cfg.train.batch_size, 0, 1)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def step(self) -> None:
        """One timed step: lr, zero grads, forward, backward, clipping, optimizer, one loss read."""
        from taco.train.run import lr_at

        step = len(self.steps)
        counting = step == 0
        t0 = time.perf_counter()
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, self.cfg)
        x, y = self._batch(self.train_ds, step)
        self.opt.zero_grad(set_to_none=True)
        with self.counter if counting else nullcontext(), self.context():
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
        self._clip()
        self.opt.step()
        lo = _local(loss).item()
        dt = time.perf_counter() - t0
        if counting:
            self.per_step["raw_bytes"] = self.per_step["wire_bytes"] = float(self.counter.tp_bytes)
        self.steps.append(dict(step_s=dt, loss=lo, comm_s=0.0, encode_s=0.0, decode_s=0.0, **self.per_step))

    def finish(self, rank: int = 0) -> dict[str, Any]:
        """The run's record; Megatron's global parallel state released."""
        with torch.no_grad(), self.context():
            batches = map(partial(self._batch, self.val_ds), range(self.cfg.train.eval_steps))
            val = [_local(self.loss_fn(self.model(x), y)).float() for x, y in batches]
        n = len(self.steps)
        sites = {k: {f: v * n for f, v in s.items()} for k, s in self.counter.sites.items()}  # every step's
        if self.name == "megatron":
            import megatron.core.parallel_state as ps

            ps.destroy_model_parallel()
        return dict(steps=self.steps, val_loss=torch.stack(val).mean().item(), sites=sites)


def train_peer(name: str, cfg: Any, data_dir: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """One rank of peer `name`'s whole run of `cfg` on `device`, alone: `PeerRun` to its end."""
    run = PeerRun(name, cfg, data_dir, device)
    while not run.done:
        run.step()
    return run.finish()
