"""The trainer with batch-split TP overlap: per-step losses equal the unsplit run's (codec none),
compressed runs train, and the combinations it does not run with are refused by the config."""

from __future__ import annotations

import math

import pytest

from taco.train.launch import launch
from tests.helpers.runs import losses, resume_exact, tiny

SPLIT = ["--parallel.tp_overlap=batch-split", "--parallel.tp_overlap_chunks=2"]


def _rel(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys() and len(a) >= 4
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


def test_batch_split_per_step_losses_equal_the_unsplit_run(corpus, tmp_path):
    every = ["--compression.tp_codec=none", "--train.log_interval=1"]
    launch(tiny(corpus, tmp_path / "plain", *every))
    launch(tiny(corpus, tmp_path / "split", *every, *SPLIT))
    assert _rel(losses(tmp_path / "split"), losses(tmp_path / "plain")) <= 1e-5
    # the embedding runs inside the pieces: its all-reduce is issued per piece, as a block's is
    plain, split = _calls(tmp_path / "plain"), _calls(tmp_path / "split")
    assert split["tok_emb.fwd"] == split["layers.0.attn.out.fwd"] == 2 * plain["tok_emb.fwd"] > 0
    assert split["lm_head.bwd"] == plain["lm_head.bwd"]  # the head stays whole


def _calls(out) -> dict[str, int]:
    """Calls per TP site, from the run's comm_stats.txt."""
    tp = (out / "comm_stats.txt").read_text().split("\n\n")[0].splitlines()[2:]
    return {row.split()[0]: int(row.split()[1]) for row in tp if not row.startswith(("total", "buffers"))}


def test_batch_split_with_a_codec_and_recompute_trains(corpus, tmp_path):
    args = ["--compression.tp_codec=int6-hadamard", "--train.log_interval=1"]
    launch(tiny(corpus, tmp_path / "plain", *args))
    res = launch(tiny(corpus, tmp_path / "split", *args, *SPLIT, "--train.recompute=full"))
    assert math.isfinite(res["final_val_loss"])
    # the codes are a function of each group, and a group never spans two sequences: same codes
    assert _rel(losses(tmp_path / "split"), losses(tmp_path / "plain")) <= 1e-4


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--parallel.tp_overlap_chunks=3"], "must divide the micro-batch"),
        (["--train.compile=true"], "does not run with train.compile"),
        (["--parallel.tp_overlap_chunks=0"], "tp_overlap_chunks"),
    ],
)
def test_batch_split_config_refuses_what_it_does_not_run(corpus, tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        tiny(corpus, tmp_path / "x", *SPLIT[:1], *extra)


def test_batch_split_config_accepts_fsdp2(corpus, tmp_path):
    cfg = tiny(corpus, tmp_path / "x", *SPLIT, "--parallel.dp=2", "--parallel.dp_shard=true")
    assert cfg.parallel.dp_shard and cfg.parallel.tp_overlap.value == "batch-split"


FSDP = ["--parallel.dp=2", "--parallel.dp_shard=true", "--train.log_interval=1"]


@pytest.mark.slow  # 2 runs of 4 gloo ranks
def test_batch_split_with_fsdp2_per_step_losses_equal_the_unsplit_run(corpus, tmp_path):
    launch(tiny(corpus, tmp_path / "plain", *FSDP, "--compression.tp_codec=none"))
    launch(tiny(corpus, tmp_path / "split", *FSDP, "--compression.tp_codec=none", *SPLIT))
    assert _rel(losses(tmp_path / "split"), losses(tmp_path / "plain")) <= 1e-5


FSDP_CODECS = ["--compression.tp_codec=int6-hadamard", "--compression.dp_grad_codec=int8-hadamard"]
FSDP_CODECS.append("--compression.dp_weight_codec=int8-hadamard")


@pytest.mark.slow  # 2 runs of 4 gloo ranks
def test_batch_split_with_fsdp2_and_codecs_trains(corpus, tmp_path):
    launch(tiny(corpus, tmp_path / "plain", *FSDP, *FSDP_CODECS))
    res = launch(tiny(corpus, tmp_path / "split", *FSDP, *FSDP_CODECS, *SPLIT))
    assert math.isfinite(res["final_val_loss"])
    assert 0 < res["dp_wire_bytes_per_step"] < 0.6 * res["dp_raw_bytes_per_step"]  # the DP codecs ran
    # one FSDP2 unit instead of one per block: the flat buffers, so the DP codes' groups, differ
    assert _rel(losses(tmp_path / "split"), losses(tmp_path / "plain")) <= 1e-4


@pytest.mark.slow  # 3 runs of 4 gloo ranks
def test_batch_split_with_fsdp2_and_codecs_resumes_exactly(corpus, tmp_path):
    # the checkpoint holds the one unit's shards and its weight-difference reference
    res = resume_exact(corpus, tmp_path, ["--parallel.dp=2", "--parallel.dp_shard=true", "--parallel.tp=2",
                                          *FSDP_CODECS, *SPLIT])  # fmt: skip
    assert res["mesh"] == "DP2-PP1-TP2"


def test_batch_split_with_sp_and_the_adaptive_wing_trains(corpus, tmp_path):
    wing = ["--compression.calibrate=true", "--compression.calibrate_steps=2"]
    wing += ["--compression.telemetry_every=2", "--compression.when=auto"]
    wing += ["--compression.auto_warmup_steps=1", "--compression.auto_repeats=2"]
    res = launch(tiny(corpus, tmp_path / "wing", "--parallel.sp=true", *wing, *SPLIT))
    assert math.isfinite(res["final_val_loss"])
    assert (tmp_path / "wing" / "calibration.json").is_file()


@pytest.mark.parametrize("mp", ["master", "autocast"])  # autocast: entered on each piece's worker
def test_batch_split_in_bf16_stays_on_the_unsplit_curve(corpus, tmp_path, mp):
    args = ["--compression.tp_codec=none", "--train.log_interval=1", "--train.dtype=bf16"]
    args.append(f"--train.mixed_precision={mp}")
    launch(tiny(corpus, tmp_path / "plain", *args))
    launch(tiny(corpus, tmp_path / "split", *args, *SPLIT))
    assert _rel(losses(tmp_path / "split"), losses(tmp_path / "plain")) <= 1e-2  # bf16 rounding only
