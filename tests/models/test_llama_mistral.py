"""Llama 3 and Mistral: logits equal to transformers' at tp=1 and tp=2 (tiny random configs saved
locally, nothing downloaded), export -> reload -> same logits, and a fine-tune at tp=2 x pp=2
exported and read back by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from taco.models import Llama, load_hf_checkpoint, save_hf_checkpoint
from tests.helpers.dist import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB = 50
KINDS = ["llama3", "llama3-tied", "mistral-window"]


def hf_model(kind: str, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny random HF model with noisy weights (eval, eager attention): Llama 3 with its RoPE
    scaling acting at these lengths (original context 16), or Mistral with a window of 5."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    if kind.startswith("llama3"):
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16, "rope_theta": 500000.0}  # fmt: skip
        cfg = transformers.LlamaConfig(
            rope_parameters=rope, tie_word_embeddings=kind.endswith("tied"), **common
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.MistralConfig(sliding_window=5, head_dim=8, **common)
        model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norms off one, every weight its own
    return model.eval()


def tokens(b: int = 2, s: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(0))


def reload(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


@pytest.fixture(params=KINDS)
def saved(request, tmp_path):
    ref = hf_model(request.param)
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    with torch.no_grad():
        logits = ref(tokens()).logits
    return request.param, tmp_path / "hf", logits


def test_load_matches_transformers_at_tp1(saved):
    kind, path, expected = saved
    ours, cfg = load_hf_checkpoint(path)
    assert isinstance(ours, Llama) and cfg.model_type == kind.split("3")[0].split("-")[0]
    assert (ours.lm_head.weight is ours.tok_emb.weight) == kind.endswith("tied")
    if kind.startswith("mistral"):
        assert cfg.sliding_window == 5
    else:
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    with torch.no_grad():
        got = ours.eval()(tokens())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_options_change_the_logits(saved):
    """The parity above is not vacuous: without the RoPE scaling (Llama 3) or the window
    (Mistral) the logits differ by far more than the tolerance."""
    kind, path, expected = saved
    ours, cfg = load_hf_checkpoint(path)
    if kind.startswith("mistral"):
        cfg.sliding_window = None
        for layer in ours.layers:
            layer.attn.window = None
    else:
        cfg.rope_scaling = None
    with torch.no_grad():
        assert (ours.eval()(tokens()) - expected).abs().max() > 1e-3


def _tp2_logits(rank: int, world: int, path: str) -> torch.Tensor:
    import torch.distributed as dist

    from taco.parallel import ParallelDims, apply_tensor_parallel

    dims = ParallelDims(dp=1, pp=1, tp=world).build()
    model, _ = load_hf_checkpoint(path)
    model.resize_vocab(64)  # padded so that tp divides it, as the trainer does
    model = apply_tensor_parallel(model, None, dims).eval()
    with torch.no_grad():
        local = model(tokens())  # [b, s, 64/tp]
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)[..., :VOCAB]


def test_tp2_matches_transformers(saved):
    kind, path, expected = saved
    for got in run_distributed(_tp2_logits, 2, str(path)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_export_reload_same_logits(saved, tmp_path):
    kind, path, expected = saved
    ours, _ = load_hf_checkpoint(path)
    ours.resize_vocab(64)
    save_hf_checkpoint(ours, tmp_path / "out", vocab_size=VOCAB)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == ("mistral" if kind.startswith("mistral") else "llama")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()).logits, expected, atol=1e-5, rtol=1e-5)
    again, _ = load_hf_checkpoint(tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(tokens()), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["rank", "dcp"])
def test_finetune_at_tp2_pp2_exports_what_transformers_reads(corpus, tmp_path, fmt):
    """Fine-tune a Llama 3 checkpoint at tp=2 x pp=2 (lr 1e-30: the weights come back unchanged),
    export the run, reload it in transformers: the original logits."""
    from taco.train.config import load_config
    from taco.train.export import export_run
    from taco.train.launch import launch
    from tests.helpers.runs import tiny_args

    ref = hf_model("llama3", vocab=320)  # the test corpus is tokenized to 300 ids
    ref.save_pretrained(tmp_path / "hf", safe_serialization=True)
    args = [a for a in tiny_args(corpus, tmp_path / "run") if not a.startswith("--model.")]
    args += [f"--model.init_from={tmp_path / 'hf'}", "--model.seq_len=16", "--data.tokenizer="]
    args += ["--parallel.tp=2", "--parallel.pp=2", "--train.lr=1e-30", "--train.min_lr=1e-31"]
    args += ["--train.steps=1"]
    args += ["--train.eval_steps=1", f"--train.checkpoint_format={fmt}", "--compression.tp_codec=taco"]
    launch(load_config(None, args))
    export_run(tmp_path / "run", tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()).logits, ref(tokens()).logits, atol=1e-5, rtol=1e-5)


def test_llama_kind_builds_and_rejects_qk_norm():
    from taco.models import build_model
    from taco.train.config import load_config

    m = build_model("llama", vocab_size=64, n_layer=1, hidden=32, n_head=4, n_kv_head=2)
    assert isinstance(m, Llama) and m.layers[0].attn.qkv.bias is None
    with pytest.raises(ValueError, match="qk_norm"):
        load_config(None, ["--model.kind=llama", "--model.qk_norm=true"])


def test_path_is_a_directory(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        load_hf_checkpoint(tmp_path / "nothing")
