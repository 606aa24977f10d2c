"""`taco compare --grad-fidelity`: each codec's full-model gradient against the uncompressed one."""

import json

import pytest

from taco.train.adaptive.grad_fidelity import fidelity_steps, grad_fidelity
from tests.helpers.runs import cli_error, tiny


def test_fidelity_steps_are_evenly_spaced_and_end_at_the_last_step():
    assert fidelity_steps(40, 5) == [8, 16, 24, 32, 40]
    assert fidelity_steps(2, 5) == [1, 2]
    with pytest.raises(ValueError):
        fidelity_steps(0, 5)


def test_none_is_exact_and_a_coarse_codec_moves_the_gradient_more_than_taco(corpus, tmp_path):
    # TP=2, hidden 64: every TP message (4 x 32 x 64 elements) goes through the codec
    cfg = tiny(corpus, tmp_path / "unused", "--train.steps=4", "--model.hidden=64", "--train.eval_interval=0")
    res = grad_fidelity(cfg, ["none", "taco", "int2-hadamard"], tmp_path / "gf", points=2)
    assert res["steps"] == [2, 4]
    rows = {r["codec"]: r for r in res["rows"]}
    # the same weights, batch and collectives as the reference: bit-identical gradients
    assert rows["none"]["cos"] == [1.0, 1.0] and rows["none"]["rel_err"] == [0.0, 0.0]
    for k in range(2):
        assert 0.9 < rows["taco"]["cos"][k] < 1.0 and 0 < rows["taco"]["rel_err"][k] < 0.5
        assert rows["int2-hadamard"]["cos"][k] < rows["taco"]["cos"][k]
        assert rows["int2-hadamard"]["rel_err"][k] > rows["taco"]["rel_err"][k]
    assert rows["int2-hadamard"]["cos_ge_taco"] is False and rows["taco"]["cos_ge_taco"] is True
    assert json.loads((tmp_path / "gf" / "grad_fidelity.json").read_text())["rows"][1]["codec"] == "taco"
    md = (tmp_path / "gf" / "grad_fidelity.md").read_text()
    assert "int2-hadamard" in md and "step 4: cos / rel err" in md


