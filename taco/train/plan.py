"""Before a launch: what a run needs per GPU, what it sends per step, and what compression buys.

Why this file exists: GPU hours are spent only to learn that a layout does not fit or that a
codec does not pay on the user's links (docs/design.md 1.7). `make_plan(cfg, hw)` answers from the
config alone, starting no ranks: the model is built on the meta device (no memory), sharded on
paper by its TP plan and cut into pipeline stages as the trainer cuts it, and

- memory per GPU of the busiest stage: parameters, gradients, AdamW state (exact: the built
  model's shards, in the dtypes of the `train.mixed_precision` recipe, `state_bytes`; "master"
  adds the fp32 master copies to the optimizer state), activations kept for backward for each
  `train.recompute` mode (a per-block count of the tensors autograd saves, `activation_bytes`),
  communication buffers;
- traffic per step and rank on each axis (TP, PP, DP), plain and through each codec, counted as
  `taco.comm` counts it (the same chunking, slicing and alignment: `comm_stats.txt` matches);
- the step time of each codec from the alpha-beta cost model (`taco.bench.cost_model`) with a
  GPU and link table the user can override (`taco.train.plan_hw`).

Activations: per micro-batch of b sequences of s tokens, hidden h, TP degree t, and with sequence
parallelism the norm region sharded (L = s/t, else L = s), a block saves: the norms' inputs (the
residual stream, b L h each; RMSNorm also its normalised value) and statistics, the inputs of the
fused qkv and MLP up (or gate-up) projections (b s h each), the fused q/k/v output (Qwen also its
rotated q and k), the attention output and log-sum-exp, and the MLP's intermediates (GPT: up and
GELU outputs, 8 b s h/t; Qwen's SwiGLU: four b s f/t). "full" keeps the block input (b L h);
"selective" the block input and the column-parallel matmul outputs (q, k, v, MLP up/gate). The
embedding stage keeps the token ids, the head stage the final norm, the head's input and the
softmax of the vocab-parallel loss (b s V/t fp32, one buffer). Bytes per element by recipe:
fp32 4 each. bf16 "master" (bf16 parameters, no autocast): everything bf16 but the log-sum-exp
and RMSNorm's fp32 copy of its input and its rsqrt (LayerNorm's mean and rstd follow the input
on CPU; a CUDA kernel may keep them fp32, a few bytes per token). bf16 "autocast" (over fp32 weights): the
residual stream, norms and statistics stay fp32, each linear keeps its own bf16 copy of its input
and weight, the rest is bf16. `tests/bench/test_plan.py` checks these counts against saved-tensor hooks
in real steps (CPU), for each recipe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from taco.train.config import Config

MODES = ("none", "full", "selective")
ADAM_STATES = 2
"""fp32 tensors of optimizer state per parameter (AdamW: exp_avg, exp_avg_sq)"""


@dataclass
class Shapes:
    """What the plan needs of the model: sizes, and per stage its local parameter count."""

    kind: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    params_total: int
    qk_norm: bool = False
    stage_params: list[int] = field(default_factory=list)
    """elements of parameters this rank holds on each pipeline stage (TP shard, FSDP shard)"""
    stage_layers: list[range] = field(default_factory=list)
    flops_per_token: float = 0.0
    matmul_params: int = 0


def build_shapes(cfg: Config, data_vocab: int) -> Shapes:
    """Build the model on the meta device and count each stage's local parameters exactly as the
    trainer shards them (TP plan styles, pipeline cut, tied copy on the last stage, FSDP shards)."""
    import torch

    from taco.models import build_model as build
    from taco.models import check_tp_size, resolve_plan
    from taco.models.presets import SIZE_KEYS
    from taco.parallel.pipeline import stage_layers
    from taco.train.build import model_vocab

    m, p = cfg.model, cfg.parallel
    vocab, _ = model_vocab(cfg, data_vocab)
    sizes = {key: getattr(m, key) for key in SIZE_KEYS}
    with torch.device("meta"):  # one block stands for all: the blocks have the same shapes
        model = build(m.kind.value, **{**sizes, "vocab_size": vocab, "n_layer": 1})
    if p.tp > 1:
        check_tp_size(model, p.tp)  # the trainer's own check: heads, widths, vocabulary over tp
    stage_layers(m.n_layer, p.pp, 0)  # the trainer's own check: a layer for every stage
    styles = resolve_plan(model)
    tied = model.lm_head.weight is model.tok_emb.weight
    ranges = [stage_layers(m.n_layer, p.pp, i) for i in range(p.pp)]
    per_stage = [0] * p.pp
    dp = p.dp if p.dp_shard and p.dp > 1 else 1
    total = 0
    for name, param in model.named_parameters():
        owner, _, _ = name.rpartition(".")
        style = styles.get(owner, "replicate")
        shape = list(param.shape)
        if style in ("vocab_embedding", "colwise", "colwise_head"):
            shape[0] //= p.tp
        elif style == "rowwise" and len(shape) == 2:  # the bias stays whole
            shape[1] //= p.tp
        shape[0] = -(-shape[0] // dp)  # FSDP2 shards dim 0, padded to equal shards
        n = math.prod(shape)
        if name.startswith("layers."):
            total += param.numel() * m.n_layer
            for s, r in enumerate(ranges):
                per_stage[s] += n * len(r)
            continue
        total += param.numel()
        if name.startswith(("tok_emb", "pos_emb")):
            stages = [0] + ([p.pp - 1] if tied and p.pp > 1 and name.startswith("tok_emb") else [])
        else:
            stages = [p.pp - 1]
        for s in stages:
            per_stage[s] += n
    linears = {n: x.weight.numel() for n, x in model.named_modules() if isinstance(x, torch.nn.Linear)}
    matmul = sum(v * (m.n_layer if n.startswith("layers.") else 1) for n, v in linears.items())
    attn = m.n_head * m.head_size
    return Shapes(
        kind=m.kind.value, layers=m.n_layer, hidden=m.hidden, heads=m.n_head, kv_heads=m.kv_heads,
        head_dim=m.head_size, ffn=m.ffn_size, vocab=vocab, params_total=total, qk_norm=m.qk_norm,
        stage_params=per_stage,
        stage_layers=ranges, flops_per_token=6.0 * matmul + 12.0 * m.n_layer * attn * m.seq_len,
        matmul_params=matmul,
    )  # fmt: skip


def comm_elem(cfg: Config) -> int:
    """Bytes per element of the TP and PP messages (`parallel.tp_comm_dtype`; "auto" and "input"
    follow `train.dtype`: bf16 training communicates bf16)."""
    name = cfg.parallel.tp_comm_dtype.value
    if name in ("auto", "input"):
        name = cfg.train.dtype.value
    return 2 if name == "bf16" else 4


def micro_batch(cfg: Config) -> int:
    """Sequences per micro-batch on one DP rank."""
    p = cfg.parallel
    return cfg.train.batch_size // (p.dp * p.microbatches)


def recipe(cfg: Config) -> str:
    """How a step keeps its tensors: "fp32"; with `train.dtype = "bf16"` the
    `train.mixed_precision` recipe, "master" (bf16 parameters, activations and gradients, fp32
    masters in the optimizer) or "autocast" (fp32 weights and gradients, bf16 compute)."""
    t = cfg.train
    return t.mixed_precision.value if t.dtype.value == "bf16" else "fp32"


def _elems(recipe: str) -> tuple[int, int]:
    """(bytes of the residual stream and the norms, bytes of the matmul outputs) per element."""
    return {"fp32": (4, 4), "autocast": (4, 2), "master": (2, 2)}[recipe]


def block_activation_bytes(sh: Shapes, b: int, s: int, tp: int, sp: bool, mode: str, recipe: str) -> float:
    """Bytes one block keeps for backward under `recipe` (module docstring). "autocast": the
    residual stream, the norms and their statistics stay fp32 (the weights are fp32), each linear
    saves its own bf16 copy of its input and of its weight shard, the rest is bf16. "master":
    everything bf16 but the log-sum-exp and RMSNorm's fp32 input copy and rsqrt."""
    L = s // tp if sp and tp > 1 else s  # the norm region: sharded along the sequence with SP
    h, t, hd, f = sh.hidden, tp, sh.head_dim, sh.ffn
    nq, nkv = sh.heads // t, sh.kv_heads // t
    r, c = _elems(recipe)  # residual stream and norms; matmul outputs
    gpt = sh.kind == "gpt"
    if mode == "full":
        return r * b * L * h  # the block's input
    q_kv = b * s * (nq + 2 * nkv) * hd  # the fused q, k, v output
    up = (4 * b * s * h if gpt else 2 * b * s * f) / t  # MLP up (gpt), fused gate and up (qwen)
    if mode == "selective":
        return r * b * L * h + c * (q_kv + up)
    if gpt:  # LayerNorm: its input, mean and rstd (in the input's dtype on CPU)
        norms = 2 * r * (b * L * h + 2 * b * L)
    else:  # RMSNorm: its input as fp32, the fp32 rsqrt, the normalised value
        norms = 2 * (4 * b * L * h + 4 * b * L + r * b * L * h)
    lse = 4.0 * b * nq * s  # attention's log-sum-exp, fp32
    lin_in = 2 * c * b * s * h  # the inputs of the two column-parallel entries (fused qkv, MLP up)
    if recipe == "autocast":  # each linear's bf16 copy of its weight shard
        lin_in += 2.0 * (sh.matmul_params - sh.vocab * sh.hidden) / sh.layers / t
    if gpt:
        attn = q_kv + b * s * nq * hd  # q, k, v, output (its [b, s, h/t] view feeds attn.out)
        mlp = 2 * 4 * b * s * h / t  # up output, GELU output
    else:
        attn = q_kv + b * s * (2 * nq + nkv) * hd  # fused q, k, v; rotated q and k; output
        mlp = 4 * b * s * f / t  # fused gate-up output, silu out, their product
        if sh.qk_norm:  # per-head RMSNorm of q and k: fp32 input, rsqrt, normalised value
            heads = b * s * (nq + nkv)
            lse += 4.0 * heads * hd + 4.0 * heads
            attn += heads * hd
    return norms + lse + lin_in + c * (attn + mlp)


