"""`taco plan` checked against real steps: parameter, gradient and optimizer bytes exact against
the built model, activation bytes against what saved-tensor hooks count in one training step (each
recompute mode, a TP config and an SP + PP config), TP/PP traffic exact against the per-site
statistics, and the command itself on a real shape (docs/design.md 1.7)."""

from __future__ import annotations

import json
import time

import pytest

from taco.bench import plan_report as R
from taco.cli import main
from taco.parallel.recompute import SavedBytes
from taco.train import plan as P
from taco.train.build import build_run
from taco.train.config import load_config
from taco.train.data import resolve_data_dir
from tests.helpers.dist import run_distributed
from tests.helpers.runs import tiny_args

CONFIGS = {  # bf16 under each train.mixed_precision recipe ("master": micro-batch sums in fp32), fp32
    "gpt-tp2-taco-bf16": [
        "--parallel.tp=2", "--compression.tp_codec=taco", "--model.n_layer=3", "--train.dtype=bf16",
        "--train.mixed_precision=master", "--parallel.microbatches=2",
    ],
    "gpt-tp2-taco-bf16-autocast": [
        "--parallel.tp=2", "--compression.tp_codec=taco", "--model.n_layer=3", "--train.dtype=bf16",
        "--train.mixed_precision=autocast",
    ],
    "qwen-tp2-pp2-sp": [
        "--model.kind=qwen", "--model.n_layer=4", "--model.n_head=4", "--model.n_kv_head=2",
        "--parallel.tp=2", "--parallel.pp=2", "--parallel.sp=true", "--parallel.microbatches=2",
        "--compression.tp_codec=int6-hadamard", "--compression.pp_codec=int8-hadamard",
    ],
}  # fmt: skip


def _body(rank: int, world: int, args: list[str]) -> dict:
    out = {}
    for mode in P.MODES:
        cfg = load_config(None, [*args, f"--train.recompute={mode}"])
        dims = cfg.parallel.dims().build()
        tr = build_run(cfg, dims, resolve_data_dir(cfg.data), device="cpu")
        held = _hold_fp32_sums(tr.opt)
        with SavedBytes(tr.stage) as saved:
            tr.step()
        sh = P.build_shapes(cfg, tr.train_ds.vocab_size)
        stage = dims.pp_rank
        params = list(tr.stage.parameters())
        local = sum(p.numel() for p in params)  # tied copies are separate parameters here
        # AdamW's moments, and with fp32 masters (MasterWeightsOptimizer.state) the masters too
        opt = _nbytes(t for s in tr.opt.state.values() for t in s.values() if t.dim())
        grads = held[0] if held else _nbytes(p.grad for p in params)
        mem = P.memory(cfg, sh)[stage]
        stats = {}
        for axis in ("tp", "pp"):
            pol = tr.policies[axis]
            sites = [s for n, s in pol.stats.sites.items() if not n.endswith(".recv")]
            stats[axis] = (sum(s.raw_bytes for s in sites), sum(s.wire_bytes for s in sites))
        rec = tr.policies["tp"].recompute_stats.sites
        stats["tp recompute"] = (
            sum(s.raw_bytes for s in rec.values()),
            sum(s.wire_bytes for s in rec.values()),
        )
        codecs = {"tp": [cfg.compression.tp_codec], "pp": [cfg.compression.pp_codec], "dp": ["none"]}
        plan = {r["axis"]: (r["raw_bytes"], r["wire_bytes"]) for r in R.traffic(cfg, sh, stage, codecs)}
        out[mode] = {
            "params": (local, sh.stage_params[stage], mem.params, _nbytes(params)),
            "grads": (grads, mem.grads),
            "opt": (opt, mem.optimizer),
            "act": (saved.bytes, P.activation_bytes(cfg, sh, mode, stage) * cfg.parallel.microbatches),
            "traffic": (stats, plan),
        }
    return out


def _hold_fp32_sums(opt) -> list[int]:
    """With micro-batch gradients summed in fp32: a list that gets the bytes of those sums as
    backward leaves them (before `finish_grads` rounds them to bf16); else an empty list."""
    held: list[int] = []
    if getattr(opt, "accumulate_fp32", False):
        finish = opt.finish_grads

        def finish_grads() -> None:
            held.append(_nbytes(p.main_grad for p in opt.params))
            finish()

        opt.finish_grads = finish_grads
    return held


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plan_matches_a_real_step(corpus, tmp_path, name):
    args = [*tiny_args(corpus, tmp_path / "run"), *CONFIGS[name]]
    world = 4 if "pp2" in name else 2
    for rank, res in enumerate(run_distributed(_body, world, args)):
        for mode, r in res.items():
            n, n_plan, b_plan, b = r["params"]
            assert n == n_plan and b == b_plan, (rank, mode, r["params"])
            assert r["grads"][0] == r["grads"][1], (rank, mode, r["grads"])
            assert r["opt"][0] == r["opt"][1], (rank, mode, r["opt"])
            got, pred = r["act"]
            assert pred == got, (rank, mode, got, pred)
            stats, plan = r["traffic"]
            for axis, (raw, wire) in stats.items():
                if raw or axis in plan:
                    assert plan.get(axis) == (raw, wire), (rank, mode, axis, plan.get(axis), (raw, wire))


def test_plan_prints_a_real_shape_quickly_and_names_the_fix(capsys, tmp_path):
    t0 = time.perf_counter()
    code = main(["plan", "--model.preset=llama3-8b", "--parallel.tp=8", "--gpu", "h100", "--link", "pcie5",
                 "--json", str(tmp_path / "plan.json")])  # fmt: skip
    seconds = time.perf_counter() - t0
    out, err = capsys.readouterr()
    assert code == 2 and "does not fit" in err and "train.recompute=full" in err, err
    assert "Memory per GPU" in out and "Predicted step time" in out and "Assumptions:" in out, out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["model"]["params"] == 8_030_457_856  # Llama-3-8B + the qwen family's q/k/v biases
    assert plan["step"]["taco"]["speedup"] > 1.0  # PCIe: compression pays
    assert seconds < 5.0, seconds
    fits = main(["plan", "--model.preset=llama3-8b", "--parallel.tp=8", "--set", "train.recompute=full",
                 "--set", "train.batch_size=8", "--set", "train.dtype=bf16"])  # fmt: skip
    assert fits == 0, capsys.readouterr().err


def test_plan_refuses_a_mesh_the_model_cannot_split(capsys):
    assert main(["plan", "--model.preset=gpt2", "--parallel.tp=8"]) == 2
    assert "tp" in capsys.readouterr().err
