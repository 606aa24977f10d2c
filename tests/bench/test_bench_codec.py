"""`taco bench codec` (issue #6): runs on tiny sizes, JSON fields and exact values."""

from __future__ import annotations

import pytest
import torch

from taco.bench import codec as bench
from taco.cli import build_parser
from tests.helpers.bench import TINY, run_bench, run_json


def test_rows_fields_and_exact_bytes(tmp_path, capsys):
    res = run_json(tmp_path, "--codecs", "none,taco,int8-hadamard,int4-hadamard", "--range")
    rows = res["rows"]
    assert len(rows) == len(bench.FAMILIES) * 4
    assert {r["family"] for r in rows} == set(bench.FAMILIES)
    fields = {
        "codec", "family", "backend", "dtype", "numel", "bytes_per_elem", "nbytes", "sqnr_db",
        "max_group_rel_err", "encode_elems_per_s", "decode_elems_per_s", "encode_vs_copy", "decode_vs_copy",
    }  # fmt: skip
    assert all(fields <= set(r) for r in rows)
    bpe = {r["codec"]: r["bytes_per_elem"] for r in rows}
    assert bpe == {
        "none": 2.0,
        "taco": 1 + 8 / 128,
        "int8-hadamard": 1 + 4 / 128,
        "int4-hadamard": 0.5 + 4 / 128,
    }
    for r in rows:
        assert r["nbytes"] == r["bytes_per_elem"] * r["numel"] and r["numel"] == 4096
        assert r["encode_elems_per_s"] > 0 and r["decode_elems_per_s"] > 0 and r["encode_vs_copy"] > 0
        if r["codec"] == "none":
            assert r["sqnr_db"] is None and r["max_group_rel_err"] == 0.0  # inf -> null in strict JSON
    by = {(r["codec"], r["family"]): r for r in rows}
    assert by[("int8-hadamard", "gaussian")]["sqnr_db"] > 40
    assert 30 < by[("taco", "gaussian")]["sqnr_db"] < 34
    assert by[("taco", "sparse")]["max_group_rel_err"] < 1  # zero groups decode to zeros
    rng = res["range"]
    assert set(rng) == {"taco", "int8-hadamard", "int4-hadamard"}
    assert rng["taco"]["1e-30"] > 0.5 and rng["taco"]["1e+30"] > 0.5 and rng["taco"]["1"] < 0.05
    flat = rng["int8-hadamard"]
    assert max(flat.values()) < 1.05 * min(flat.values())  # scale-invariant from 1e-30 to 1e30
    out = capsys.readouterr().out
    assert "SQNR dB" in out and "enc/copy" in out and "1e-30" in out


def test_backend_all_gives_one_row_per_backend(tmp_path):
    res = run_json(tmp_path, "--codecs", "taco,fp8-tensor", "--families", "gaussian", "--backend", "all")
    backends = sorted((r["codec"], r["backend"]) for r in res["rows"])
    assert backends == [("fp8-tensor", "-"), ("taco", "eager"), ("taco", "native")]
    sq = [r["sqnr_db"] for r in res["rows"] if r["codec"] == "taco"]
    assert abs(sq[0] - sq[1]) < 0.01  # same codec, same data: same fidelity whatever the backend


def test_captured_tensors_folder(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "caps"
    d.mkdir()
    torch.save(torch.randn(64, 128), d / "layers.0.attn.out.fwd.pt")
    save_file({"t": torch.randn(32, 256)}, str(d / "layers.0.mlp.down.bwd.safetensors"))
    res = run_json(tmp_path, "--codecs", "taco", "--families", "sparse", "--tensors", str(d))
    fams = {r["family"]: r for r in res["rows"]}
    assert set(fams) == {"sparse", "layers.0.attn.out.fwd", "layers.0.mlp.down.bwd"}
    assert fams["layers.0.attn.out.fwd"]["numel"] == 64 * 128


def test_subparser_and_bad_arguments(capsys):
    assert run_bench("codec", [*TINY, "--codecs", "fp9"]) == 2
    assert "taco bench codec: unknown codec" in capsys.readouterr().err
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "codec", "--backend", "cuda-magic"])


def test_max_group_rel_err():
    x = torch.ones(2, 128)
    y = x.clone()
    y[1] *= 1.5
    assert bench.max_group_rel_err(x, y, 128) == pytest.approx(0.5)
    assert bench.max_group_rel_err(torch.zeros(128), torch.full((128,), 1e-9), 128) == float("inf")


def test_fidelity_table_bytes_ratio_and_gap_to_taco(tmp_path, capsys):
    """Issue 13: per codec label, bytes/elem, ratio vs bf16 = 2 / bytes, SQNR per family and its
    gap to taco on the same tensor; --scale-fmts repeats the group codecs per scale format."""
    res = run_json(
        tmp_path, "--codecs", "taco,int6-hadamard,fp8-tensor", "--families", "gaussian,student-t3",
        "--scale-fmts", "fp32,e8m0",
    )  # fmt: skip
    fid = {e["codec"]: e for e in res["fidelity"]}
    assert list(fid) == ["taco", "taco/e8m0", "int6-hadamard", "int6-hadamard/e8m0", "fp8-tensor"]
    assert fid["int6-hadamard"]["bytes_per_elem"] == 0.75 + 4 / 128
    assert fid["int6-hadamard/e8m0"]["bytes_per_elem"] == 0.75 + 1 / 128
    assert fid["taco/e8m0"]["bytes_per_elem"] == 1 + 2 / 128
    by = {(r["codec"], r["family"]): r["sqnr_db"] for r in res["rows"]}
    for name, e in fid.items():
        assert e["ratio_vs_bf16"] == 2 / e["bytes_per_elem"]
        for fam in ("gaussian", "student-t3"):
            assert e["sqnr_db"][fam] == by[(name, fam)]
            assert e["gap_to_taco_db"][fam] == by[(name, fam)] - by[("taco", fam)]
    assert fid["taco"]["gap_to_taco_db"] == {"gaussian": 0.0, "student-t3": 0.0}
    assert "gap to taco" in capsys.readouterr().out


def test_a_codec_whose_name_fixes_its_group_keeps_it(tmp_path):
    """`--group-size` and the scale format are the sweep's common settings; int4-hadamard-g32's name
    fixes both (groups of 32, bf16 scales: NVFP4's 0.5625 B/elem), so the sweep leaves them."""
    res = run_json(tmp_path, "--codecs", "int4-hadamard-g32,int4-hadamard", "--families", "gaussian",
                   "--group-size", "128", "--backend", "eager")  # fmt: skip
    bpe = {r["codec"]: r["bytes_per_elem"] for r in res["rows"]}
    assert bpe == {"int4-hadamard-g32": 0.5 + 2 / 32, "int4-hadamard": 0.5 + 4 / 128}
