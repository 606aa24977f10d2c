"""Reshardable checkpoints (train.checkpoint_format = "dcp"): saved at one tp x pp x dp layout,
resumed at others with the same next-step loss; a save killed mid-write is never the latest."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from taco.train.config import load_config
from taco.train.launch import launch
from taco.train.reshard import dp_restrict, fsdp_rows, tp_pieces
from tests.helpers.runs import losses, tiny_args


def qwen(corpus, out, *extra):
    """A tiny GQA Qwen (8 query, 4 key/value heads: every tp up to 4), DCP checkpoints."""
    return load_config(
        None,
        [
            *tiny_args(corpus, out),
            "--model.kind=qwen",
            "--model.n_head=8",
            "--model.n_kv_head=4",
            "--train.warmup_steps=2",
            "--train.eval_interval=0",
            "--train.eval_steps=1",
            "--train.log_interval=1",
            "--train.checkpoint_format=dcp",
            "--train.lr=3e-3",
            "--compression.tp_codec=none",  # a lossy TP codec errs differently at each tp
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """Three steps at (tp=2, pp=2, dp=1), checkpoint of step 3; then the un-resharded resume to step 4."""
    root = tmp_path_factory.mktemp("reshard")
    launch(qwen(corpus, root / "src", "--parallel.tp=2", "--parallel.pp=2", "--train.steps=3"))
    step = root / "src" / "checkpoints" / "step_0000003"
    ref = root / "ref"
    launch(
        qwen(corpus, ref, "--parallel.tp=2", "--parallel.pp=2", "--train.steps=4", f"--train.resume={step}")
    )
    return step, losses(ref)[4]


def _resume(corpus, step, out, *layout):
    res = launch(qwen(corpus, out, *layout, "--train.steps=4", f"--train.resume={step}"))
    assert res["resumed_from"] == 3
    return losses(out)[4]


@pytest.mark.parametrize(
    "layout",
    [
        ("--parallel.tp=1", "--parallel.pp=1", "--parallel.dp=2"),
        ("--parallel.tp=4",),
        ("--parallel.tp=2", "--parallel.dp=2", "--parallel.dp_shard=true"),
        (
            "--parallel.tp=2",
            "--parallel.dp=2",
            "--parallel.dp_shard=true",
            "--parallel.tp_overlap=batch-split",
        ),
        ("--parallel.tp=1", "--parallel.pp=2", "--parallel.dp=2", "--parallel.zero=true"),
    ],
    ids=["tp1-pp1-dp2", "tp4", "tp2-dp2-fsdp2", "tp2-dp2-fsdp2-split", "pp2-dp2-zero1"],
)
def test_resume_at_another_layout_gives_the_same_next_step_loss(corpus, saved, tmp_path, layout):
    step, ref = saved
    got = _resume(corpus, step, tmp_path / "run", *layout)
    assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)


def test_dcp_checkpoint_records_checksums_and_refuses_a_damaged_file(saved, tmp_path):
    from taco.train.checkpoint import verify_checkpoint
    from taco.train.errors import CheckpointError

    step, _ = saved
    meta = json.loads((step / "meta.json").read_text())
    assert meta["format"] == "dcp" and ".metadata" in meta["files"]
    assert (step.parent / "latest").read_text().strip() == step.name
    bad = tmp_path / step.name
    import shutil

    shutil.copytree(step, bad)
    data = next(f for f in sorted(bad.iterdir()) if f.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=data.name):
        verify_checkpoint(bad, {"dp": 9, "pp": 9, "tp": 9, "sp": 0})  # any mesh: only the files count


_KILL = """
import os, sys
import torch.distributed.checkpoint.filesystem as fs
from taco.train.config import load_config
from taco.train.launch import launch
real = fs._write_item
def dying(transforms, stream, *a, **k):
    res = real(transforms, stream, *a, **k)
    if "step_0000004" in str(getattr(stream, "name", "")):  # one item of step 4 written: die
        stream.flush()
        os._exit(9)
    return res
