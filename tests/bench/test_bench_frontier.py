"""`taco bench codec --frontier`: the tables hold what they name, the docs region is rewritten."""

from __future__ import annotations

import argparse
import json

import torch

from taco.bench.frontier import HARDWARE, head_to_head, rd_bound_db, run_frontier


def test_frontier_tables_plot_and_docs_region(tmp_path):
    caps = tmp_path / "run"
    caps.mkdir()
    gen = torch.Generator().manual_seed(0)
    torch.save(torch.randn(16, 256, generator=gen), caps / "layers.0.attn.out.fwd.step5.pt")
    torch.save(torch.randn(16, 256, generator=gen) * 1e-6, caps / "layers.0.mlp.up.bwd.step5.pt")
    torch.save(torch.randn(16, 256, generator=gen), caps / "not_a_site.pt")  # no direction: left out
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- frontier:begin -->\nold\n<!-- frontier:end -->\noutro\n")
    args = argparse.Namespace(
        tensors=str(caps), size=4096, seed=0, json=str(tmp_path / "f.json"), markdown=str(tmp_path / "t.md"),
        plot=str(tmp_path / "f.png"), docs=str(page),
        codecs="int6-hadamard,mxfp6-e2m3,mxfp6-e2m3(scale_rule=rceil),int4-hadamard-g32,nvfp4",
    )  # fmt: skip
    assert run_frontier(args) == 0
    res = json.loads((tmp_path / "f.json").read_text())
    assert res["tensors"] == {"fwd": 1, "bwd": 1}
    rows = {r["spec"]: r for r in res["codecs"]}
    assert rows["mxfp6-e2m3"]["hardware"] and not rows["int6-hadamard"]["hardware"]
    assert rows["int6-hadamard"]["bytes_per_elem"] == rows["mxfp6-e2m3"]["bytes_per_elem"] == 25 / 32
    assert abs(rows["nvfp4"]["bytes_per_elem"] - 0.5625) < 1e-3
    assert rows["int6-hadamard"]["rd_bound_db"] == rd_bound_db(25 / 32)
    h = {x["codec"]: x for x in res["head_to_head"]}
    assert h["int6-hadamard"]["variants"] == 2 and h["int6-hadamard"]["tensors"] == 2
    per = res["sqnr"]
    k = "run/layers.0.attn.out.fwd.step5"
    lead = per["int6-hadamard"][k] - max(per["mxfp6-e2m3"][k], per["mxfp6-e2m3(scale_rule=rceil)"][k])
    assert h["int6-hadamard"]["min_lead_db"] <= lead + 1e-9
    text = page.read_text()
    assert text.startswith("intro\n<!-- frontier:begin -->\nSQNR in dB") and text.endswith(
        "<!-- frontier:end -->\noutro\n"
    )
    assert "| int6-hadamard | mxfp6 (2) |" in text and "old" not in text
    assert (tmp_path / "f.png").stat().st_size > 1000
    assert len(HARDWARE) == 22 and head_to_head({"sqnr": {}}, []) == []
