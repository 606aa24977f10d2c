"""`taco compare`: the single-seed table, and with --seeds the seed band and the mean gaps."""

import json

import pytest

from taco.cli import main
from taco.train.compare import seed_summary
from tests.helpers.runs import tiny_args


def test_seed_summary_arithmetic():
    losses = {("none", 1): 5.0, ("none", 2): 5.2, ("none", 3): 5.1,
              ("a", 1): 5.05, ("a", 2): 5.25, ("a", 3): 5.15,  # +0.05 on every seed
              ("b", 1): 5.5, ("b", 2): 5.3, ("b", 3): 5.4}  # fmt: skip
    rows = [{"codec": c, "seed": s, "final_val_loss": v} for (c, s), v in losses.items()]
    by = {e["codec"]: e for e in seed_summary(rows)}
    assert by["none"]["band"] == pytest.approx(0.2) and by["a"]["band"] == by["none"]["band"]
    assert by["none"]["mean_gap"] == 0.0 and by["none"]["inside_band"]
    assert by["a"]["mean_final_val_loss"] == pytest.approx(5.15)
    assert by["a"]["mean_gap"] == pytest.approx(0.05) and by["a"]["inside_band"]
    assert by["a"]["mean_gap_pct"] == pytest.approx(100 * 0.05 / 5.1)
    assert by["b"]["mean_gap"] == pytest.approx(0.3) and not by["b"]["inside_band"]
    assert by["b"]["seeds"] == [1, 2, 3]


@pytest.mark.slow
def test_compare_on_two_seeds_writes_the_band_and_the_mean_gaps(corpus, tmp_path, capsys):
    """Four tiny TP=2 runs (none and taco on seeds 7 and 8): the table's arithmetic from the runs."""
    out = tmp_path / "cmp"
    args = [*tiny_args(corpus, tmp_path / "unused"), "--parallel.tp=2", "--model.hidden=64"]
    assert main(["compare", "--codecs", "taco", "--seeds", "7,8", "--out", str(out), *args]) == 0
    data = json.loads((out / "compare.json").read_text())
    assert data["seeds"] == [7, 8]
    loss = {(r["codec"], r["seed"]): r["final_val_loss"] for r in data["runs"]}
    assert set(loss) == {("none", 7), ("none", 8), ("taco", 7), ("taco", 8)}
    for (codec, seed), v in loss.items():  # each run in its own folder, with its own seed
        summary = json.loads((out / codec / f"seed{seed}" / "summary.json").read_text())
        assert summary["final_val_loss"] == v
    assert loss[("none", 7)] != loss[("none", 8)]  # the seed changes the run
    by = {e["codec"]: e for e in data["summary"]}
    band = abs(loss[("none", 7)] - loss[("none", 8)])
    gap = ((loss[("taco", 7)] - loss[("none", 7)]) + (loss[("taco", 8)] - loss[("none", 8)])) / 2
    assert by["taco"]["band"] == pytest.approx(band) and by["taco"]["mean_gap"] == pytest.approx(gap)
    assert by["taco"]["inside_band"] == (abs(gap) <= band)
    md = (out / "compare.md").read_text()
    assert f"= {band:.4f}" in md and f"| taco | {by['taco']['mean_final_val_loss']:.4f} | {gap:+.4f} |" in md


def test_single_seed_compare_keeps_its_folders_and_list_json(corpus, tmp_path):
    out = tmp_path / "cmp"
    args = [*tiny_args(corpus, tmp_path / "unused"), "--parallel.tp=2", "--train.steps=1"]
    assert main(["compare", "--codecs", "taco", "--out", str(out), *args]) == 0
    rows = json.loads((out / "compare.json").read_text())
    assert [r["codec"] for r in rows] == ["none", "taco"] and (out / "taco" / "summary.json").is_file()
    assert rows[0]["gap_pct"] == 0.0 and "seed band" not in (out / "compare.md").read_text()
