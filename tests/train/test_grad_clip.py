"""Gradient clipping: the global norm in fp32 from `_foreach_norm` (no float64 copies), counted over
the mesh as `Run.grad_sums` counts it, and the clipping rule unchanged (scale by
max_norm / (norm + 1e-6) above the bound, gradients untouched at or below it)."""

from __future__ import annotations

import pytest
import torch

from taco.train.build import build_run
from taco.train.config import load_config
from taco.train.data import resolve_data_dir
from taco.train.grads import sum_squares
from tests.helpers.dist import assert_close, assert_equal, run_distributed
from tests.helpers.runs import tiny_args


def test_sum_squares_is_the_fp32_sum_of_squares_of_every_dtype():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(300, generator=g), torch.randn(7, 5, generator=g).bfloat16(), torch.zeros(0)]
    got = sum_squares(grads, torch.device("cpu"))
    want = sum(t.double().square().sum() for t in grads)
    assert got.dtype == torch.float32 and got.shape == (1,)
    assert_close(got.double(), want.reshape(1), "sum of squares", rtol=1e-6, atol=0)
    assert torch.equal(sum_squares([], torch.device("cpu")), torch.zeros(1))


def _clip_body(rank: int, world: int, args: list[str]) -> float:
    cfg = load_config(None, args)
    tr = build_run(cfg, cfg.parallel.dims().build(), resolve_data_dir(cfg.data), device="cpu")
    params = list(tr.stage.parameters())
    tr.cfg.train.grad_clip = 0.0
    _, norm = tr.compute_gradients()  # the raw gradients and their global norm
    raw = [p.grad.clone() for p in params]
    exact = tr.grad_sums(lambda p, g: g.double().square().sum().reshape(1))[0].sqrt()  # fp64 reference
    assert norm.dtype == torch.float32 and norm.shape == (), (norm.dtype, norm.shape)
    assert_close(norm.double(), exact, "fp32 global norm vs the fp64 sum", rtol=1e-6, atol=0)
    for bound in (float(exact) / 4, float(exact) * 4):  # clipped, then left alone
        tr.cfg.train.grad_clip = bound
        _, again = tr.compute_gradients()  # the same step and batch: the same raw gradients
        assert_equal(again, norm, "norm before clipping")
        scale = bound / (norm + 1e-6) if norm > bound else torch.ones(())
        for i, (p, r) in enumerate(zip(params, raw)):
            assert_close(p.grad, r * scale, f"clipped grad {i} at max_norm {bound:.4g}", rtol=1e-6, atol=0)
        if bound > norm:
            assert all(torch.equal(p.grad, r) for p, r in zip(params, raw)), "clipping changed gradients"
    return float(norm)


@pytest.mark.parametrize("mesh", [["--parallel.tp=2"], ["--parallel.pp=2"]], ids=["tp2", "pp2-tied"])
def test_clip_norm_is_fp32_over_the_mesh_and_clips_as_before(corpus, tmp_path, mesh):
    args = [*tiny_args(corpus, tmp_path / "run"), *mesh]
    norms = run_distributed(_clip_body, 2, args)
    assert norms[0] == norms[1]  # every rank of the mesh holds the same norm