def _records(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_measurement_leaves_training_alone(corpus, tmp_path):
    """The grad-fidelity run's loss curve is the plain run's, step for step (two runs, ~15 s)."""
    from taco.train.launch import launch

    args = ("--train.steps=4", "--model.hidden=64", "--train.eval_interval=0")
    grad_fidelity(tiny(corpus, tmp_path / "unused", *args), ["taco"], tmp_path / "gf", points=2)
    launch(tiny(corpus, tmp_path / "plain", *args, "--compression.tp_codec=none"))
    recs, base = _records(tmp_path / "gf" / "grad-fidelity"), _records(tmp_path / "plain")
    assert [r["loss"] for r in recs] == [r["loss"] for r in base]
    assert [r["grad_norm"] for r in recs] == [r["grad_norm"] for r in base]
    assert recs[1]["grad_loss/reference"] == base[2]["loss"]  # step 2's hook: the batch step 3 trains on


def test_grad_sums_count_tp_shards_once_and_replicas_once(corpus, tmp_path):
    """The TP=2 gradient norm (`Run.grad_sums` of the squares) is the unsharded model's: the
    same weights and batch at TP=1 give the same first-step norm, up to fp32 summation order."""
    from taco.train.launch import launch

    args = ("--train.steps=1", "--model.hidden=64", "--train.eval_interval=0", "--compression.tp_codec=none")
    launch(tiny(corpus, tmp_path / "tp2", *args))
    launch(tiny(corpus, tmp_path / "tp1", *args, "--parallel.tp=1"))
    tp2, tp1 = _records(tmp_path / "tp2")[0], _records(tmp_path / "tp1")[0]
    assert tp2["loss"] == pytest.approx(tp1["loss"], rel=1e-5)
    assert tp2["grad_norm"] == pytest.approx(tp1["grad_norm"], rel=1e-4)


SITES = ["tok_emb.fwd", "lm_head.bwd"] + [
    f"layers.{i}.{s}" for i in (0, 1) for s in ("attn.out.fwd", "attn.qkv.bwd", "mlp.down.fwd", "mlp.up.bwd")
]


def test_a_ladder_run_is_measured_on_its_codecs_of_each_step_and_pairs_split_by_direction(corpus, tmp_path):
    args = ("--train.steps=4", "--model.hidden=64", "--train.eval_interval=0")
    cfg = tiny(corpus, tmp_path / "unused", *args)
    # a ladder run whose every site was on taco through step 2 and moved to plain at step 3
    lad = tmp_path / "ladder-run"
    lad.mkdir()
    doc = {
        "version": 1,
        "ladder": "ladder(taco,none,start=0)",
        "sites": {s: {"rungs": [[1, 0], [3, 1]]} for s in SITES},
    }
    (lad / "ladder.json").write_text(json.dumps(doc))
    codecs = ["taco", "none/none", "taco/none", "none/taco"]
    res = grad_fidelity(cfg, codecs, tmp_path / "gf", points=2, ladder_runs=str(lad))
    rows = {r["codec"]: r for r in res["rows"]}
    assert list(rows) == [*codecs, "ladder-run"] and res["steps"] == [2, 4]
    assert rows["ladder-run"]["cos"] == [rows["taco"]["cos"][0], 1.0]  # taco at step 2, plain at step 4
    assert rows["ladder-run"]["rel_err"] == [rows["taco"]["rel_err"][0], 0.0]
    assert rows["none/none"]["cos"] == [1.0, 1.0]
    for half in ("taco/none", "none/taco"):  # one direction compressed: between taco and exact
        assert all(t < c < 1.0 for t, c in zip(rows["taco"]["cos"], rows[half]["cos"])), half
        assert rows[half]["n_ge_taco"] == 2
    assert (
        rows["ladder-run"]["n_ge_taco"] == 2
        and "| ladder-run |" in (tmp_path / "gf" / "grad_fidelity.md").read_text()
    )
    # a ladder run of another seed is refused, before any training
    (lad / "config.toml").write_text("[train]\nseed = 7\nsteps = 4\n")
    with pytest.raises(ValueError, match="seed 7"):
        grad_fidelity(cfg, ["taco"], tmp_path / "gf2", points=2, ladder_runs=str(lad))


def test_seeds_are_totalled_as_steps_where_a_row_is_at_least_taco(tmp_path):
    from taco.train.adaptive.grad_fidelity import table, totals, write_seeds

    def seed(cos_x: list[float]) -> dict:
        taco = {"grad_cos/taco": 0.99, "grad_rel_err/taco": 0.1}
        recs = [{"step": s, **taco, "grad_cos/x": c, "grad_rel_err/x": 0.2} for s, c in zip((5, 10), cos_x)]
        return table(recs, ["taco", "x"], [5, 10])

    per = [{"seed": 1, **seed([0.995, 0.98])}, {"seed": 2, **seed([0.99, 0.991])}]
    assert [r["n_ge_taco"] for r in per[0]["rows"]] == [2, 1] and per[0]["rows"][1]["cos_ge_taco"] is False
    tot = {t["codec"]: t for t in totals(per)}
    assert (tot["x"]["n_ge_taco"], tot["x"]["n"], tot["x"]["min_cos"]) == (3, 4, 0.98)
    write_seeds(tmp_path, {"steps": [5, 10], "seeds": per, "totals": totals(per)})
    md = (tmp_path / "grad_fidelity.md").read_text()
    assert "| x | 3 of 4 | 0.980000 |" in md and "| x | 2 | 0.990000 / 0.2000 |" in md


def test_the_command_line_checks_ladder_runs_and_pairs_before_any_run(capsys, tmp_path):
    base = ["compare", "--config", "configs/cluster.toml", "--out", str(tmp_path)]
    assert "--grad-fidelity" in cli_error(capsys, [*base, "--ladder-run", str(tmp_path)])
    err = cli_error(capsys, [*base, "--grad-fidelity", "--codecs", "int5-hadamard/int4-hadamrd"])
    assert "int4-hadamrd" in err
    assert not any(tmp_path.iterdir())
