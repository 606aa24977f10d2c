"""Fine-tune Hugging Face checkpoints with TACO at TP=2, export them, reload them in transformers.

Offline and small: the checkpoints are a tiny GPT-2 and a tiny Qwen2 (`--kind llama3`: a tiny
Llama 3 with its RoPE scaling) with random weights, built with transformers and saved with
`save_pretrained`, each with a byte-level BPE tokenizer (trained here with `tokenizers` on the
text, wrapped as a `PreTrainedTokenizerFast`) saved beside it, as a published checkpoint has. The
text folder holds this repository's LICENSE (plain English that stays the same from one version
of the project to the next, so the losses in the docs stay true).
The vocabulary (1000 tokens) is no multiple of 256, so at TP=2 it is padded to 1024, masked out of
the loss, and stripped again by `taco export`, like GPT-2's 50257.

    python examples/finetune_hf.py make runs/ft-example   # checkpoints + tokenizer + text folder
    taco train --model.init_from=runs/ft-example/gpt2 ...  # see docs/fine-tuning.md
    taco export --run runs/ft-gpt2 --out runs/ft-gpt2/hf
    python examples/finetune_hf.py check runs/ft-gpt2      # transformers vs taco logits
    python examples/finetune_hf.py all runs/ft-example     # all of it, both models (runs in run-*/)

Needs `pip install -e '.[hf]'` (transformers); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 1000
KINDS = ("gpt2", "qwen2")


def make_text(out: Path) -> Path:
    """A folder of .txt files: this repository's LICENSE (plain English, offline, stable)."""
    text = out / "text"
    text.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ROOT / "LICENSE", text / "LICENSE.txt")
    return text


def make_tokenizer(text: Path):
    """A byte-level BPE of VOCAB tokens trained on `text`, <|endoftext|> last (as in GPT-2),
    as a transformers `PreTrainedTokenizerFast` (it saves tokenizer.json and its config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([f.read_text() for f in sorted(text.glob("*.txt"))], trainer=trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    eot = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot, unk_token=eot)


def make_checkpoint(kind: str, path: Path, tokenizer) -> None:
    """A tiny random `kind` model (transformers), saved with its tokenizer beside it."""
    import transformers

    torch.manual_seed(0)
    eot = tokenizer.eos_token_id
    ids = dict(vocab_size=len(tokenizer), bos_token_id=eot, eos_token_id=eot)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=256, **ids)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama3":  # Llama 3.1's RoPE scaling, acting at these lengths (original context 64)
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}  # fmt: skip
        cfg = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rope_parameters=rope, **ids,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(
            hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, **ids,
        )  # fmt: skip
        model = transformers.Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {path}: {kind}, {n / 1e6:.2f}M parameters (random), vocab {cfg.vocab_size}, tokenizer.json")


def make(out: Path, kinds: tuple[str, ...] = KINDS) -> None:
    text = make_text(out)
    print(f"wrote {text}: {', '.join(f.name for f in sorted(text.glob('*.txt')))}")
    tokenizer = make_tokenizer(text)
    for kind in kinds:
        make_checkpoint(kind, out / kind, tokenizer)


def check(run: Path, hf_dir: Path | None = None) -> float:
    """Logits of the exported checkpoint in transformers against taco's model from the run's
    sharded checkpoint, on a sentence; returns the largest absolute difference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from taco.train.export import load_run_model

    hf_dir = hf_dir or run / "hf"
    ours, vocab, _ = load_run_model(run)
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer("Tensor parallelism splits every layer over the ranks.", return_tensors="pt").input_ids
    with torch.no_grad():
        mine = ours(ids)[..., :vocab]  # the padded columns are not tokens
        ref = theirs(ids).logits
    diff = (mine - ref).abs().max().item()
    print(
        f"{run}: transformers loaded {hf_dir} ({type(theirs).__name__}, vocab {theirs.config.vocab_size}); "
        f"logits {tuple(ref.shape)}, max |taco - transformers| = {diff:.2e}"
    )
    if not (theirs.config.vocab_size == vocab and diff < 1e-4):
        got = theirs.config.vocab_size
        raise SystemExit(f"mismatch: vocab {got} (want {vocab}), logits {diff:.2e} apart")
    return diff


def train_args(ckpt: Path, text: Path, run: Path) -> list[str]:
    """The `taco train` arguments of docs/fine-tuning.md."""
    return [
        "train", f"--model.init_from={ckpt}", "--data.dataset=text", f"--data.path={text}",
        "--parallel.tp=2", "--model.seq_len=64", "--train.batch_size=8", "--train.steps=40",
        "--train.lr=3e-3", "--train.warmup_steps=5", "--train.eval_interval=20", f"--train.out_dir={run}",
    ]  # fmt: skip


def run_taco(argv: list[str]) -> None:
    from taco.cli import main

    print("$ taco " + " ".join(shlex.quote(a) for a in argv), flush=True)
    if main(argv):
        raise SystemExit(f"taco {argv[0]} failed")


def main(argv: list[str] | None = None) -> int:
    try:
        from transformers.utils import logging
    except ImportError:
        raise SystemExit("this example needs transformers: pip install -e '.[hf]'") from None
    logging.disable_progress_bar()  # no bars for saving and loading a 0.2M-parameter model
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("step", choices=("make", "check", "all"))
    p.add_argument("dir", type=Path, help="make/all: the example folder; check: a run folder")
    p.add_argument(
        "--kind",
        action="append",
        choices=(*KINDS, "llama3"),
        help=f"make/all: these models (default: {KINDS})",
    )
    args = p.parse_args(argv)
    kinds = tuple(args.kind or KINDS)
    if args.step == "make":
        make(args.dir, kinds)
    elif args.step == "check":
        check(args.dir)
    else:
        make(args.dir, kinds)
        for kind in kinds:
            run = args.dir / f"run-{kind}"
            run_taco(train_args(args.dir / kind, args.dir / "text", run))
            run_taco(["export", "--run", str(run), "--out", str(run / "hf")])
            check(run)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing
    sys.exit(main())
