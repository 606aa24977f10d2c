"""Every tensor the project makes has an explicit device: a training step with the default on `meta`.

A factory without `device=` (`torch.zeros(())`, `torch.tensor([...])`, `torch.empty(shape)`) follows
`torch.set_default_device`. With the default set to "meta" while each rank trains on the CPU, such a
tensor lands on meta and the step fails loudly (meta and CPU tensors do not mix; gloo cannot send
meta tensors), which is what would happen on CUDA with a CPU tensor. The optimizer step stays
outside: torch's own optimizers create their step counters on the default device.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from taco.train.build import build_run, train_dtype
from taco.train.config import load_config
from taco.train.data import resolve_data_dir
from tests.helpers.dist import run_distributed


def _args(corpus, out: Path, *mesh: str) -> list[str]:
    path, cache = corpus
    return [
        "--model.n_layer=2", "--model.n_head=4", "--model.hidden=32", "--model.seq_len=32",
        "--data.dataset=text", f"--data.path={path}", f"--data.cache_dir={cache}", "--data.vocab_size=300",
        "--train.batch_size=8", "--train.steps=2", "--train.eval_steps=1", "--train.device=cpu",
        f"--train.out_dir={out}", *mesh,
    ]  # fmt: skip


def _meta_step(rank: int, world: int, args: list[str]) -> None:
    cfg = load_config(None, args)
    trainer = build_run(cfg, cfg.parallel.dims().build(), resolve_data_dir(cfg.data), device="cpu")
    before = trainer.byte_counters()
    torch.set_default_device("meta")
    try:
        loss, norm = trainer.compute_gradients()  # forward, backward, TP/PP/DP communication, clipping
        d = [a - b for a, b in zip(trainer.byte_counters(), before)]
        wire, raw = {"tp": d[0]}, {"tp": d[1]}  # this rank's TP bytes (AXES starts with tp)
        val = trainer.evaluate()
    finally:
        torch.set_default_device(None)
    trainer.opt.step()
    for name, t in (("loss", loss), ("grad norm", norm)):
        assert t.device == torch.device("cpu"), f"{name} on {t.device}, expected the rank's device (cpu)"
        assert torch.isfinite(t), f"{name} = {t}"
    for p in trainer.stage.parameters():
        assert p.device.type == "cpu" and p.grad is not None and p.grad.device.type == "cpu", p.shape
    assert val == val and wire["tp"] > 0 and raw["tp"] > wire["tp"], (val, wire, raw)
    if cfg.parallel.pp > 1 and trainer.dims.pp_rank == 0:  # activations travel in the training dtype
        m = cfg.model
        numel = cfg.local_batch_size * (m.seq_len // cfg.parallel.tp) * m.hidden  # [b, s/tp, h] in all
        sent, want = trainer.policies["pp"].stats["pp.act"].raw_bytes, numel * train_dtype(cfg).itemsize
        assert sent == want, f"pp.act sent {sent} raw bytes, expected {want} ({cfg.train.dtype})"


@pytest.mark.parametrize(
    "mesh",
    [
        # TP + SP inside two pipeline stages (1F1B), every axis compressed
        ["--parallel.tp=2", "--parallel.sp=true", "--parallel.pp=2", "--parallel.microbatches=2",
         "--compression.pp_codec=taco", "--train.dtype=bf16"],
        # TP with data parallelism: the compressing DDP hook and ZeRO-1
        ["--parallel.tp=2", "--parallel.dp=2", "--parallel.zero=true",
         "--compression.dp_codec=int8-hadamard"],
    ],  # fmt: skip
    ids=["tp2-sp-pp2-1f1b", "dp2-tp2-zero"],
)
def test_no_tensor_is_made_without_a_device(corpus, tmp_path, mesh):
    run_distributed(_meta_step, 4, _args(corpus, tmp_path / "run", *mesh))
