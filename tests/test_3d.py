"""3D parallelism (dp, pp, tp) against the single-process reference, and with every axis compressed.

`parallel_step` is the shared body of the pipeline, data-parallel and 3D tests: one training
step of a tiny GPT/Qwen on a mesh, returning the per-axis statistics and comparing loss and every
gradient with the unsharded model on the whole batch (asserted in the rank, values in the message).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from taco.comm import CommPolicy
from taco.models import GPT, GPTConfig, Qwen, QwenConfig
from taco.parallel import (
    ColumnParallelLinear,
    ParallelDims,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from taco.parallel.data_parallel import (
    build_optimizer,
    close_data_parallel,
    load_optimizer_state,
    optimizer_state,
)
from taco.parallel.parallelize import ParallelOptions, parallelize
from taco.parallel.tags import dp_hook_state
from taco.train.launch import launch
from tests.dist import assert_close, assert_equal, run_distributed
from tests.test_train import _err, losses, tiny_args

VOCAB, SEQ = 64, 8


def tiny(kind: str, n_layer: int = 3) -> nn.Module:
    if kind == "gpt":  # tied embeddings
        return GPT(GPTConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=4, n_embd=32, block_size=SEQ))
    return Qwen(  # untied lm_head
        QwenConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=n_layer,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
    )


def _ref_grad(ref: nn.Module, mod: nn.Module, full: str, pname: str, tp: int, r: int) -> torch.Tensor:
    ref_params = dict(ref.named_parameters())
    g = ref_params[full if full in ref_params else "tok_emb.weight"].grad  # tied lm_head: tok_emb
    parts = getattr(mod, "fused_parts", None)
    if parts is not None:  # fused q/k/v or gate/up: this rank's slice of every block, stacked
        return torch.cat([b.chunk(tp, 0)[r] for b in g.split([n * tp for n in parts], 0)])
    if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
        return g.chunk(tp, 0)[r]
    if isinstance(mod, RowParallelLinear) and pname == "weight":
        return g.chunk(tp, 1)[r]
    return g


def parallel_step(
    rank: int,
    world: int,
    kind: str,
    dp: int,
    pp: int,
    tp: int,
    *,
    sp: bool = False,
    schedule: str = "1f1b",
    n_micro: int = 2,
    n_layer: int = 3,
    codecs: dict[str, str] | None = None,
    tol: float | None = 1e-4,
    zero: bool = False,
    overlap_p2p: bool = True,
    overlap_wgrad: bool = True,
    check_sizes: bool = False,
) -> dict:
    """One step on a (dp, pp, tp) mesh; grads compared with the reference when `tol` is set.
    `check_sizes`: the policies' size check (p2p headers) on."""
    torch.manual_seed(0)
    model = tiny(kind, n_layer)
    ref = copy.deepcopy(model)
    batch = 2 * dp * n_micro
    idx = torch.randint(0, VOCAB, (batch, SEQ))
    tgt = torch.randint(0, VOCAB, (batch, SEQ))
    codecs = codecs or {}
    pol = {a: CommPolicy(codec=codecs.get(a, "none"), check_sizes=check_sizes) for a in ("tp", "pp", "dp")}
    dims = ParallelDims(dp=dp, pp=pp, tp=tp, sp=sp).build()
    opts = ParallelOptions(
        overlap_wgrad=overlap_wgrad, dp_codec=codecs.get("dp"), schedule=schedule, overlap_p2p=overlap_p2p
    )
    par = parallelize(model, dims, pol, opts)  # the trainer's build step (taco.train.build.build_run)
    stage, module, engine = par.stage, par.module, par.engine
    tp_group = dims.group("tp")

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, y, tp_group).mean()

    x, y = idx.chunk(dp)[dims.dp_rank], tgt.chunk(dp)[dims.dp_rank]
    loss = engine.train_step(x, y, n_micro, loss_fn)
    par.reduce_grads()
    if dp > 1:
        dist.all_reduce(loss, group=dims.group("dp"))
        loss /= dp
    ref_loss = nn.functional.cross_entropy(ref(idx).flatten(0, 1), tgt.flatten())
    ref_loss.backward()
    out = {"loss": loss.item(), "ref_loss": ref_loss.item(), "checked": 0}
    diff2 = ref2 = 0.0
    for mname, mod in stage.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}".removeprefix("model.")
            exp = _ref_grad(ref, mod, full, pname, tp, dims.tp_rank)
            diff2 += (p.grad - exp).square().sum().item()
            ref2 += exp.square().sum().item()
            if tol is not None:
                assert_close(p.grad, exp, f"grad {full}", rtol=tol, atol=1e-6)
            out["checked"] += 1
    out["grad_err"] = math.sqrt(diff2 / ref2)  # relative error of this rank's gradient vector
    out["grad_digest"] = [p.grad.double().sum().item() for p in stage.parameters()]
    grad_bytes = b"".join(p.grad.numpy().tobytes() for p in stage.parameters())
    out["grad_sha"] = hashlib.sha256(grad_bytes).hexdigest()
    if tol is not None:
        got, want = out["loss"], out["ref_loss"]
        assert math.isclose(got, want, rel_tol=1e-5), f"loss {got!r} vs reference {want!r}: rel_tol 1e-5"
    for a, p in pol.items():
        sent = [s for n, s in p.stats.sites.items() if not n.endswith(".recv")]
        out[f"{a}_wire"] = sum(s.wire_bytes for s in sent)
        out[f"{a}_raw"] = sum(s.raw_bytes for s in sent)
    st = dp_hook_state(module)
    out["dp_hook_calls"] = st.calls if st is not None else 0
    close_data_parallel(module)
    if zero:  # ZeRO-1 and plain AdamW take the same step
        names = [n for n, _ in stage.named_parameters()]
        params = [p for _, p in stage.named_parameters()]
        plain = [p.detach().clone() for p in params]
        twin = [nn.Parameter(p.clone()) for p in plain]
        for t, p in zip(twin, params):
            t.grad = p.grad.clone()
        kw = dict(lr=1e-2, betas=(0.9, 0.95))
        zopt = build_optimizer([{"params": params, "weight_decay": 0.1}], dims.group("dp"), zero=True, **kw)
        zopt.step()
        build_optimizer([{"params": twin, "weight_decay": 0.1}], None, **kw).step()
        for name, p, t in zip(names, params, twin):
            assert_close(p, t, f"ZeRO-1 vs AdamW, {name}", rtol=1e-6, atol=1e-7)
        again = build_optimizer([{"params": params, "weight_decay": 0.1}], dims.group("dp"), zero=True, **kw)
        load_optimizer_state(again, optimizer_state(zopt))  # a per-rank checkpoint of the shard
        a, b = optimizer_state(zopt)["state"], optimizer_state(again)["state"]
        assert a.keys() == b.keys(), f"ZeRO-1 state round trip: keys {sorted(b)}, saved {sorted(a)}"
        for i in a:
            assert_equal(b[i]["exp_avg"], a[i]["exp_avg"], f"ZeRO-1 state round trip: exp_avg of {i}")
    return out


