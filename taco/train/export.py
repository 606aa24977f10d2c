"""`taco export`: a run's trained weights as one Hugging Face checkpoint that transformers loads.

Why this file exists: training writes sharded checkpoints (`checkpoints/step_N/rank{r}.pt`, each
rank's pipeline stage and tensor-parallel shard); other tools read one full model. `export_run`
rebuilds the full model of the run folder's `config.toml` (the sizes that ran), merges the shards
of one step by the model's tensor-parallel plan (vocab-parallel and column-parallel weights
concatenated along their output rows, row-parallel weights along their input columns, replicated
tensors taken from TP rank 0; pipeline stages each contribute their layers; DP rank 0, or with
`parallel.dp_shard` every DP rank's dim-0 chunk joined in DP-rank order), strips a
vocabulary padded for tensor parallelism back to the checkpoint's own size, and writes
`config.json`, `model.safetensors` and the tokenizer (`tokenizer.json`, plus the
`tokenizer_config.json` / `special_tokens_map.json` of a fine-tuned checkpoint's tokenizer). The
weights are fp32, as the optimiser keeps them.

Chosen over an export at the end of training: it needs no process group, works on any saved step
of a finished or interrupted run, and the trainer keeps one output format (every run saves a
checkpoint at its last step).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from taco.train import dcp
from taco.train.config import Config, load_config

__all__ = ["export_run", "load_run_model"]

_SHARD_DIM = {"vocab_embedding": 0, "colwise": 0, "colwise_head": 0}
"""Styles of `taco.models.plans` whose parameters are split over TP ranks along this dimension;
a row-parallel weight is split along dim 1 (its bias is replicated), the rest is replicated."""


def _step_dir(run_dir: Path, step: int | None) -> Path:
    from taco.train.checkpoint import find_checkpoint

    if step is not None:
        d = run_dir / "checkpoints" / f"step_{step:07d}"
        if not d.is_dir():
            have = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
            raise FileNotFoundError(f"no checkpoint {d}; this run has {have or 'none'}")
        return d
    d = find_checkpoint(True, run_dir)
    if d is None:
        raise FileNotFoundError(
            f"{run_dir} holds no checkpoint (checkpoints/latest): is it a run folder of `taco train`?"
        )
    return d


def _verified_mesh(run_dir: Path, step_dir: Path) -> dict[str, int]:
    """The mesh of the checkpoint in `step_dir`, its files checked against meta.json's sizes and
    sha256 first; a damaged checkpoint is one CheckpointError that names the file and the other
    steps this run has (`taco export --step N`)."""
    from taco.train.checkpoint import verify_checkpoint
    from taco.train.errors import CheckpointError

    others = sorted(
        int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")
        if p != step_dir and (p / "meta.json").is_file()
    )  # fmt: skip
    fix = (
        f"export another step with `taco export --run {run_dir} --step N` (this run also has step "
        f"{', '.join(map(str, others))})"
        if others
        else "this run has no other checkpoint to export"
    )
    try:
        mesh = json.loads((step_dir / "meta.json").read_text())["mesh"]
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir / 'meta.json'} missing: not a complete checkpoint; {fix}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{step_dir / 'meta.json'} is damaged ({e}); {fix}") from None
    verify_checkpoint(step_dir, mesh, fix=fix)
    return mesh


def _merge(
    key: str, style: str, parts: list[torch.Tensor], fused: tuple[int, ...] | None = None
) -> torch.Tensor:
    """The full tensor of parameter `key` from its TP shards (in TP-rank order); `fused`: the full
    block widths of a fused projection (each shard holds its slice of every block, stacked)."""
    if fused is not None and style == "colwise":
        local = [n // len(parts) for n in fused]
        cut = [p.split(local, dim=0) for p in parts]  # per rank, per block
        return torch.cat([torch.cat([c[i] for c in cut], dim=0) for i in range(len(fused))], dim=0)
    if style == "rowwise" and key.endswith(".weight"):
        return torch.cat(parts, dim=1)
    if style in _SHARD_DIM:
        return torch.cat(parts, dim=_SHARD_DIM[style])
    return parts[0]


def _dp_joined(step_dir: Path, dims: Any, mesh: dict[str, int], p: int, t: int) -> dict[str, torch.Tensor]:
    """The model state of stage p, TP rank t: DP rank 0's, its DP-sharded tensors (a
    `parallel.dp_shard` run, FSDP2: dim-0 chunks in DP-rank order) joined from every DP rank."""
    from taco.train.checkpoint import load_checkpoint

    first = load_checkpoint(step_dir, dims.rank_of(0, p, t), mesh)
    keys = first.get("dp_sharded_keys") or []
    if not keys:
        return first["model"]
    rest = [load_checkpoint(step_dir, dims.rank_of(d, p, t), mesh)["model"] for d in range(1, dims.dp)]
    return {**first["model"], **{k: torch.cat([first["model"][k], *(r[k] for r in rest)]) for k in keys}}


def _from_init(cfg: Config, rows: int) -> nn.Module | None:
    """A fine-tuned Llama/Mistral's architecture from its `model.init_from` config.json (its RoPE
    scaling and sliding window are not [model] keys), with `rows` token rows; else None."""
    from taco.models import Llama, read_hf_config

    init = Path(cfg.model.init_from).expanduser() if cfg.model.init_from else None
    if init is None or not (init / "config.json").is_file() or cfg.model.kind.value != "llama":
        return None
    model = Llama(read_hf_config(init)[1])
    model.resize_vocab(rows)
    return model


def load_run_model(run_dir: str | Path, step: int | None = None) -> tuple[nn.Module, int, Config]:
    """(full model of a run with every padded row, the vocabulary to export, the run's config)
    from the checkpoint of `step` (None = the latest) in the run folder `run_dir`."""
    from taco.models import build_model
    from taco.models.plans import resolve_plan
    from taco.models.presets import SIZE_KEYS
    from taco.parallel.dims import ParallelDims

    run_dir = Path(run_dir).expanduser()
    if not (run_dir / "config.toml").is_file():
        raise FileNotFoundError(f"{run_dir / 'config.toml'} not found: give the run folder of `taco train`")
    cfg = load_config(run_dir / "config.toml")
    step_dir = _step_dir(run_dir, step)
    mesh = _verified_mesh(run_dir, step_dir)
    if dcp.is_dcp(step_dir):  # layout-free: read straight into the unsharded model
        rows = dcp.saved_vocab(step_dir)
        sizes = {k: getattr(cfg.model, k) for k in SIZE_KEYS}
        model = _from_init(cfg, rows) or build_model(cfg.model.kind.value, **{**sizes, "vocab_size": rows})
        dcp.load_full_model(model, step_dir)
        return model.eval(), rows, cfg
    dims = ParallelDims(dp=mesh["dp"], pp=mesh["pp"], tp=mesh["tp"])
    shards = {  # (pp rank, tp rank) -> that rank's model state (DP rank 0, or every DP shard joined)
        (p, t): _dp_joined(step_dir, dims, mesh, p, t) for p in range(dims.pp) for t in range(dims.tp)
    }
    rows = shards[(0, 0)]["tok_emb.weight"].shape[0] * dims.tp  # the padded vocabulary that ran
    sizes = {k: getattr(cfg.model, k) for k in SIZE_KEYS}
    model = _from_init(cfg, rows) or build_model(cfg.model.kind.value, **{**sizes, "vocab_size": rows})
    styles = resolve_plan(model)
    tied = model.lm_head.weight is model.tok_emb.weight
    merged: dict[str, torch.Tensor] = {}
    for key in model.state_dict():
        if tied and key == "lm_head.weight":
            continue  # the same tensor as tok_emb.weight (the last stage's copy is kept equal)
        owner = next((p for p in range(dims.pp) if key in shards[(p, 0)]), None)
        if owner is None:
            raise ValueError(f"{step_dir}: no rank holds {key}; was it written by another model?")
        module = key.rpartition(".")[0]
        parts = [shards[(owner, t)][key] for t in range(dims.tp)]
        fused = getattr(model.get_submodule(module), "fused_parts", None)
        merged[key] = _merge(key, styles.get(module, "replicate"), parts, fused)
    if tied:
        merged["lm_head.weight"] = merged["tok_emb.weight"]
    model.load_state_dict(merged)
    vocab = cfg.model.vocab_size if cfg.model.init_from else rows  # a checkpoint's own size
    return model.eval(), vocab, cfg


def _tokenizer_files(cfg: Config) -> tuple[list[Path], dict[str, Any]]:
    """(tokenizer files to copy beside the export, the data set's meta.json or {}) of a run."""
    from taco.train.data import load_meta, resolve_data_dir
    from taco.train.data.tokenizer import tokenizer_file

    try:
        data_dir = resolve_data_dir(cfg.data)
        meta = load_meta(data_dir)
    except (FileNotFoundError, ValueError):
        data_dir, meta = None, {}
    if cfg.data.tokenizer:
        try:
            f = tokenizer_file(cfg.data.tokenizer)
        except FileNotFoundError:
            f = None
        if f is not None:
            extra = [f.parent / n for n in ("tokenizer_config.json", "special_tokens_map.json")]
            return [f, *[e for e in extra if e.is_file()]], meta
    if data_dir is not None and (data_dir / "tokenizer.json").is_file():
        return [data_dir / "tokenizer.json"], meta
    return [], meta


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> dict[str, Any]:
    """Write the run's model (checkpoint of `step`, None = latest) as a Hugging Face checkpoint in
    `out_dir`; return what was written: `out`, `files`, `vocab_size`, `stripped` rows, `step`."""
    from taco.models import save_hf_checkpoint

    model, vocab, cfg = load_run_model(run_dir, step)
    out = Path(out_dir).expanduser()
    save_hf_checkpoint(model, out, vocab_size=vocab)
    files, meta = _tokenizer_files(cfg)
    for f in files:
        shutil.copyfile(f, out / f.name)
    if "eot_id" in meta:  # the data's document separator doubles as bos/eos for generation
        hf = json.loads((out / "config.json").read_text())
        hf.update(bos_token_id=meta["eot_id"], eos_token_id=meta["eot_id"])
        (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    step_dir = _step_dir(Path(run_dir).expanduser(), step)
    return {
        "out": out,
        "files": ["config.json", "model.safetensors", *[f.name for f in files]],
        "vocab_size": vocab,
        "stripped": model.tok_emb.weight.shape[0] - vocab,
        "step": json.loads((step_dir / "meta.json").read_text())["step"],
    }
