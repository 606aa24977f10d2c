"""Megatron-Core TP layers with taco.integrations.megatron enabled, against unpatched Megatron.

2 gloo ranks, a SwiGLU MLP of ColumnParallelLinear (up: Megatron's async input-gradient
all-reduce; gate: `allreduce_dgrad=False`, so `copy_to_tensor_model_parallel_region`'s backward)
and RowParallelLinear (down). codec none: output and every gradient bit-identical to unpatched;
taco: each TP collective compressed in `policy.stats`, output SQNR vs unpatched within 1 dB of
`taco.comm.all_reduce` alone on the same partial sums; after `disable()` bit-identical again.
A frozen up weight takes Megatron's LinearWithFrozenWeight (a synchronous all-reduce), checked
the same way, with the generic site names of `enable()` without a model.
A tiny GPTModel (local layer spec, 2 layers, TP=2) forward/backward the same three ways: codec none
and after `disable()` bit-identical logits, loss and gradients; taco on every TP site. Megatron's
GPTModel needs two CPU-only shims here (`_cpu_shims`); on GPUs neither is needed.
Skipped without megatron-core (`pip install 'taco-tp[megatron]'`).
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist import assert_equal, run_distributed

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


def _same(got, ref, label, what=("output", "input grad")):
    assert got[2].keys() == ref[2].keys(), f"{label}: gradients of {sorted(got[2])} vs {sorted(ref[2])}"
    assert_equal(got[0], ref[0], f"{label}: {what[0]}")
    assert_equal(got[1], ref[1], f"{label}: {what[1]}")
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


@contextlib.contextmanager
def _cpu_shims():
    """CPU-only test shims for Megatron's GPTModel on gloo (not needed, and not used, on GPUs):
    - `torch.cuda.current_device()` gives "cpu": the attention's scratch buffer
      (`megatron/core/utils.py` GlobalMemoryBuffer.get_tensor, `torch.empty(..., device=
      torch.cuda.current_device())`, reached from dot_product_attention.py) would ask for CUDA;
    - the CUDA RNG tracker's `fork()` is a plain no-op context: DotProductAttention.forward wraps its
      dropout in `tensor_parallel.get_cuda_rng_tracker().fork()` (dot_product_attention.py:217), which
      needs CUDA RNG states (dropout is 0 here, so there is nothing to fork)."""
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    with (
        mock.patch("torch.cuda.current_device", lambda: "cpu"),
        mock.patch.object(CudaRNGStatesTracker, "fork", lambda self, name=None: contextlib.nullcontext()),
    ):
        yield


VOCAB, SEQ, BATCH = 128, 16, 2


def _gpt():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=DIM, num_attention_heads=4, tensor_model_parallel_size=2,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    torch.manual_seed(0)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ)


def _gpt_run(model, batch):
    """Forward + backward on `batch`: (local vocab shard of the logits, loss, {name: grad})."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    tokens, positions, mask, labels = batch
    model.zero_grad(set_to_none=True)
    logits = model(tokens, positions, mask)  # [b, s, vocab / tp]
    loss = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels.t().contiguous()).mean()
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _gpt_body(rank: int, world: int) -> dict:
    import megatron.core.parallel_state as ps
    import torch.distributed as dist

    import taco.integrations.megatron as tm
    from taco import comm
    from taco.codec import sqnr_db

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        with _cpu_shims():
            model = _gpt()
            torch.manual_seed(1)
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
            positions = torch.arange(SEQ).expand(BATCH, -1)
            mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True: masked out (causal)
            batch = (tokens, positions, mask, torch.randint(0, VOCAB, (BATCH, SEQ)))
            ref = _gpt_run(model, batch)
            what = ("logits", "loss")
            with tm.compressed(None, model):
                _same(_gpt_run(model, batch), ref, "GPT, policy=None", what)
            with tm.compressed(comm.CommPolicy(codec=None), model):
                _same(_gpt_run(model, batch), ref, "GPT, codec none", what)
            policy = comm.CommPolicy(codec="taco")
            with tm.compressed(policy, model):
                got = _gpt_run(model, batch)
            _same(_gpt_run(model, batch), ref, "GPT, after disable()", what)

        sites = ["embedding.word_embeddings.fwd", "output_layer.bwd"] + [
            f"decoder.layers.{i}.{m}" for i in range(2) for m in (
                "self_attention.linear_qkv.bwd", "self_attention.linear_proj.fwd",
                "mlp.linear_fc1.bwd", "mlp.linear_fc2.fwd",
            )
        ]
        assert sorted(policy.stats.sites) == sorted(sites), f"GPT sites {sorted(policy.stats.sites)}"
        for site in sites:
            st = policy.stats.site(site)
            assert st.calls == 1 and 0 < st.wire_bytes < st.raw_bytes, f"GPT site {site}: {st}"
        shards = [torch.empty_like(ref[0]) for _ in range(world)]
        dist.all_gather(shards, ref[0], group=ps.get_tensor_model_parallel_group())
        full_ref = torch.cat(shards, -1)
        dist.all_gather(shards, got[0], group=ps.get_tensor_model_parallel_group())
        logits_sqnr = sqnr_db(full_ref, torch.cat(shards, -1))
        # measured 30.76 dB (loss 4.855136 unpatched, 4.855134 taco): bounds with ~10 dB margin
        assert logits_sqnr > 20, f"GPT logits SQNR {logits_sqnr:.2f} dB"
        loss_err = abs(got[1].item() - ref[1].item())
        assert loss_err < 1e-3, f"GPT loss {got[1].item():.6f} vs {ref[1].item():.6f}"
        return {"sqnr": logits_sqnr, "loss": ref[1].item(), "loss_taco": got[1].item()}
    finally:
        tm.disable()
        ps.destroy_model_parallel()


def test_megatron_gpt_model_forward_backward():
    for r in run_distributed(_gpt_body, 2):
        print(f"GPT logits SQNR {r['sqnr']:.2f} dB, loss {r['loss']:.6f} unpatched, "
              f"{r['loss_taco']:.6f} taco")