fs._write_item = dying
launch(load_config(None, sys.argv[1:]))
"""


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_latest(corpus, tmp_path):
    """The rank process dies after writing part of step 4's files: `latest` still names step 2,
    and a resume continues from it."""
    out = tmp_path / "run"
    args = [
        *tiny_args(corpus, out),
        "--model.kind=gpt",
        "--train.steps=4",
        "--train.checkpoint_interval=2",
        "--train.checkpoint_format=dcp",
        "--train.checkpoint_async=false",
        "--train.eval_interval=0",
        "--train.eval_steps=1",
    ]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", _KILL, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 9, r.stderr[-2000:]
    ck = out / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step_0000002"
    assert (ck / "step_0000004.partial").is_dir() and not (ck / "step_0000004").exists()
    res = launch(load_config(None, [*args, "--train.resume=true"]))
    assert res["resumed_from"] == 2 and res["steps"] == 4
    assert (ck / "latest").read_text().strip() == "step_0000004"
    assert not (ck / "step_0000004.partial").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pieces_name_fused_blocks_and_drop_vocabulary_padding():
    from torch import nn

    from taco.models import build_model

    m = build_model("qwen", vocab_size=10, hidden=16, n_head=4, n_kv_head=2, n_layer=1, intermediate=24)
    m.resize_vocab(16)  # padded for tp
    pieces = tp_pieces(m, 1, 0, vocab=10)
    qkv = pieces["layers.0.attn.qkv.weight"]
    assert [p.key for p in qkv] == [f"layers.0.attn.qkv.weight/{i}" for i in range(3)]
    assert [p.size for p in qkv] == [(16, 16), (8, 16), (8, 16)]
    assert pieces["tok_emb.weight"][0].size == (10, 16) and pieces["tok_emb.weight"][0].shape == (10, 16)
    assert isinstance(m.lm_head, nn.Linear) and "lm_head.weight" not in pieces  # tied: tok_emb's
    # dp rank 1 of 3 under FSDP2 holds rows [11, 22) of the fused [32, 16] q/k/v: parts of q and k
    lo, hi = fsdp_rows(32, 11, 3, 1)
    assert (lo, hi) == (11, 22)
    cut = dp_restrict(qkv, lo, hi)
    assert [(p.key, p.local[0], p.offsets[0]) for p in cut] == [
        ("layers.0.attn.qkv.weight/0", slice(0, 5), 11),
        ("layers.0.attn.qkv.weight/1", slice(5, 11), 0),
    ]


def _all_tensors(step: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{step.parent.parent.name}.pt"
    dcp_to_torch_save(step, out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow  # about 50 s: three runs
def test_sync_save_equals_async_save_and_bf16_masters_follow_their_weights(corpus, saved, tmp_path):
    """The same run saved synchronously holds the same tensors as the async save of the fixture;
    a bf16 run's fp32 masters are saved beside the weights (each weight is its master rounded),
    and resume at another layout."""
    step, _ = saved
    sync = tmp_path / "sync"
    launch(
        qwen(
            corpus,
            sync,
            "--parallel.tp=2",
            "--parallel.pp=2",
            "--train.steps=3",
            "--train.checkpoint_async=false",
        )
    )
    a, b = _all_tensors(step, tmp_path), _all_tensors(sync / "checkpoints" / "step_0000003", tmp_path)
    tensors = sorted(k for k, v in a.items() if isinstance(v, torch.Tensor))
    assert tensors == sorted(k for k, v in b.items() if isinstance(v, torch.Tensor))
    assert any(k.endswith("/exp_avg_sq") for k in tensors) and "model/layers.1.attn.qkv.weight/1" in tensors
    for k in tensors:
        assert torch.equal(a[k], b[k]), k

    bf16 = tmp_path / "bf16"
    launch(qwen(corpus, bf16, "--parallel.tp=2", "--train.steps=2", "--train.dtype=bf16"))
    c = _all_tensors(bf16 / "checkpoints" / "step_0000002", tmp_path)
    masters = [k for k in c if k.startswith("optim/") and k.endswith("/master")]
    assert masters and len(masters) == len([k for k in c if k.startswith("model/")])
    for k in masters:
        weight = c["model/" + k.removeprefix("optim/").removesuffix("/master")]
        assert c[k].dtype == torch.float32 and weight.dtype == torch.bfloat16
        assert torch.equal(c[k].to(torch.bfloat16), weight), k
    res = launch(
        qwen(corpus, tmp_path / "bf16-dp2", "--parallel.tp=1", "--parallel.dp=2", "--train.dtype=bf16",
             "--train.steps=3", f"--train.resume={bf16 / 'checkpoints' / 'step_0000002'}")
    )  # fmt: skip
    assert res["resumed_from"] == 2


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(("--parallel.tp=2", "--compression.tp_codec=taco"), id="tp2-taco"),
        pytest.param(
            (
                "--parallel.tp=2",
                "--parallel.dp=2",
                "--parallel.dp_shard=true",
                "--compression.dp_weight_codec=int8-hadamard",
                "--compression.dp_grad_codec=int8-hadamard",
            ),
            id="tp2-dp2-fsdp2-int8",
            marks=pytest.mark.slow,
        ),  # fmt: skip
    ],
)
def test_resume_on_the_same_layout_reproduces_the_uninterrupted_run_exactly(corpus, tmp_path, layout):
    """On the mesh that wrote it, a DCP checkpoint resumes bit for bit (FSDP2's weight-difference
    references included), like a per-rank one."""
    launch(qwen(corpus, tmp_path / "full", *layout, "--train.steps=4"))
    launch(qwen(corpus, tmp_path / "part", *layout, "--train.steps=2"))
    launch(qwen(corpus, tmp_path / "part", *layout, "--train.steps=4", "--train.resume=true"))
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert [a[s] for s in (3, 4)] == [b[s] for s in (3, 4)]
