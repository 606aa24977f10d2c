"""Tensor-parallel plans for ``GPT`` and ``Qwen``, as data (no distribution code here).

Why this file exists: the models know nothing of distribution; ``taco.parallel`` applies tensor
parallelism by reading a plan that says, per module, how it is sharded (Megatron placement,
arXiv 1909.08053; torchtitan's plan-dict style). Keeping the plan beside the models means a new
model brings its own plan and the parallel code stays model-agnostic.

Plan format: ``dict[str, str]`` from a module-name glob (``fnmatch.fnmatchcase`` on the full
dotted name from ``model.named_modules()``, ``*`` also matching dots) to one style:

* ``"vocab_embedding"``: ``nn.Embedding`` sharded on vocabulary rows (``tok_emb``); each rank
  looks up its rows, zeroes the others, and the outputs are summed (all-reduce).
* ``"colwise"``: ``nn.Linear`` with output features sharded (``attn.qkv``, ``mlp.up``,
  ``mlp.gate_up``); attention heads split evenly, so heads and key/value heads must divide by tp.
  A fused projection (``fused_parts``, ``taco.models.decoder.fused_linear``) is sharded block by
  block, so each rank holds its q, k and v (or gate and up) slices contiguous.
* ``"rowwise"``: ``nn.Linear`` with input features sharded (``attn.out``, ``mlp.down``); its
  partial outputs are summed across ranks, the bias added once.
* ``"colwise_head"``: the output projection ``lm_head`` with vocabulary-sharded logits; when the
  model ties embeddings its weight shard is the ``vocab_embedding`` shard.
* ``"replicate"``: every rank holds the full module (norms, ``pos_emb``).

Every module that owns parameters matches exactly one pattern (``resolve_plan`` checks this).

Communication sites (``sites``): per layer ``i``, in execution order,
``layers.{i}.attn.qkv`` (column-parallel input of the fused q/k/v: all-reduce of the input gradient in
backward, or all-gather in forward with sequence parallelism), ``layers.{i}.attn.out``
(row-parallel output: all-reduce in forward, or reduce-scatter with SP), ``layers.{i}.mlp.up``
(column-parallel input of ``up``, for Qwen the fused ``gate_up``) and
``layers.{i}.mlp.down`` (row-parallel output). ``taco.comm`` appends ``.fwd``/``.bwd``.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

from torch import nn

from taco.models.gpt import GPT
from taco.models.qwen import Qwen

STYLES = ("vocab_embedding", "colwise", "rowwise", "colwise_head", "replicate")

_COMMON = {
    "tok_emb": "vocab_embedding",
    "layers.*.attn_norm": "replicate",
    "layers.*.attn.qkv": "colwise",
    "layers.*.attn.out": "rowwise",
    "layers.*.mlp_norm": "replicate",
    "layers.*.mlp.down": "rowwise",
    "norm": "replicate",
    "lm_head": "colwise_head",
}


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The tensor-parallel plan of ``model`` (a fresh dict the caller may edit)."""
    if isinstance(model, GPT):
        return {**_COMMON, "pos_emb": "replicate", "layers.*.mlp.up": "colwise"}
    if isinstance(model, Qwen):
        plan = {**_COMMON, "layers.*.mlp.gate_up": "colwise"}
        if model.config.qk_norm:  # per-head norms act on head_dim, identical on every rank
            plan |= {"layers.*.attn.q_norm": "replicate", "layers.*.attn.k_norm": "replicate"}
        return plan
    raise TypeError(f"no tensor-parallel plan for {type(model).__name__}; expected GPT or Qwen")


def resolve_plan(model: nn.Module, plan: dict[str, str] | None = None) -> dict[str, str]:
    """Map each module that owns parameters to its style; raise if one matches none or several."""
    plan = tp_plan(model) if plan is None else plan
    unknown = sorted({s for s in plan.values() if s not in STYLES})
    if unknown:
        raise ValueError(f"unknown tensor-parallel styles {unknown}; expected one of {STYLES}")
    resolved: dict[str, str] = {}
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        hits = [pattern for pattern in plan if fnmatchcase(name, pattern)]
        if len(hits) != 1:
            what = "no pattern" if not hits else f"several patterns {hits}"
            raise ValueError(f"module {name!r} matches {what} of the tensor-parallel plan")
        resolved[name] = plan[hits[0]]
    return resolved


def sites(model: nn.Module) -> list[str]:
    """Tensor-parallel communication-site base names, per layer in execution order."""
    return [
        f"layers.{i}.{site}"
        for i in range(len(model.layers))
        for site in ("attn.qkv", "attn.out", "mlp.up", "mlp.down")
    ]


def check_tp_divisible(sizes: Mapping[str, int], tp: int, tp_name: str = "tp") -> None:
    """The one tensor-parallel divisibility check: every size that TP splits (name -> size) must
    be divisible by `tp`; raise ``ValueError`` naming each offender and the fix otherwise.

    The config (before any rank starts), ``check_tp_size`` (a built model) and the sharding of a
    single weight all call this, so the rule and its message live here only.
    """
    if tp < 1:
        raise ValueError(f"{tp_name} = {tp}: the tensor-parallel size must be >= 1")
    bad = [f"{name} = {n}" for name, n in sizes.items() if n % tp]
    if bad:
        more = f" (and so must {', '.join(bad[1:])})" if len(bad) > 1 else ""
        raise ValueError(
            f"{bad[0]} must be divisible by {tp_name} = {tp}{more}: choose a {tp_name} that divides "
            "every size it splits, or change the size (a vocabulary can be padded)"
        )


_TP_SPLIT_FIELDS = ("n_head", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def check_tp_size(model: nn.Module, tp: int) -> None:
    """Raise ``ValueError`` naming the fix when ``model`` cannot be split ``tp`` ways by its plan.

    Checks the head counts, MLP width and vocabulary of ``model.config`` that are present (GPT:
    ``n_head``, ``vocab_size``; Qwen: heads, key/value heads, ``intermediate_size``, ``vocab_size``).
    """
    cfg = getattr(model, "config", None)
    sizes = {f: getattr(cfg, f) for f in _TP_SPLIT_FIELDS if isinstance(getattr(cfg, f, None), int)}
    check_tp_divisible(sizes, tp)
