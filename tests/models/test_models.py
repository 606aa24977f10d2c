"""Tests for taco.models: shapes, causality, tying, determinism, TP-readiness, plans, HF checkpoints.

Parity tests build tiny random Hugging Face models in code (nothing is downloaded) and are skipped
when the optional ``transformers`` package is missing.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from taco.models import (
    GPT,
    PRESETS,
    GPTConfig,
    Qwen,
    QwenConfig,
    build_model,
    check_tp_size,
    load_hf_checkpoint,
    model_config,
    resolve_plan,
    save_hf_checkpoint,
    sites,
    tp_plan,
)

VOCAB = 97


def tiny_gpt(**kw) -> GPT:
    cfg = dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, block_size=16)
    return GPT(GPTConfig(**{**cfg, **kw}))


def tiny_qwen(**kw) -> Qwen:
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return Qwen(QwenConfig(**{**cfg, **kw}))


MAKERS = {"gpt": tiny_gpt, "qwen": tiny_qwen, "qwen3": lambda **kw: tiny_qwen(qk_norm=True, **kw)}


def perturb(model: nn.Module, seed: int = 1) -> nn.Module:
    """Add noise to every parameter so zero biases and unit norms do not hide mapping bugs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def tokens(b: int = 2, s: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", MAKERS)
def test_shapes_and_backward(kind: str) -> None:
    model = MAKERS[kind]()
    logits = model(tokens())
    assert logits.shape == (2, 12, VOCAB) and logits.dtype == torch.float32
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("kind", MAKERS)
def test_causal(kind: str) -> None:
    model = perturb(MAKERS[kind]()).eval()
    idx = tokens()
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % VOCAB
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=0)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("kind", MAKERS)
def test_tied_and_untied(kind: str) -> None:
    key = "tie_embeddings" if kind == "gpt" else "tie_word_embeddings"
    tied, untied = MAKERS[kind](**{key: True}), MAKERS[kind](**{key: False})
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.num_params() == tied.num_params() + untied.lm_head.weight.numel()


def test_qwen_default_is_untied_like_hf() -> None:
    assert tiny_qwen().lm_head.weight is not tiny_qwen().tok_emb.weight


@pytest.mark.parametrize("kind", MAKERS)
def test_deterministic_init(kind: str) -> None:
    torch.manual_seed(123)
    a = MAKERS[kind]().state_dict()
    torch.manual_seed(123)
    b = MAKERS[kind]().state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gpt_init_scales_residual_projections() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, n_layer=8, n_head=4, n_embd=128, block_size=16))
    assert abs(model.layers[0].attn.qkv.weight.std().item() - 0.02) < 2e-3
    assert abs(model.layers[0].mlp.down.weight.std().item() - 0.02 / 4) < 1e-3
    assert model.layers[0].attn.qkv.bias.abs().max() == 0


def test_gpt_positions_and_block_size() -> None:
    model = perturb(tiny_gpt()).eval()
    idx = tokens(s=6)
    offset = torch.arange(6) + 5
    expected = model.tok_emb(idx) + model.pos_emb(offset)
    torch.testing.assert_close(model.embed(idx, offset), expected)
    with pytest.raises(ValueError, match="block_size"):
        model(tokens(s=17))


def test_qwen_rope_is_relative() -> None:
    """Shifting every position by a constant leaves RoPE attention (hence logits) unchanged."""
    model = perturb(tiny_qwen()).eval()
    idx = tokens()
    shifted = model(idx, torch.arange(12) + 9)
    torch.testing.assert_close(model(idx), shifted, atol=1e-4, rtol=1e-4)
    per_batch = model(idx, (torch.arange(12) + 9).expand(2, 12))
    torch.testing.assert_close(shifted, per_batch)


def shard_linear(linear: nn.Linear, dim: int, rank: int, tp: int) -> nn.Linear:
    """A copy of ``linear`` keeping shard ``rank`` of ``tp`` along weight dim 0 (colwise) or 1 (rowwise);
    a fused projection (``fused_parts``) keeps shard ``rank`` of each of its blocks, stacked."""
    parts = getattr(linear, "fused_parts", None) if dim == 0 else None

    def cut(t: torch.Tensor) -> torch.Tensor:
        if parts is None:
            return t.detach().chunk(tp, dim=dim)[rank]
        return torch.cat([b.chunk(tp, dim=0)[rank] for b in t.detach().split(list(parts), dim=0)])

    w = cut(linear.weight)
    out = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None and dim == 0)
    with torch.no_grad():
        out.weight.copy_(w)
        if out.bias is not None:
            out.bias.copy_(cut(linear.bias))
    return out


