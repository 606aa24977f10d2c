"""Fine-tuning a Hugging Face checkpoint: its tokenizer, its sizes, a padded vocabulary masked out of
the loss, and `taco export` back to the checkpoint's own shape (transformers parts skip without it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from taco.cli import main
from taco.models import GPT, GPTConfig, load_hf_checkpoint, save_hf_checkpoint
from taco.parallel import vocab_parallel_cross_entropy
from taco.train.build import model_vocab, padded_vocab
from taco.train.config import load_config
from taco.train.data import TokenDataset, load_meta
from taco.train.finetune import resolve_init_from
from tests.helpers.dist import assert_close, run_distributed

TEXT = "\n".join(
    f"HAMLET. To be, or not to be, that is the question {i}.\n"
    f"OPHELIA. Good my lord, how does your honour for this many a day? {i * 3}"
    for i in range(300)
)
GPT2_VOCAB = 50257


def gpt2_style_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE trained on `text`, stretched to `vocab_size` tokens: the 256 bytes first,
    unused entries, the merged tokens, <|endoftext|> last (GPT-2's 50257 tokens end with the
    separator at 50256); the merges sit at the top, so at TP=2 the text's ids fall in both shards."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([text], trainer=trainer)
    spec = json.loads(tok.to_str())
    trained = spec["model"]["vocab"]
    eot, shift = vocab_size - 1, vocab_size - 1 - len(trained)
    vocab = {t: i if i < 256 else i + shift for t, i in trained.items()}
    vocab |= {f"<unused{i}>": i for i in range(256, 256 + shift)}
    vocab["<|endoftext|>"] = eot
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [
        dict(id=eot, content="<|endoftext|>", single_word=False, lstrip=False, rstrip=False,
             normalized=False, special=True)
    ]  # fmt: skip
    tok = Tokenizer.from_str(json.dumps(spec))
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id("<|endoftext|>") == eot
    return tok


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ft")
    (d / "text").mkdir()
    (d / "text" / "play.txt").write_text(TEXT)
    (d / "tok").mkdir()
    gpt2_style_tokenizer(TEXT, 600).save(str(d / "tok" / "tokenizer.json"))
    return d


# ---- the loss of a padded vocabulary ----


def _padded_ce(rank, world):
    torch.manual_seed(0)
    vocab = 20  # of 48 columns: rank 0 holds 20 real ones and 4 padding, rank 1 only padding
    logits = torch.randn(3, 5, 48)
    tgt = torch.randint(0, vocab, (3, 5))
    real = logits[..., :vocab].clone().requires_grad_(True)
    ref = nn.functional.cross_entropy(real.flatten(0, 1), tgt.flatten(), reduction="none").view(3, 5)
    (ref * torch.arange(15.0).view(3, 5)).sum().backward()
    local = logits.chunk(world, -1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, tgt, dist.group.WORLD, vocab_size=vocab)
    (loss * torch.arange(15.0).view(3, 5)).sum().backward()
    assert_close(loss, ref, "per-token loss = the unpadded model's")
    full_grad = torch.cat([real.grad, torch.zeros(3, 5, 48 - vocab)], -1)  # padding: no gradient
    assert_close(local.grad, full_grad.chunk(world, -1)[rank], "logits grad, this rank's shard")


def test_padded_logits_are_masked_out_of_the_loss():
    run_distributed(_padded_ce, 2)
    logits, tgt = torch.randn(2, 3, 40), torch.randint(0, 33, (2, 3))
    ref = nn.functional.cross_entropy(logits[..., :33].flatten(0, 1), tgt.flatten(), reduction="none")
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, tgt, None, 33), ref.view(2, 3))


def test_padding_and_stripping_keep_the_model(tmp_path):
    model = GPT(GPTConfig(vocab_size=100, n_layer=1, n_head=2, n_embd=16, block_size=8)).eval()
    idx = torch.randint(0, 100, (2, 8))
    before = model(idx)
    model.resize_vocab(padded_vocab(100, 128))
    assert model.tok_emb.weight.shape == (128, 16) and model.lm_head.weight is model.tok_emb.weight
    torch.testing.assert_close(model(idx)[..., :100], before, rtol=0, atol=0)
    save_hf_checkpoint(model, tmp_path, vocab_size=100)
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 100
    loaded, config = load_hf_checkpoint(tmp_path)
    assert config.vocab_size == 100
    torch.testing.assert_close(loaded.eval()(idx), before, rtol=0, atol=0)


# ---- the checkpoint's tokenizer and sizes ----


def test_data_prepare_with_a_hf_tokenizer(corpus, tmp_path, capsys):
    from tokenizers import Tokenizer

    argv = ["data", "prepare", "--text", str(corpus / "text"), "--cache-dir", str(tmp_path)]
    assert main([*argv, "--tokenizer", str(corpus / "tok")]) == 0
    out = capsys.readouterr().out
    data_dir = Path(out.split("data set ready in ")[1].split(" (")[0])
    assert data_dir.name.startswith("text-text-") and "-tok" in data_dir.name
    assert f"--data.tokenizer={corpus / 'tok'}" in out and "wrote train.bin" in out
    meta = load_meta(data_dir)
    assert meta["vocab_size"] == 600 and meta["eot_id"] == 599
    tok = Tokenizer.from_file(str(corpus / "tok" / "tokenizer.json"))
    ids = np.fromfile(data_dir / "train.bin", dtype=meta["dtype"])
    want = tok.encode(TEXT, add_special_tokens=False).ids
    assert ids[:50].tolist() == want[:50]  # the checkpoint's ids, not a new BPE's
    assert (data_dir / "tokenizer.json").read_bytes() == (corpus / "tok" / "tokenizer.json").read_bytes()
    assert main([*argv, "--tokenizer", str(corpus / "tok"), "--vocab-size", "300"]) == 2
    assert main([*argv, "--tokenizer", str(tmp_path / "none")]) == 1
    assert "no Hugging Face tokenizer" in capsys.readouterr().err


def _checkpoint(path: Path, tokenizer: Path | None, vocab: int = 600) -> Path:
    torch.manual_seed(0)
    save_hf_checkpoint(GPT(GPTConfig(vocab_size=vocab, n_layer=3, n_head=2, n_embd=32, block_size=48)), path)
    if tokenizer is not None:
        (path / "tokenizer.json").write_bytes((tokenizer / "tokenizer.json").read_bytes())
    return path


def test_the_checkpoint_decides_the_sizes_and_the_tokenizer(corpus, tmp_path):
    ckpt = _checkpoint(tmp_path / "ckpt", corpus / "tok")
    cfg = load_config(None, [
        f"--model.init_from={ckpt}", "--model.preset=gpt-demo", "--model.seq_len=32", "--parallel.tp=2",
        "--data.dataset=text", f"--data.path={corpus / 'text'}",
    ])  # fmt: skip
    notes = "\n".join(resolve_init_from(cfg))
    assert "model.n_layer=3 (config: 4)" in notes and "model.hidden=32 (config: 128)" in notes
    assert "model.max_positions=48" in notes and "preset='gpt-demo' dropped" in notes
    assert f"data.tokenizer={ckpt}" in notes and "600 padded to 768" in notes
    m = cfg.model
    assert (m.n_layer, m.hidden, m.n_head, m.vocab_size, m.max_positions, m.preset) == (3, 32, 2, 600, 48, "")
    assert cfg.data.tokenizer == str(ckpt) and resolve_init_from(cfg)[:1] == [notes.splitlines()[-1]]
    assert model_vocab(cfg, 600) == (768, 600)
    with pytest.raises(ValueError, match="taco data prepare --text PATH --tokenizer DIR"):
        model_vocab(cfg, 601)
    bare = _checkpoint(tmp_path / "bare", None)
    cfg = load_config(None, [f"--model.init_from={bare}", "--model.seq_len=32"])
    assert "has no tokenizer.json" in "\n".join(resolve_init_from(cfg)) and cfg.data.tokenizer == ""
    with pytest.raises(ValueError, match="model.seq_len = 64: must be <= model.max_positions = 48"):
        resolve_init_from(load_config(None, [f"--model.init_from={bare}", "--model.seq_len=64"]))
    with pytest.raises(ValueError, match="n_head = 2 must be divisible by parallel.tp = 4"):
        resolve_init_from(
            load_config(None, [f"--model.init_from={bare}", "--model.seq_len=32", "--parallel.tp=4"])
        )


def test_config_show_lists_every_key(capsys, tmp_path):
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    for key in ("--model.init_from", "--model.max_positions", "--data.tokenizer", "--train.steps"):
        assert key in out
    assert main(["config", "show", "--parallel.tp=2"]) == 0
    assert "tp = 2" in capsys.readouterr().out
    assert main(["config", "show", "--parallel.tpp=2"]) == 2
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "taco config show" in capsys.readouterr().out


# ---- GPT-2's vocabulary at TP=2, end to end (acceptance) ----


def test_gpt2_vocab_finetune_at_tp2_exports_what_transformers_reloads(corpus, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from taco.train.export import load_run_model
    from taco.train.launch import launch

    torch.manual_seed(0)
    ckpt = tmp_path / "gpt2"
    hf_cfg = transformers.GPT2Config(vocab_size=GPT2_VOCAB, n_layer=2, n_head=4, n_embd=32, n_positions=64)
    transformers.GPT2LMHeadModel(hf_cfg).save_pretrained(ckpt)
    gpt2_style_tokenizer(TEXT, GPT2_VOCAB).save(str(ckpt / "tokenizer.json"))
    run = tmp_path / "run"
    cfg = load_config(None, [
        f"--model.init_from={ckpt}", "--model.seq_len=32", "--data.dataset=text",
        f"--data.path={corpus / 'text'}", f"--data.cache_dir={tmp_path / 'cache'}", "--parallel.tp=2",
        "--compression.tp_codec=none", "--train.batch_size=4", "--train.steps=3", "--train.warmup_steps=1",
        "--train.eval_steps=1", "--train.lr=1e-2", f"--train.out_dir={run}",
    ])  # fmt: skip
    launch(cfg)
    assert "padded to 50432" in capsys.readouterr().err
    saved = load_config(run / "config.toml")
    assert (saved.model.n_layer, saved.model.hidden, saved.model.vocab_size) == (2, 32, GPT2_VOCAB)
    assert saved.data.tokenizer == str(ckpt)

    # the first step's loss is the unpadded checkpoint's loss on batch 0
    reference = transformers.AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
    data_dir = next((tmp_path / "cache").glob("text-*-tok*"))
    x, y = TokenDataset(data_dir, "train", 32, seed=saved.train.seed).get_batch(0, 4)
    assert int(y.min()) < 50432 // 2 <= int(y.max()) < GPT2_VOCAB  # targets in both vocab shards
    with torch.no_grad():
        ref_loss = nn.functional.cross_entropy(reference(x).logits.flatten(0, 1), y.flatten()).item()
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["loss"] == pytest.approx(ref_loss, abs=1e-4)

    out = tmp_path / "export"
    assert main(["export", "--run", str(run), "--out", str(out)]) == 0
    assert "175 padding rows stripped" in capsys.readouterr().out
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert theirs.config.vocab_size == GPT2_VOCAB
    assert theirs.transformer.wte.weight.shape == (GPT2_VOCAB, 32)
    ours, vocab, _ = load_run_model(run)
    assert vocab == GPT2_VOCAB and ours.tok_emb.weight.shape == (50432, 32)
    summary = json.loads((run / "summary.json").read_text())  # the merge is what the ranks trained
    assert _val_loss(ours, data_dir, saved, vocab) == pytest.approx(summary["final_val_loss"], abs=1e-5)
    assert not torch.equal(theirs.transformer.wte.weight, reference.transformer.wte.weight)  # it trained
    idx = torch.cat([x[:2, :20], torch.full((2, 1), GPT2_VOCAB - 1)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[..., :GPT2_VOCAB], theirs(idx).logits, atol=1e-5, rtol=1e-5)
    assert (out / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()


# ---- export merges the shards of any mesh ----


def _val_loss(model, data_dir: Path, cfg, vocab: int | None = None) -> float:
    """The trainer's evaluation, on one process: the mean loss of the train.eval_steps val batches
    (`model(x)` gives the logits, or an output with `.logits`; the first `vocab` columns count)."""
    ds = TokenDataset(data_dir, "val", cfg.model.seq_len, seed=cfg.train.seed)
    losses = []
    with torch.no_grad():
        for i in range(cfg.train.eval_steps):
            x, y = ds.get_batch(i, cfg.train.batch_size)
            out = model(x)
            logits = getattr(out, "logits", out)[..., : vocab or None]
            losses.append(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
    return torch.stack(losses).mean().item()


GPT_PP = ["--model.kind=gpt", "--parallel.pp=2"]
QWEN_SP = ["--model.kind=qwen", "--model.n_kv_head=2", "--parallel.sp=true", "--model.tie_embeddings=false"]


@pytest.mark.parametrize("mesh", [
    pytest.param(GPT_PP, id="gpt-pp2-tp2", marks=pytest.mark.slow),  # 4 ranks: slow
    pytest.param(QWEN_SP, id="qwen-tp2-sp"),
])  # fmt: skip
def test_export_merges_the_shards_of_the_mesh(corpus, tmp_path, mesh):
    """The merged model scores the validation batches exactly as the distributed run did."""
    from taco.train.data import prepare_text
    from taco.train.export import export_run, load_run_model
    from taco.train.launch import launch

    cache = tmp_path / "cache"
    data_dir = prepare_text(corpus / "text", cache, vocab_size=300, progress=lambda *a: None)
    run = tmp_path / "run"
    cfg = load_config(None, [
        "--model.n_layer=2", "--model.n_head=4", "--model.hidden=32", "--model.seq_len=32",
        "--data.dataset=text", f"--data.path={corpus / 'text'}", f"--data.cache_dir={cache}",
        "--data.vocab_size=300", "--parallel.tp=2", "--train.batch_size=4", "--train.steps=2",
        "--train.eval_steps=2", "--train.warmup_steps=1", f"--train.out_dir={run}", *mesh,
    ])  # fmt: skip
    summary = launch(cfg)
    model, vocab, saved = load_run_model(run)
    assert vocab == model.tok_emb.weight.shape[0] == 384  # random init: the padded rows are the model's
    assert _val_loss(model, data_dir, saved) == pytest.approx(summary["final_val_loss"], abs=1e-5)
    res = export_run(run, tmp_path / "hf")
    loaded, _ = load_hf_checkpoint(res["out"])
    assert _val_loss(loaded.eval(), data_dir, saved) == pytest.approx(summary["final_val_loss"], abs=1e-5)
    assert (res["out"] / "tokenizer.json").is_file() and res["stripped"] == 0
