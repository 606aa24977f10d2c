"""Megatron-Core TP layers with taco.integrations.megatron enabled, against unpatched Megatron.

2 gloo ranks, a SwiGLU MLP of ColumnParallelLinear (up: Megatron's async input-gradient
all-reduce; gate: `allreduce_dgrad=False`, so `copy_to_tensor_model_parallel_region`'s backward)
and RowParallelLinear (down). codec none: output and every gradient bit-identical to unpatched;
taco: each TP collective compressed in `policy.stats`, output SQNR vs unpatched within 1 dB of
`taco.comm.all_reduce` alone on the same partial sums; after `disable()` bit-identical again.
A frozen up weight takes Megatron's LinearWithFrozenWeight (a synchronous all-reduce), checked
the same way, with the generic site names of `enable()` without a model.
Skipped without megatron-core (`pip install 'taco-tp[megatron]'`).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.dist import assert_equal, run_distributed

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install 'taco-tp[megatron]')")

DIM, FFN = 64, 256


def _mlp():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cfg = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            kw = {"config": cfg, "init_method": torch.nn.init.xavier_normal_, "gather_output": False}
            self.up = ColumnParallelLinear(DIM, FFN, **kw)
            self.gate = ColumnParallelLinear(DIM, FFN, **kw)
            self.gate.allreduce_dgrad = False  # its input gradient: copy_to_tensor_model_parallel_region
            init = torch.nn.init.xavier_normal_
            self.down = RowParallelLinear(
                FFN, DIM, config=cfg, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
            )

        def hidden(self, x: torch.Tensor) -> torch.Tensor:
            return F.silu(self.gate(x)[0]) * self.up(x)[0]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.hidden(x))[0]

    torch.manual_seed(0)
    return MLP()


def _run(model, x):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(got, ref, label):
    assert got[2].keys() == ref[2].keys(), f"{label}: gradients of {sorted(got[2])} vs {sorted(ref[2])}"
    assert_equal(got[0], ref[0], f"{label}: output")
    assert_equal(got[1], ref[1], f"{label}: input grad")
    for n in ref[2]:
        assert_equal(got[2][n], ref[2][n], f"{label}: grad of {n}")


def _body(rank: int, world: int) -> dict:
    import megatron.core.parallel_state as ps

    import taco.integrations.megatron as tm
    from taco import comm
    from taco.codec import sqnr_db

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        model = _mlp()
        torch.manual_seed(1)
        x = torch.randn(16, 2, DIM)  # Megatron's [s, b, h]
        ref = _run(model, x)
        with tm.compressed(None, model):
            _same(_run(model, x), ref, "policy=None")
        with tm.compressed(comm.CommPolicy(codec=None), model):
            _same(_run(model, x), ref, "codec none")

        policy = comm.CommPolicy(codec="taco")
        tm.enable(policy, model)
        assert tm.enabled(), "enable() did not take"
        got = _run(model, x)
        tm.disable()
        for site in ("down.fwd", "up.bwd", "megatron.copy_to.bwd"):
            st = policy.stats.site(site)
            assert st.calls == 1 and 0 < st.wire_bytes < st.raw_bytes, f"site {site}: {st}"
        measured = sqnr_db(ref[0], got[0])
        with torch.no_grad():
            partial = F.linear(model.hidden(x), model.down.weight)
            alone = comm.all_reduce(partial, ps.get_tensor_model_parallel_group(), codec="taco")
            plain = comm.all_reduce(partial, ps.get_tensor_model_parallel_group(), codec=None)
        assert_equal(plain + model.down.bias, ref[0], "hand all-reduce of the partial sums vs Megatron")
        reference = sqnr_db(ref[0], alone + model.down.bias)
        assert math.isfinite(measured) and abs(measured - reference) < 1.0, (
            f"output SQNR {measured:.2f} dB vs taco.comm alone {reference:.2f} dB"
        )
        grad_sqnr = sqnr_db(ref[1], got[1])
        assert grad_sqnr > 20, f"input grad SQNR {grad_sqnr:.2f} dB"
        _same(_run(model, x), ref, "after disable()")

        # a frozen weight: Megatron's LinearWithFrozenWeight, a synchronous all-reduce; no model
        # given: generic site names
        model.up.weight.requires_grad_(False)
        ref = _run(model, x)
        with tm.compressed(None):
            _same(_run(model, x), ref, "frozen up, policy=None")
        frozen = comm.CommPolicy(codec="taco")
        with tm.compressed(frozen):
            with pytest.raises(RuntimeError, match="already enabled"):
                tm.enable(frozen)
            _run(model, x)
        for site in ("megatron.row.fwd", "megatron.column.bwd", "megatron.copy_to.bwd"):
            st = frozen.stats.site(site)
            assert st.calls == 1 and 0 < st.wire_bytes < st.raw_bytes, f"frozen, site {site}: {st}"
        _same(_run(model, x), ref, "frozen up, after the context")
        return {"sqnr": measured, "reference": reference, "grad_sqnr": grad_sqnr}
    finally:
        tm.disable()
        ps.destroy_model_parallel()


def test_megatron_patch_exact_compressed_and_restored():
    for r in run_distributed(_body, 2):
        print(f"output SQNR {r['sqnr']:.2f} dB, taco.comm alone {r['reference']:.2f} dB, "
              f"input grad SQNR {r['grad_sqnr']:.2f} dB")


def test_megatron_unsupported_version_raises(monkeypatch):
    import megatron.core.package_info as info

    import taco.integrations.megatron as tm

    monkeypatch.setattr(info, "__version__", "0.19.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.19\.0 is not supported"):
        tm.enable(None)
    assert not tm.enabled(), "a failed enable() left the patch on"