@pytest.mark.parametrize("kind", MAKERS)
def test_layer_forward_works_column_sharded(kind: str, tp: int = 2) -> None:
    """Summing per-rank row-parallel partial outputs reproduces the unsharded block (Megatron split)."""
    model = perturb(MAKERS[kind]()).eval()
    block = model.layers[0]
    x = torch.randn(2, 12, 32)
    args = () if kind == "gpt" else model_rope(model, 12)
    full_attn, full_mlp = block.attn(x, *args), block.mlp(x)
    attn_sum, mlp_sum = 0, 0
    for rank in range(tp):
        attn, mlp = copy.deepcopy(block.attn), copy.deepcopy(block.mlp)
        attn.qkv = shard_linear(block.attn.qkv, 0, rank, tp)
        attn.out = shard_linear(block.attn.out, 1, rank, tp)
        for name in ("up", "gate_up"):
            if hasattr(mlp, name):
                setattr(mlp, name, shard_linear(getattr(block.mlp, name), 0, rank, tp))
        mlp.down = shard_linear(block.mlp.down, 1, rank, tp)
        attn_sum = attn_sum + attn(x, *args)
        mlp_sum = mlp_sum + mlp(x)
    bias = {"attn": block.attn.out.bias, "mlp": block.mlp.down.bias}
    attn_sum = attn_sum + (bias["attn"] if bias["attn"] is not None else 0)
    mlp_sum = mlp_sum + (bias["mlp"] if bias["mlp"] is not None else 0)
    torch.testing.assert_close(attn_sum, full_attn, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mlp_sum, full_mlp, atol=1e-5, rtol=1e-5)


def model_rope(model: Qwen, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    from taco.models.qwen import rope_cos_sin

    return rope_cos_sin(torch.arange(s), model.config.head_dim, model.config.rope_theta, torch.float32)


@pytest.mark.parametrize("kind", MAKERS)
def test_save_load_round_trip(kind: str, tmp_path: Path) -> None:
    model = perturb(MAKERS[kind]()).eval()
    save_hf_checkpoint(model, tmp_path)
    loaded, config = load_hf_checkpoint(tmp_path)
    assert type(loaded) is type(model) and config == model.config
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())
    assert (loaded.lm_head.weight is loaded.tok_emb.weight) == (model.lm_head.weight is model.tok_emb.weight)
    torch.testing.assert_close(loaded.eval()(tokens()), model(tokens()), rtol=0, atol=0)


def test_load_sharded_index(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = perturb(tiny_qwen()).eval()
    save_hf_checkpoint(model, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
        weight_map |= {n: file for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded, _ = load_hf_checkpoint(tmp_path)
    torch.testing.assert_close(loaded.eval()(tokens()), model(tokens()), rtol=0, atol=0)


def test_load_errors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 5}))
    with pytest.raises(ValueError, match="lacks the field 'n_embd'"):
        load_hf_checkpoint(tmp_path)
    save_hf_checkpoint(perturb(tiny_gpt()), tmp_path)
    file = str(tmp_path / "model.safetensors")
    good = load_file(file)
    bad = {k: v for k, v in good.items() if k != "transformer.h.1.ln_2.bias"}
    bad["transformer.h.0.extra.weight"] = torch.zeros(2)
    save_file(bad, file)
    with pytest.raises(ValueError, match=r"missing 1 \['layers.1.mlp_norm.bias'\].*h.0.extra.weight"):
        load_hf_checkpoint(tmp_path)
    save_file({**good, "transformer.wpe.weight": torch.zeros(8, 32)}, file)
    with pytest.raises(ValueError, match=r"shape mismatch.*transformer.wpe.weight \(8, 32\)"):
        load_hf_checkpoint(tmp_path)