def edge_activation_bytes(sh: Shapes, b: int, s: int, tp: int, sp: bool, first: bool, last: bool,
                          recipe: str) -> float:  # fmt: skip
    """Bytes kept outside the blocks: token ids (first stage), the head and the loss (last)."""
    L = s // tp if sp and tp > 1 else s
    h = sh.hidden
    r, c = _elems(recipe)
    out = 0.0
    if first:
        out += b * s * 8 + (b * s if tp > 1 else 0)  # token ids (int64), the vocab-shard mask
        out += s * 8 if sh.kind == "gpt" else 0  # positions
    if last:
        if sh.kind == "gpt":  # the final norm, as a block's
            out += r * (b * L * h + 2 * b * L)
        else:
            out += 4 * b * L * h + 4 * b * L + r * b * L * h
        out += c * b * s * h  # the head's input
        out += 2.0 * sh.vocab * h / tp if recipe == "autocast" else 0  # its bf16 weight copy
        out += b * s * (sh.vocab // tp) * 4 + b * s * (9 if tp > 1 else 8)  # softmax fp32, targets, mask
    return out


def activation_bytes(cfg: Config, sh: Shapes, mode: str, stage: int) -> float:
    """Bytes one micro-batch leaves saved for backward on `stage` under recompute `mode`."""
    p, s = cfg.parallel, cfg.model.seq_len
    b, rec = micro_batch(cfg), recipe(cfg)
    block = block_activation_bytes(sh, b, s, p.tp, p.sp, mode, rec)
    rope = 2 * _elems(rec)[0] * s * sh.head_dim if sh.kind != "gpt" else 0  # cos/sin, shared by the blocks
    edges = edge_activation_bytes(sh, b, s, p.tp, p.sp, stage == 0, stage == p.pp - 1, rec)
    return len(sh.stage_layers[stage]) * block + rope + edges


def in_flight(cfg: Config, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once (1F1B: pp - stage; GPipe: all)."""
    p = cfg.parallel
    if p.pp == 1:
        return 1
    if p.pp_schedule.value == "gpipe":
        return p.microbatches
    return min(p.pp - stage, p.microbatches)


@dataclass
class Memory:
    """Bytes per GPU of one stage."""

    stage: int
    params: float
    grads: float
    optimizer: float
    activations: dict[str, float]
    buffers: float

    def total(self, mode: str) -> float:
        return self.params + self.grads + self.optimizer + self.activations[mode] + self.buffers


def state_bytes(cfg: Config) -> tuple[int, int, int]:
    """Bytes per local parameter element of (parameters, gradients, optimizer state before ZeRO's
    split of the AdamW moments, masters excluded) and of the fp32 masters (0 or 4). "master" without
    FSDP2: bf16 parameters and gradients (the gradients held through backward are the fp32 sum of
    the micro-batches where no DDP reducer owns them: several micro-batches, no DP group); FSDP2
    keeps fp32 shards (its own master recipe) and fp32 or autocast training fp32 everything."""
    p = cfg.parallel
    if recipe(cfg) != "master" or (p.dp_shard and p.dp > 1):
        return 4, 4, 0
    return 2, (4 if p.microbatches > 1 and p.dp == 1 else 2), 4


def memory(cfg: Config, sh: Shapes) -> list[Memory]:
    """Per stage: parameters and gradients (`state_bytes`), AdamW state (ZeRO/FSDP: over dp) and
    the fp32 masters of the "master" recipe (each rank all of its stage's: ZeRO splits the moments),
    activations of each recompute mode x micro-batches in flight, and communication buffers
    (compressed TP: the buffer cache's cap, 4 x the largest message; DDP: its gradient buckets, a
    second copy of the gradients in the parameters' dtype; FSDP: one block's gathered weights and
    gradients in the compute dtype)."""
    p, c = cfg.parallel, cfg.compression
    b, s = micro_batch(cfg), cfg.model.seq_len
    comm = 2 if cfg.train.dtype.value == "bf16" else 4
    param_b, grad_b, master_b = state_bytes(cfg)
    out = []
    for st in range(p.pp):
        n = sh.stage_params[st]
        opt = n * 4 * ADAM_STATES / (p.dp if p.zero and p.dp > 1 else 1) + n * master_b
        acts = {mode: activation_bytes(cfg, sh, mode, st) * in_flight(cfg, st) for mode in MODES}
        buffers = 0.0
        if c.tp_codec != "none" and p.tp > 1:
            buffers += 4 * b * s * sh.hidden * comm
        if p.dp > 1 and not p.dp_shard:
            buffers += n * param_b
        if p.dp > 1 and p.dp_shard and sh.layers:
            block = (sh.stage_params[st] * p.dp) / max(1, len(sh.stage_layers[st]))
            buffers += 2 * block * comm
        out.append(Memory(st, n * float(param_b), n * float(grad_b), opt, acts, buffers))
    return out


# ----------------------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Msg:
    """One collective of a step on one rank: axis, site, op, elements of its input, count per step."""

    axis: str
    site: str
    op: str
    numel: int
    count: int


def tp_messages(cfg: Config, sh: Shapes, stage: int) -> list[Msg]:
    """The TP collectives one rank of `stage` makes per step through the TP policy (per-step
    statistics: recomputed forwards are counted apart). Op input sizes as `taco.comm` sees them."""
    p = cfg.parallel
    if p.tp == 1:
        return []
    b, s, h, t, m = micro_batch(cfg), cfg.model.seq_len, sh.hidden, p.tp, p.microbatches
    full, shard = b * s * h, b * (s // t) * h
    msgs: list[Msg] = []
    first, last = stage == 0, stage == p.pp - 1
    if first:
        msgs.append(Msg("tp", "tok_emb.fwd", "all_reduce", full, m))
    for i in sh.stage_layers[stage]:
        for blk, out in (("attn.qkv", "attn.out"), ("mlp.up", "mlp.down")):
            if p.sp:
                msgs += [Msg("tp", f"layers.{i}.{blk}.fwd", "all_gather", shard, m),
                         Msg("tp", f"layers.{i}.{blk}.bwd", "reduce_scatter", full, m),
                         Msg("tp", f"layers.{i}.{out}.fwd", "reduce_scatter", full, m),
                         Msg("tp", f"layers.{i}.{out}.bwd", "all_gather", shard, m)]  # fmt: skip
            else:
                msgs += [Msg("tp", f"layers.{i}.{blk}.bwd", "all_reduce", full, m),
                         Msg("tp", f"layers.{i}.{out}.fwd", "all_reduce", full, m)]  # fmt: skip
    if p.sp and 0 in sh.stage_layers[stage]:
        msgs.append(Msg("tp", "layers.0.in.bwd", "all_gather", shard, m))
    if last:
        if p.sp:
            msgs += [Msg("tp", "lm_head.fwd", "all_gather", shard, m),
                     Msg("tp", "lm_head.bwd", "reduce_scatter", full, m)]  # fmt: skip
        else:
            msgs.append(Msg("tp", "lm_head.bwd", "all_reduce", full, m))
    return msgs


def recompute_messages(cfg: Config, sh: Shapes, stage: int, mode: str) -> list[Msg]:
    """The forward TP collectives a recompute re-runs (counted apart). Recompute stops once the
    tensors backward needs are back, so a block's last collective (the MLP output's) is not re-run."""
    if mode == "none":
        return []
    return [
        Msg("tp", x.site, x.op, x.numel, x.count)
        for x in tp_messages(cfg, sh, stage)
        if x.site.startswith("layers.") and x.site.endswith(".fwd") and ".mlp.down." not in x.site
    ]


def pp_messages(cfg: Config, sh: Shapes, stage: int) -> list[Msg]:
    p = cfg.parallel
    if p.pp == 1:
        return []
    b, s, t = micro_batch(cfg), cfg.model.seq_len, p.tp
    n = b * (s // t if p.sp and t > 1 else s) * sh.hidden
    msgs = []
    if stage < p.pp - 1:
        msgs.append(Msg("pp", "pp.act", "send", n, p.microbatches))
    if stage > 0:
        msgs.append(Msg("pp", "pp.grad", "send", n, p.microbatches))
    return msgs


def dp_messages(cfg: Config, sh: Shapes, stage: int) -> list[Msg]:
    p = cfg.parallel
    if p.dp == 1:
        return []
    n = sh.stage_params[stage]
    if p.dp_shard:  # FSDP2: weights all-gathered (forward, and again for backward), grads reduce-scattered
        return [Msg("dp", "dp.weight", "all_gather", n, 2),
                Msg("dp", "dp.grad", "reduce_scatter", n * p.dp, 1)]  # fmt: skip
    return [Msg("dp", "dp.grad", "all_reduce", n, 1)]


def config_codec(cfg: Config, axis: str) -> str:
    c = cfg.compression
    if axis == "tp":
        return c.tp_codec
    if axis == "pp":
        return c.pp_codec
    return c.dp_grad_codec if cfg.parallel.dp_shard else c.dp_codec


def wire_bytes(
    op: str, numel: int, elem: int, world: int, codec: Any, slices_for: Any, algo: str
) -> tuple[int, int]:
    """(raw, wire) bytes one rank sends for one call, as `taco.comm` counts them (averaged over
    the ranks where the two-shot all-reduce's chunks differ)."""
    from taco.comm.compressed import aligned, group_unit, per_group, slice_ranges, split_sizes
    from taco.comm.policy import resolve_all_reduce_algo

    nbytes = numel * elem
    if op == "all_reduce":
        raw = 2 * (world - 1) * nbytes // world
    elif op == "all_gather":
        raw = (world - 1) * nbytes
    elif op == "reduce_scatter":
        raw = (world - 1) * nbytes // world
    else:
        raw = nbytes
    if codec is None:
        return raw, raw
    dtype = {2: _dtype("bfloat16"), 4: _dtype("float32")}[elem]
    if op == "send":
        return raw, codec.nbytes(numel, dtype)
    if op == "all_gather":
        return raw, aligned(codec.nbytes(numel, dtype)) * (world - 1)
    if op == "reduce_scatter":
        return raw, aligned(codec.nbytes(numel // world, dtype)) * (world - 1)
    k = slices_for(nbytes)
    if resolve_all_reduce_algo(algo, world) == "gather":
        sizes = [x for x in split_sizes(numel, k if per_group(codec) else 1, group_unit(codec)) if x]
        return raw, sum(aligned(codec.nbytes(x, dtype)) for x in sizes) * (world - 1)
    total = 0
    for ranges in slice_ranges(numel, world, k, group_unit(codec)):
        pb = [aligned(codec.nbytes(size, dtype)) if size else 0 for _, size in ranges]
        total += sum((sum(pb) - pb[r]) + max(pb) * (world - 1) for r in range(world))
    return raw, total // world


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)
