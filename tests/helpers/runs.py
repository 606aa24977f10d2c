"""Runs of the tests: the tiny trainer configurations (`tiny_args`, `tiny`, `run_config`), their
losses and exact-resume check, and `parallel_step`, the shared body of the pipeline, data-parallel and
3D tests: one training step of a tiny GPT/Qwen on a mesh, compared with the unsharded model on the
whole batch (asserted in the rank, values in the message)."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from taco.cli import main
from taco.comm import CommPolicy
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
from taco.parallel.torch_private import local_tensor
from taco.train.config import load_config
from taco.train.launch import launch
from tests.helpers.dist import assert_close, assert_equal
from tests.helpers.models import SEQ, VOCAB, tiny_model


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
    tp_overlap_chunks: int = 1,
    tp_chunked: bool = False,
    dp_shard: bool = False,
) -> dict:
    """One step on a (dp, pp, tp) mesh; grads compared with the reference when `tol` is set.
    `check_sizes`: the policies' size check (p2p headers) on; `tp_overlap_chunks` > 1: batch-split
    TP overlap with that many pieces per micro-batch; `tp_chunked`: the chunked SP rings;
    `dp_shard`: FSDP2 over DP (each rank's gradients are its dim-0 shards, returned as "grads")."""
    torch.manual_seed(0)
    model = tiny_model(kind, n_layer)
    ref = copy.deepcopy(model)
    batch = 2 * dp * n_micro
    idx = torch.randint(0, VOCAB, (batch, SEQ))
    tgt = torch.randint(0, VOCAB, (batch, SEQ))
    codecs = codecs or {}
    pol = {a: CommPolicy(codec=codecs.get(a, "none"), check_sizes=check_sizes) for a in ("tp", "pp", "dp")}
    dims = ParallelDims(dp=dp, pp=pp, tp=tp, sp=sp).build()
    opts = ParallelOptions(
        overlap_wgrad=overlap_wgrad, dp_codec=codecs.get("dp"), schedule=schedule, overlap_p2p=overlap_p2p,
        tp_overlap_chunks=tp_overlap_chunks, tp_chunked=tp_chunked, dp_shard=dp_shard,
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
    grads = {}  # name -> this rank's gradient (its FSDP2 shard with dp_shard)
    for mname, mod in stage.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}".removeprefix("model.")
            exp = _ref_grad(ref, mod, full, pname, tp, dims.tp_rank)
            got = local_tensor(p.grad)
            if dp_shard and dp > 1:  # FSDP2 shards dim 0 as torch.chunk
                exp = exp.chunk(dp, 0)[dims.dp_rank]
            grads[full] = got.detach().clone()
            diff2 += (got - exp).square().sum().item()
            ref2 += exp.square().sum().item()
            if tol is not None:
                assert_close(got, exp, f"grad {full}", rtol=tol, atol=1e-6)
            out["checked"] += 1
    if dp_shard:
        out["grads"] = grads
    out["grad_err"] = math.sqrt(diff2 / ref2)  # relative error of this rank's gradient vector
    out["grad_digest"] = [local_tensor(p.grad).double().sum().item() for p in stage.parameters()]
    grad_bytes = b"".join(local_tensor(p.grad).numpy().tobytes() for p in stage.parameters())
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


def run_config(corpus, out, *extra):
    from taco.train.config import load_config

    return load_config(None, [*tiny_args(corpus, out), "--train.eval_steps=1", *extra])


def resume_exact(corpus, tmp_path, mesh: list[str]) -> dict:
    full = launch(run_config(corpus, tmp_path / "full", "--train.steps=4", *mesh))
    launch(run_config(corpus, tmp_path / "part", "--train.steps=2", "--train.checkpoint_interval=2", *mesh))
    resumed = launch(run_config(corpus, tmp_path / "part", "--train.steps=4", "--train.resume=true", *mesh))
    assert resumed["resumed_from"] == 2
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]  # bit-exact
    assert full["final_val_loss"] == resumed["final_val_loss"]
    return full


def tiny(corpus, out, *extra):
    """The small TP=2 run of these tests: `tiny_args` plus steps, eval/log cadence and the codec."""
    return load_config(
        None,
        [
            *tiny_args(corpus, out),
            "--model.kind=gpt",
            "--train.steps=6",
            "--train.warmup_steps=2",
            "--train.eval_interval=3",
            "--train.eval_steps=2",
            "--train.log_interval=3",
            "--parallel.tp=2",
            "--compression.tp_codec=taco",
            *extra,
        ],
    )


def losses(out: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs}


def cli_error(capsys, argv):
    assert main(argv) == 2
    return capsys.readouterr().err


def tiny_args(corpus, out):
    path, cache = corpus
    return [
        "--model.n_layer=2",
        "--model.n_head=4",
        "--model.hidden=32",
        "--model.seq_len=32",
        "--data.dataset=text",
        f"--data.path={path}",
        f"--data.cache_dir={cache}",
        "--data.vocab_size=300",
        "--train.batch_size=4",
        "--train.steps=2",
        f"--train.out_dir={out}",
    ]