def _both_models_3d(rank: int, world: int) -> list[dict]:
    gpt = parallel_step(rank, world, "gpt", 2, 2, 2, schedule="1f1b", n_micro=2)
    qwen = parallel_step(rank, world, "qwen", 2, 2, 2, sp=True, schedule="gpipe", n_micro=2)
    on = {"tp": "taco", "pp": "taco", "dp": "int8-hadamard"}
    comp = parallel_step(rank, world, "gpt", 2, 2, 2, n_micro=2, codecs=on, tol=None)
    return [gpt, qwen, comp]


@pytest.mark.slow  # 8 gloo ranks: ~70 s on the shared 2-core box
def test_3d_step_matches_reference_and_compresses_every_axis():
    res = run_distributed(_both_models_3d, 8, timeout=300)
    for gpt, qwen, comp in res:
        assert gpt["checked"] > 0 and qwen["checked"] > 0  # every gradient matched the reference
        assert math.isfinite(comp["loss"]) and abs(comp["loss"] - comp["ref_loss"]) < 0.02
        assert comp["grad_err"] < 0.2, comp["grad_err"]
        assert 0 < comp["tp_wire"] < 0.6 * comp["tp_raw"]
        assert 0 < comp["dp_wire"] < 0.6 * comp["dp_raw"]
        assert comp["dp_hook_calls"] >= 1
        assert 0 < comp["pp_wire"] < 0.6 * comp["pp_raw"]  # stage 0 sends activations, 1 gradients


def _pp_tp(rank: int, world: int) -> list[dict]:
    return [
        parallel_step(rank, world, "gpt", 1, 2, 2, schedule="1f1b", n_micro=4),
        parallel_step(rank, world, "qwen", 1, 2, 2, sp=True, n_micro=2),  # [b, s/tp, h] between stages
    ]


