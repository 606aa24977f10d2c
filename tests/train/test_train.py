"""The trainer end to end on a tiny corpus: learning, exact resume, capture, start-up errors."""


import torch

from taco.train.launch import launch
from tests.helpers.runs import cli_error, losses, tiny, tiny_args


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
    e = cli_error(
        capsys, [*base, f"--data.path={path}", "--model.n_head=3", "--model.hidden=48", "--parallel.tp=2"]
    )
    assert "divisible by" in e and "tp" in e
    e = cli_error(capsys, [*base, f"--data.path={tmp_path / 'nope.txt'}"])
    assert "nope.txt" in e
    e = cli_error(capsys, [*base, f"--data.path={path}", "--compression.tp_codec=fp9"])
    assert "unknown codec" in e and "taco" in e
    # a checkpoint written with tp=2 cannot be resumed with tp=1
    launch(tiny(corpus, tmp_path / "ck", "--train.steps=1", "--train.checkpoint_interval=1"))
    argv = ["train", *tiny_args(corpus, tmp_path / "ck"), "--parallel.tp=1", "--train.resume=true"]
    e = cli_error(capsys, argv)
    assert "tp=2 (now 1)" in e


