"""The trainer end to end on a tiny corpus: learning, exact resume, capture, start-up errors."""

import json
from pathlib import Path

import torch

from taco.cli import main
from taco.train.config import load_config
from taco.train.launch import launch


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


def test_resume_reproduces_the_uninterrupted_run_exactly(corpus, tmp_path):
    full = launch(tiny(corpus, tmp_path / "full"))
    part = tiny(corpus, tmp_path / "part", "--train.steps=3", "--train.checkpoint_interval=3")
    launch(part)
    resumed = launch(tiny(corpus, tmp_path / "part", "--train.resume=true"))
    assert resumed["resumed_from"] == 3
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]  # bit-exact
    assert full["final_val_loss"] == resumed["final_val_loss"]
    assert (
        full["tp_wire_bytes_per_step"] > 0 and full["tp_wire_bytes_per_step"] < full["tp_raw_bytes_per_step"]
    )


def test_qwen_with_sequence_parallelism_learns_and_captures_tensors(corpus, tmp_path):
    cap = tmp_path / "cap"
    res = launch(
        tiny(
            corpus,
            tmp_path / "q",
            "--model.kind=qwen",
            "--model.n_kv_head=2",
            "--parallel.sp=true",
            "--train.steps=12",
            "--train.lr=3e-3",
            "--train.eval_interval=12",
            f"--train.capture_dir={cap}",
            "--train.capture_interval=5",
        )
    )
    ls = losses(tmp_path / "q")
    assert ls[12] < ls[1] - 0.5, ls
    assert res["tp_wire_bytes_per_step"] < 0.6 * res["tp_raw_bytes_per_step"]
    names = {p.name.split(".step")[0] for p in cap.glob("*.pt")}
    assert {
        "layers.0.attn.qkv.fwd",
        "layers.0.attn.qkv.bwd",
        "layers.1.mlp.down.fwd",
        "layers.1.mlp.down.bwd",
    } <= names
    t = torch.load(next(cap.glob("layers.0.mlp.down.fwd.step5.pt")))
    assert t.shape == (4, 32, 32)  # [b, s, h]: row-parallel partial output before reduce-scatter


def _err(capsys, argv):
    assert main(argv) == 2
    return capsys.readouterr().err


def test_bad_input_stops_at_start_up_with_one_clear_message(corpus, tmp_path, capsys):
    path, cache = corpus
    base = [
        "train",
        "--model.n_layer=1",
        "--model.hidden=32",
        "--model.seq_len=32",
        "--data.dataset=text",
        f"--data.cache_dir={cache}",
        f"--train.out_dir={tmp_path / 'x'}",
        "--train.steps=1",
    ]
    e = _err(
        capsys, [*base, f"--data.path={path}", "--model.n_head=3", "--model.hidden=48", "--parallel.tp=2"]
    )
    assert "divisible by" in e and "tp" in e
    e = _err(capsys, [*base, f"--data.path={tmp_path / 'nope.txt'}"])
    assert "nope.txt" in e
    e = _err(capsys, [*base, f"--data.path={path}", "--compression.tp_codec=fp9"])
    assert "unknown codec" in e and "taco" in e
    # a checkpoint written with tp=2 cannot be resumed with tp=1
    launch(tiny(corpus, tmp_path / "ck", "--train.steps=1", "--train.checkpoint_interval=1"))
    e = _err(capsys, ["train", *tiny_args(corpus, tmp_path / "ck"), "--parallel.tp=1", "--train.resume=true"])
    assert "tp=2 (now 1)" in e


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