def test_pp_with_tp_and_sequence_parallel_stages_matches_reference():
    for gpt, qwen in run_distributed(_pp_tp, 4):
        assert gpt["checked"] > 0 and qwen["checked"] > 0


# -- the trainer on pipeline / 3D meshes ------------------------------------------------------------


def _cfg(corpus, out, *extra):
    from taco.train.config import load_config

    return load_config(None, [*tiny_args(corpus, out), "--train.eval_steps=1", *extra])


def _resume_exact(corpus, tmp_path, mesh: list[str]) -> dict:
    full = launch(_cfg(corpus, tmp_path / "full", "--train.steps=4", *mesh))
    launch(_cfg(corpus, tmp_path / "part", "--train.steps=2", "--train.checkpoint_interval=2", *mesh))
    resumed = launch(_cfg(corpus, tmp_path / "part", "--train.steps=4", "--train.resume=true", *mesh))
    assert resumed["resumed_from"] == 2
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]  # bit-exact
    assert full["final_val_loss"] == resumed["final_val_loss"]
    return full


def test_trainer_pipeline_reports_bytes_per_axis(corpus, tmp_path):
    mesh = ["--parallel.pp=2", "--parallel.microbatches=2", "--compression.pp_codec=int4-hadamard"]
    res = launch(_cfg(corpus, tmp_path / "pp", *mesh))
    assert math.isfinite(res["final_val_loss"]) and res["mesh"] == "DP1-PP2-TP1"
    assert 0 < res["pp_wire_bytes_per_step"] < 0.6 * res["pp_raw_bytes_per_step"]
    assert res["tp_raw_bytes_per_step"] == res["dp_raw_bytes_per_step"] == 0
    rec = json.loads((tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"tp_wire_bytes", "pp_wire_bytes", "dp_wire_bytes", "pp_raw_bytes", "val_loss"} <= set(rec)


@pytest.mark.slow  # 3 runs of 2 ranks each: ~35 s apiece
@pytest.mark.parametrize("axis", ["pp", "dp"])
def test_trainer_pipeline_or_compressed_dp_resumes_exactly(corpus, tmp_path, axis):
    codec = "int4-hadamard" if axis == "pp" else "int8-hadamard"
    mesh = [f"--parallel.{axis}=2", "--parallel.microbatches=2", f"--compression.{axis}_codec={codec}"]
    _resume_exact(corpus, tmp_path, mesh)


@pytest.mark.slow  # 3 runs of 8 ranks
def test_trainer_3d_with_every_axis_compressed_resumes_exactly(corpus, tmp_path):
    mesh = ["--parallel.dp=2", "--parallel.pp=2", "--parallel.tp=2", "--parallel.microbatches=2"]
    mesh += ["--compression.tp_codec=taco", "--compression.pp_codec=taco"]
    mesh += ["--compression.dp_codec=int8-hadamard"]
    res = _resume_exact(corpus, tmp_path, mesh)
    assert res["mesh"] == "DP2-PP2-TP2"
    for a in ("tp", "pp", "dp"):
        assert 0 < res[f"{a}_wire_bytes_per_step"] < 0.6 * res[f"{a}_raw_bytes_per_step"], a
    assert "[dp]" in (tmp_path / "full" / "comm_stats.txt").read_text()


def test_bad_meshes_stop_at_start_up_with_one_clear_message(corpus, tmp_path, capsys, monkeypatch):
    base = ["train", *tiny_args(corpus, tmp_path / "x")]
    e = _err(capsys, [*base, "--parallel.pp=3"])
    assert "parallel.pp = 3" in e and "n_layer = 2" in e
    e = _err(capsys, [*base, "--parallel.microbatches=3"])
    assert "batch_size = 4 must be divisible" in e and "microbatches" in e
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    e = _err(capsys, [*base, "--parallel.pp=2"])
    assert "= 2 but torchrun started 3 ranks" in e


def test_codec_none_ignores_options_left_in_the_config():
    from taco.train.build import build_axis_policy, build_policy
    from taco.train.config import load_config

    opts = [f"--compression.{a}_codec_options.group_size=64" for a in ("tp", "pp", "dp")]
    cfg = load_config(None, ["--compression.tp_codec=none", *opts])  # e.g. a baseline of demo.toml
    assert build_policy(cfg).codec_for("x", 1 << 20, torch.float32) is None
    assert build_axis_policy(cfg, "pp").codec_for("pp.act", 1 << 20, torch.float32) is None