def test_load_legacy_gpt2_names_and_model_cls(tmp_path: Path) -> None:
    """Old GPT-2 files: no ``transformer.`` prefix, causal-mask buffers, an explicit tied lm_head."""
    from safetensors.torch import load_file, save_file

    class MyGPT(GPT):
        pass

    model = perturb(tiny_gpt()).eval()
    save_hf_checkpoint(model, tmp_path)
    file = str(tmp_path / "model.safetensors")
    legacy = {k.removeprefix("transformer."): v for k, v in load_file(file).items()}
    legacy["h.0.attn.bias"] = torch.ones(1, 1, 16, 16).tril()
    legacy["lm_head.weight"] = legacy["wte.weight"].clone()
    save_file(legacy, file)
    loaded, _ = load_hf_checkpoint(tmp_path, model_cls=MyGPT)
    assert type(loaded) is MyGPT
    torch.testing.assert_close(loaded.eval()(tokens()), model(tokens()), rtol=0, atol=0)


@pytest.mark.parametrize("kind", MAKERS)
def test_plan_covers_every_module(kind: str) -> None:
    model = MAKERS[kind]()
    resolved = resolve_plan(model)
    owners = {n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    assert set(resolved) == owners
    assert resolved["tok_emb"] == "vocab_embedding" and resolved["lm_head"] == "colwise_head"
    assert resolved["layers.1.attn.qkv"] == "colwise" and resolved["layers.1.mlp.down"] == "rowwise"
    assert sites(model)[:4] == [
        "layers.0.attn.qkv",
        "layers.0.attn.out",
        "layers.0.mlp.up",
        "layers.0.mlp.down",
    ]
    assert len(sites(model)) == 4 * len(model.layers)
    plan = tp_plan(model)
    del plan["norm"]
    with pytest.raises(ValueError, match="'norm' matches no pattern"):
        resolve_plan(model, plan)


def test_check_tp_size() -> None:
    check_tp_size(tiny_qwen(vocab_size=96), 2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tp_size(tiny_qwen(vocab_size=96), 4)
    with pytest.raises(ValueError, match="vocab_size"):
        check_tp_size(tiny_gpt(), 2)


# Parameters at a 4096-token vocabulary (tiny presets) or at the checkpoint's vocabulary (public
# shapes: the published counts of gpt2 to gpt2-xl, Qwen2.5-0.5B/7B/14B/32B, Qwen3-0.6B/8B, tied
# embeddings once; Llama-3-8B/70B's published 8,030,261,248 and 70,553,706,496 plus the qwen
# family's q/k/v biases, hidden + 2 * kv_heads * head_dim per layer).
PRESET_PARAMS = {
    "gpt-demo": 1_334_016, "gpt-small": 7_432_704, "qwen-demo": 1_312_896, "qwen-small": 5_771_264,
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920,
    "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200, "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664, "qwen2.5-32b": 32_763_876_352, "qwen3-8b": 8_190_735_360,
    "llama3-8b": 8_030_261_248 + 32 * (4096 + 2 * 8 * 128),
    "llama3-70b": 70_553_706_496 + 80 * (8192 + 2 * 8 * 128),
}  # fmt: skip


def test_build_model_and_presets() -> None:
    assert set(PRESETS) == set(PRESET_PARAMS)
    for name, preset in PRESETS.items():
        if "vocab_size" in preset:  # a public checkpoint's shape: build on the meta device (no memory)
            with torch.device("meta"):
                model = build_model(name)
        else:
            model = build_model(name, vocab_size=4096)
            n = model.num_params()
            assert (1e6 <= n <= 3e6) if name.endswith("demo") else (5e6 <= n <= 10e6), (name, n)
            check_tp_size(model, 2 if name == "qwen-small" else 4)  # qwen-small: 2 key/value heads
        assert model.num_params() == PRESET_PARAMS[name], name
        assert isinstance(model, GPT if preset["kind"] == "gpt" else Qwen)
    assert build_model("gpt-demo", vocab_size=65).config.vocab_size == 65
    qwen_demo = {k: v for k, v in PRESETS["qwen-demo"].items() if k != "kind"}
    assert isinstance(build_model("qwen", vocab_size=65, **qwen_demo), Qwen)
    with pytest.raises(ValueError, match="unknown model kind 'mamba'"):
        build_model("mamba")
    with pytest.raises(ValueError, match="valid fields"):
        build_model("gpt-demo", n_layers=3)
    with pytest.raises(ValueError, match="needs vocab_size"):
        build_model("gpt-demo")
    with pytest.raises(ValueError, match="contradicts preset 'gpt-demo'"):
        build_model("gpt-demo", vocab_size=65, kind="qwen")


def test_model_config_translates_the_neutral_sizes() -> None:
    gpt = model_config("gpt", vocab_size=65, n_layer=2, n_head=4, hidden=32, seq_len=16, norm_eps=1e-6)
    assert gpt == GPTConfig(vocab_size=65, n_layer=2, n_head=4, n_embd=32, block_size=16, layer_norm_eps=1e-6)
    qwen = model_config("qwen", vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, hidden=64, seq_len=32,
                        qk_norm=True, tie_embeddings=False)  # fmt: skip
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_attention_heads) == (64, 2, 4)
    assert (qwen.num_key_value_heads, qwen.head_dim, qwen.max_position_embeddings) == (2, 16, 32)
    assert qwen.intermediate_size == 192  # 0 = 8/3 * hidden rounded up to a multiple of 64
    assert qwen.qk_norm and not qwen.attention_bias and not qwen.tie_word_embeddings
    for bad, match in [(dict(intermediate=64), "intermediate"), (dict(n_kv_head=2), "n_kv_head"),
                       (dict(head_dim=16), "head_dim"), (dict(qk_norm=True), "qk_norm")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            model_config("gpt", vocab_size=65, hidden=32, **bad)
    with pytest.raises(ValueError, match="qwen has no dropout"):
        model_config("qwen", vocab_size=65, dropout=0.1)


def test_trainer_builds_what_build_model_builds() -> None:
    """One translation: the trainer's model of `--model.preset=X` is `build_model(X)`."""
    from taco.train.build import build_model as build_for_run
    from taco.train.config import load_config

    for name in PRESETS:
        cfg = load_config(None, [f"--model.preset={name}"])
        with torch.device("meta"):
            ours, theirs = build_for_run(cfg, 4096), build_model(name, vocab_size=4096)
        assert type(ours) is type(theirs) and ours.config == theirs.config, name


# ---- parity with Hugging Face transformers (optional extra) ----


def hf_model(kind: str) -> nn.Module:
    """A tiny random Hugging Face model with noisy weights, in eval mode, eager attention."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=32, **common)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        qwen = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, rope_theta=12345.0)  # fmt: skip
        qwen |= common
        if kind == "qwen2":
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**qwen))
        elif kind == "qwen2-tied":
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **qwen))
        else:
            if not hasattr(transformers, "Qwen3Config"):
                pytest.skip("this transformers has no Qwen3")
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=24, **qwen))
    return perturb(model).eval()


@pytest.mark.parametrize("kind", ["gpt2", "qwen2", "qwen2-tied", "qwen3"])
def test_hf_parity_load(kind: str, tmp_path: Path) -> None:
    reference = hf_model(kind)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    ours, config = load_hf_checkpoint(tmp_path)
    ours.eval()
    assert (ours.lm_head.weight is ours.tok_emb.weight) == (kind in ("gpt2", "qwen2-tied"))
    if kind.startswith("qwen"):
        assert config.rope_theta == 12345.0 and config.num_key_value_heads == 2
    idx = tokens(s=20)
    with torch.no_grad():
        expected = reference(idx).logits
        torch.testing.assert_close(ours(idx), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gpt", "qwen", "qwen3"])
def test_hf_parity_export(kind: str, tmp_path: Path) -> None:
    """What save_hf_checkpoint writes, transformers reads back to the same logits."""
    transformers = pytest.importorskip("transformers")
    if kind == "qwen3" and not hasattr(transformers, "Qwen3Config"):
        pytest.skip("this transformers has no Qwen3")
    ours = perturb(MAKERS[kind](**({} if kind == "gpt" else {"tie_word_embeddings": True}))).eval()
    save_hf_checkpoint(ours, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    idx = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), reference(idx).logits, atol=1e-5, rtol=1e-5)
