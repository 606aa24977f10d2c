"""bf16 parameters with fp32 master weights (train.mixed_precision = "master"): the optimizer steps
the fp32 masters exactly as fp32 AdamW would with the same gradients, the model holds their bf16
rounding, micro-batch gradients sum in fp32, the state round-trips, and a bf16 run resumes exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from taco.parallel.master_weights import MasterWeightsOptimizer
from taco.train.launch import launch
from tests.helpers.runs import losses, tiny


def _pair(seed: int = 0) -> tuple[nn.Module, list[dict]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return model, [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2)


def test_masters_step_as_fp32_adamw_and_the_model_holds_their_bf16_rounding():
    ref, ref_groups = _pair()
    ref_opt = _adamw(ref_groups)
    model, groups = _pair()
    init = {id(p): p.detach().clone() for p in model.parameters()}  # fp32, before the cast
    model.to(torch.bfloat16)
    opt = MasterWeightsOptimizer(groups, _adamw, init=init)
    assert all(m.dtype == torch.float32 for m in opt.masters)
    refs = [r for g in ref_groups for r in g["params"]]  # the optimizer's order: by group
    for p, r in zip(opt.masters, refs):  # masters start from the fp32 init, exactly
        torch.testing.assert_close(p, r.detach(), rtol=0, atol=0)
    for step in range(3):
        x = torch.randn(5, 8)
        opt.zero_grad()
        model(x.bfloat16()).float().square().mean().backward()
        ref_opt.zero_grad()
        for r, p in zip(refs, opt.params):
            r.grad = p.grad.float().clone()  # the same (bf16) gradients, in an fp32 AdamW
        ref_opt.step()
        opt.step()
        for p, m, r in zip(opt.params, opt.masters, refs):
            assert p.dtype == torch.bfloat16
            torch.testing.assert_close(m, r.detach(), rtol=0, atol=0, msg=f"master, step {step}")
            assert torch.equal(p, m.to(torch.bfloat16)), f"bf16 parameter != rounded master, step {step}"


def test_micro_batch_gradients_sum_in_fp32_and_round_once():
    model, groups = _pair()
    model.to(torch.bfloat16)
    opt = MasterWeightsOptimizer(groups, _adamw, accumulate_fp32=True)
    xs = [torch.randn(5, 8).bfloat16() for _ in range(4)]
    per = []
    for x in xs:  # each micro-batch's bf16 gradient, alone
        model.zero_grad(set_to_none=True)
        for p in model.parameters():
            p.main_grad = None
        model(x).float().square().mean().backward()
        per.append([p.main_grad.clone() for p in model.parameters()])
    opt.zero_grad()
    for x in xs:
        model(x).float().square().mean().backward()
        assert all(p.grad is None for p in model.parameters()), "the hook left a bf16 gradient behind"
    opt.finish_grads()
    for i, p in enumerate(model.parameters()):
        want = sum(g[i] for g in per).to(torch.bfloat16)  # fp32 sum, one rounding
        assert torch.equal(p.grad, want), f"parameter {i}: gradient is not the fp32 sum rounded once"


def test_state_round_trips_the_fp32_masters():
    model, groups = _pair()
    model.to(torch.bfloat16)
    opt = MasterWeightsOptimizer(groups, _adamw)
    model(torch.randn(3, 8).bfloat16()).float().sum().backward()
    opt.step()
    state = opt.state_dict()
    model2, groups2 = _pair(seed=5)
    model2.to(torch.bfloat16)
    opt2 = MasterWeightsOptimizer(groups2, _adamw)
    opt2.load_state_dict(state)
    for a, b in zip(opt.masters, opt2.masters):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="master weights"):
        opt2.load_state_dict(state["inner"])


def test_state_view_shows_each_parameters_master_and_moments_read_only():
    model, groups = _pair()
    model.to(torch.bfloat16)
    opt = MasterWeightsOptimizer(groups, _adamw)
    assert set(opt.state) == set(model.parameters()) and all(set(s) == {"master"} for s in opt.state.values())
    model(torch.randn(3, 8).bfloat16()).float().sum().backward()
    opt.step()
    for p, m in zip(opt.params, opt.masters):
        s = opt.state[p]
        assert s["master"] is m and s["exp_avg"] is opt.inner.state[m]["exp_avg"], "not the live tensors"
        assert s["exp_avg_sq"].shape == p.shape and s["exp_avg"].dtype == torch.float32
    with pytest.raises(TypeError):
        opt.state[opt.params[0]] = {}
    with pytest.raises(TypeError):
        opt.state[opt.params[0]]["master"] = None


@pytest.mark.parametrize("micro", [1, 2])
def test_a_bf16_master_run_trains_in_bf16_and_resumes_exactly(corpus, tmp_path, micro):
    extra = ("--train.dtype=bf16", "--train.mixed_precision=master", f"--parallel.microbatches={micro}")
    full = launch(tiny(corpus, tmp_path / "full", *extra))
    launch(tiny(corpus, tmp_path / "part", *extra, "--train.steps=3", "--train.checkpoint_interval=3"))
    resumed = launch(tiny(corpus, tmp_path / "part", *extra, "--train.resume=true"))
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]  # bit-exact: the masters were saved
    assert full["final_val_loss"] == resumed["final_val_loss"] and a[6] < a[1], (a, full)
    rank0 = torch.load(tmp_path / "full" / "checkpoints" / "step_0000006" / "rank0.pt", weights_only=False)
    assert {t.dtype for t in rank0["model"].values()} == {torch.bfloat16}
    assert all(m.dtype == torch.float32 for m in rank0["opt"]["masters"])
