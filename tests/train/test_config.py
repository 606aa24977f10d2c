"""Config system: TOML + `--section.key=value` overrides, type conversion, validation, round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from taco import models
from taco.models.presets import SIZE_DEFAULTS
from taco.parallel.dims import ParallelDims
from taco.train.config import (
    PRESETS,
    CompressionConfig,
    Config,
    DataConfig,
    ModelConfig,
    ModelKind,
    ParallelConfig,
    PPSchedule,
    TrainConfig,
    check_codecs,
    config_help,
    config_to_toml,
    field_docs,
    load_config,
    parse_overrides,
)
from taco.train.config.coerce import coerce as _coerce

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SECTIONS = [ModelConfig, ParallelConfig, CompressionConfig, TrainConfig, DataConfig]


def write(tmp_path: Path, text: str, name: str = "exp.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_valid() -> None:
    cfg = load_config()
    assert cfg == Config(train=TrainConfig(name="run"))
    assert cfg.parallel.world_size == 1 and str(cfg.parallel) == "DP1-PP1-TP1"
    assert cfg.train.out_dir == "runs/run"
    assert cfg.compression.tp_sites == ["*"] and cfg.compression.tp_codec == "taco"


def test_override_types() -> None:
    cfg = load_config(None, [
        "--parallel.tp=2", "--train.lr=3e-4", "--train.steps", "1_000", "--parallel.sp",
        "--model.tie_embeddings=0", "--model.qk_norm=false", "--model.kind=QWEN", "--model.n_kv_head=2",
        "--compression.tp_sites=layers.*.attn.*,layers.0.mlp.*", "--train.name=x y",
        "--parallel.pp_schedule=gpipe", "--compression.tp_codec_options.group_size=64",
        "--compression.tp_codec_options.fmt=e5m2", "train.resume=true", "--model.dropout=0",
    ])
    assert cfg.parallel.tp == 2 and cfg.parallel.sp is True
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 1000
    assert cfg.model.tie_embeddings is False and cfg.model.qk_norm is False
    assert cfg.model.kind is ModelKind.QWEN and cfg.model.kind == "qwen" and f"{cfg.model.kind}" == "qwen"
    assert cfg.compression.tp_sites == ["layers.*.attn.*", "layers.0.mlp.*"]
    assert cfg.train.name == "x y" and cfg.train.out_dir == "runs/x y"
    assert cfg.parallel.pp_schedule is PPSchedule.GPIPE and str(cfg.parallel.pp_schedule) == "gpipe"
    assert cfg.compression.tp_codec_options == {"group_size": 64, "fmt": "e5m2"}
    assert cfg.train.resume is True
    assert isinstance(cfg.model.dropout, float)


def test_override_tables_and_paths(tmp_path: Path) -> None:
    path = write(tmp_path, '[compression]\ntp_codec_options = {group_size = 128, fmt = "e4m3"}\n')
    cfg = load_config(path, ["--compression.tp_codec_options.group_size=32", "--train.resume=runs/a/ckpt"])
    assert cfg.compression.tp_codec_options == {"group_size": 32, "fmt": "e4m3"}  # merged, not replaced
    assert cfg.train.resume == "runs/a/ckpt"
    cfg = load_config(path, ['--compression.tp_codec_options={group_size=256}'])
    assert cfg.compression.tp_codec_options == {"group_size": 256}
    cfg = load_config(path, ['--compression.tp_sites=["a.*", "b"]'])
    assert cfg.compression.tp_sites == ["a.*", "b"]


def test_coerce_scalar_and_optional() -> None:
    assert _coerce("7", int | None, "x") == 7
    assert _coerce("none", int | None, "x") is None
    assert _coerce(None, str | None, "x") is None
    assert _coerce("1", bool, "x") is True and _coerce("0", bool, "x") is False
    assert _coerce(2, float, "x") == 2.0 and _coerce(3.0, int, "x") == 3
    with pytest.raises(ValueError, match="x: expected int"):
        _coerce(True, int, "x")
    with pytest.raises(ValueError, match="x: expected int"):
        _coerce(2.5, int, "x")
    with pytest.raises(ValueError, match="x: expected bool"):
        _coerce("maybe", bool, "x")


def test_toml_sections_and_name(tmp_path: Path) -> None:
    path = write(tmp_path, "[model]\nblock_size = 64\n[train]\nsteps = 5\n", name="my-run.toml")
    cfg = load_config(path)
    assert cfg.model.seq_len == 64 and cfg.model.block_size == 64  # nanoGPT alias
    assert cfg.train.steps == 5
    assert cfg.train.name == "my-run" and cfg.train.out_dir == "runs/my-run"
    assert load_config(path, ["--model.seq_len=32"]).model.seq_len == 32  # override beats the alias key


@pytest.mark.parametrize("overrides, match", [
    (["--train.stpes=3"], r"unknown key train\.stpes \(did you mean train\.steps\?\).*valid keys of"),
    (["--trian.steps=3"], r"unknown section 'trian' \(did you mean train\?\)"),
    (["--steps=3"], r"must look like --section\.key=value \(did you mean --train\.steps\?\)"),
    (["--train.steps=ten"], r"train\.steps: expected int, got 'ten'"),
    (["--train.lr=fast"], r"train\.lr: expected float"),
    (["--parallel.sp=maybe"], r"parallel\.sp: expected bool"),
    (["--parallel.pp_schedule=zb"], r"parallel\.pp_schedule: got 'zb', expected one of '1f1b', 'gpipe'"),
    (["--train.steps=0"], r"train\.steps = 0: must be >= 1"),
    (["--train.min_lr=1"], r"train\.min_lr = 1\.0: must be in \[0, train\.lr"),
    (["--parallel.tp=3"], r"model\.n_head = 4 must be divisible by parallel\.tp = 3"),
    (["--parallel.dp=3"], r"train\.batch_size = 16 must be divisible by parallel\.dp \* parallel\.micro"),
    (["--model.hidden=130"], r"model\.hidden = 130: must be divisible by model\.n_head"),
    (["--model.n_kv_head=2"], r"gpt has no grouped-query attention"),
    (["--model.kind=qwen", "--model.n_kv_head=3"], r"model\.n_kv_head = 3: must divide model\.n_head"),
    (["--data.dataset=text"], r"data\.path"),
    (["--data.vocab_size=100"], r"data\.vocab_size = 100: must be >= 257"),
    (["--model.preset=gpt5"], r"unknown preset; known presets: .*gpt2"),
    (["--model.intermediate=256"], r"model\.intermediate = 256: gpt's MLP is 4 \* hidden"),
    (["--model.head_dim=64"], r"model\.head_dim = 64: gpt heads are hidden // n_head"),
    (["--model.kind=qwen", "--model.dropout=0.1"], r"model\.dropout = 0\.1: qwen has no dropout"),
    (["--compression.slices.x=1"], r"only table fields take a sub-key"),
    (["--parallel.sp", "--parallel.tp=4", "--model.seq_len=30"], r"model\.seq_len = 30 must be divisible"),
])
def test_errors_name_the_field_and_fix(overrides: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="configs/"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(write(tmp_path, "[train\nsteps = 1\n"))
    with pytest.raises(ValueError, match=r"unknown config section\(s\) \['steps'\]; valid sections: model"):
        load_config(write(tmp_path, "steps = 1\n"))
    with pytest.raises(ValueError, match=r"unknown key model\.layers.*valid keys of \[model\]: kind, preset"):
        load_config(write(tmp_path, "[model]\nlayers = 2\n"))
    with pytest.raises(ValueError, match=r"train\.steps: expected int, got 1\.5"):
        load_config(write(tmp_path, "[train]\nsteps = 1.5\n"))
    with pytest.raises(ValueError, match="given twice"):
        load_config(write(tmp_path, "[model]\nseq_len = 8\nblock_size = 8\n"))


def test_presets(tmp_path: Path) -> None:
    cfg = load_config(None, ["--model.preset=qwen3-0.6b", "--model.n_layer=2"])
    assert cfg.model.kind == "qwen" and cfg.model.n_layer == 2  # explicit key beats the preset
    assert cfg.model.head_size == 128 and cfg.model.kv_heads == 8 and cfg.model.hidden == 1024
    path = write(tmp_path, '[model]\npreset = "gpt2"\nseq_len = 256\n')
    cfg = load_config(path)
    assert (cfg.model.n_layer, cfg.model.seq_len, cfg.model.ffn_size) == (12, 256, 3072)
    with pytest.raises(ValueError, match="contradicts model.preset"):
        load_config(path, ["--model.kind=qwen"])
    assert PRESETS is models.PRESETS  # one table, in taco.models.presets
    assert set(PRESETS) >= {"gpt-demo", "gpt-small", "qwen-demo", "qwen-small", "gpt2", "qwen3-0.6b"}
    for name, preset in PRESETS.items():  # every preset is valid on its own, in the [model] vocabulary
        cfg = load_config(None, [f"--model.preset={name}"])
        assert {k: getattr(cfg.model, k) for k in preset} == preset, name
    for name in ("gpt-small", "qwen-small"):  # the shipped configs are their presets
        model = load_config(CONFIGS / f"{name}.toml").model
        assert dataclasses.replace(load_config(None, [f"--model.preset={name}"]).model, preset="") == model
    assert ModelConfig() == ModelConfig(**SIZE_DEFAULTS)  # the size defaults live with the presets


@pytest.mark.parametrize("name", ["demo", "gpt-small", "qwen-small"])
def test_shipped_configs_round_trip(tmp_path: Path, name: str) -> None:
    cfg = load_config(CONFIGS / f"{name}.toml")
    assert cfg.train.name == name and cfg.parallel.tp == 2 and cfg.compression.tp_codec == "taco"
    saved = write(tmp_path, config_to_toml(cfg), name="resolved.toml")
    again = load_config(saved)
    assert again == cfg and again.to_dict() == cfg.to_dict()


def test_round_trip_all_kinds_of_values(tmp_path: Path) -> None:
    cfg = load_config(None, [
        "--model.preset=qwen-small", "--train.resume=runs/a \"b\"\\c", "--parallel.pp=2",
        "--parallel.microbatches=4", "--compression.tp_codec_options.fmt=e5m2",
        "--compression.tp_codec_options.stochastic=true", "--compression.tp_codec_options.alpha=0.5",
        "--compression.tp_sites=a,b.*", "--train.lr=1e-05", "--train.min_lr=1e-06", "--data.cache_dir=/tmp/ü",
    ])
    text = config_to_toml(cfg)
    assert "# Number of transformer blocks." in text
    assert load_config(write(tmp_path, text)) == cfg
    assert load_config(write(tmp_path, config_to_toml(cfg, comments=False))) == cfg


def test_demo_sizes() -> None:
    demo = load_config(CONFIGS / "demo.toml")
    m = demo.model
    approx = 2048 * m.hidden + m.seq_len * m.hidden + m.n_layer * 12 * m.hidden**2
    assert 1e6 <= approx <= 3e6
    small = load_config(CONFIGS / "gpt-small.toml").model
    approx = 2048 * small.hidden + small.seq_len * small.hidden + small.n_layer * 12 * small.hidden**2
    assert 6e6 <= approx <= 10e6
    qwen = load_config(CONFIGS / "qwen-small.toml")
    assert qwen.parallel.sp and (qwen.model.n_head, qwen.model.kv_heads) == (4, 2)


def test_parallel_config_is_parallel_dims() -> None:
    p = load_config(None, ["--parallel.dp=2", "--parallel.pp=2", "--parallel.tp=2", "--parallel.sp"]).parallel
    assert p.dims() == ParallelDims(dp=2, pp=2, tp=2, sp=True)
    assert str(p) == "DP2-PP2-TP2-SP" == str(p.dims()) and p.world_size == 8
    assert str(ParallelConfig(sp=True)) == "DP1-PP1-TP1"  # SP shards nothing without TP
    with pytest.raises(ValueError, match=r"parallel\.pp = 0: must be >= 1"):
        ParallelConfig(pp=0)


def test_field_docs_come_from_metadata() -> None:
    for section in SECTIONS:
        for f in dataclasses.fields(section):
            assert field_docs(section)[f.name] == " ".join(f.metadata["doc"].split())
    assert "docs/design.md" in CompressionConfig.__doc__ and "DESIGN.md" not in config_help()


def test_every_field_is_documented() -> None:
    help_text = config_help()
    for section in SECTIONS:
        docs = field_docs(section)
        for f in dataclasses.fields(section):
            assert docs.get(f.name), f"{section.__name__}.{f.name} has no docstring"
            assert f"--{section.SECTION}.{f.name}" in help_text


def test_batch_helpers_and_codec_check() -> None:
    cfg = load_config(None, ["--parallel.dp=2", "--parallel.microbatches=4", "--train.batch_size=32"])
    assert (cfg.local_batch_size, cfg.micro_batch_size) == (16, 4)
    check_codecs(cfg, ["none", "taco", "int8-hadamard"])
    with pytest.raises(ValueError, match="compression.tp_codec = 'taco': unknown codec; available: none"):
        check_codecs(cfg, ["none"])
    with pytest.raises(ValueError, match="compression.guard_fallback = 'int8-hadamard': unknown codec"):
        check_codecs(cfg, ["none", "taco"])
    cfg = load_config(None, ["--compression.guard_fallback=taco(group_size=64)"])
    check_codecs(cfg, ["none", "taco"])


def test_parse_overrides_shapes() -> None:
    assert parse_overrides(["--train.steps", "5", "--parallel.sp"]) == {
        "train": {"steps": "5"}, "parallel": {"sp": "true"}}
    with pytest.raises(ValueError, match="unknown key"):
        parse_overrides(["--model.nope=1"])
