"""Ladder specs: parsed by the one codec road (`parse_ladder`, `build_codec`, `codec_config`)."""

from __future__ import annotations

import pytest

from taco.codec import build_codec, parse_ladder
from taco.codec.specs import codec_config, split_specs

DEMO = "ladder(int4-hadamard,int5-hadamard,int6-hadamard,taco,none)"


def test_a_ladder_parses_to_its_rungs_and_starts_in_the_middle():
    lad = parse_ladder(DEMO)
    assert lad is not None
    assert lad.rungs == ("int4-hadamard", "int5-hadamard", "int6-hadamard", "taco", "none")
    assert lad.start == 2
    assert parse_ladder(lad.spec) == lad  # the printed spec parses back
    assert parse_ladder("ladder(int4-hadamard,taco(group_size=64,fmt=e5m2),start=1)").rungs[1] == (
        "taco(group_size=64,fmt=e5m2)"
    )
    assert parse_ladder("taco") is None and parse_ladder(None) is None


def test_as_one_codec_a_ladder_is_its_start_rung_with_the_options_each_rung_accepts():
    codec = build_codec(DEMO, {"group_size": 128, "fmt": "e4m3"})
    assert codec is not None and codec.spec == build_codec("int6-hadamard(group_size=128)").spec
    rungs = parse_ladder(DEMO).with_options({"group_size": 128, "fmt": "e4m3"}).rungs
    assert rungs[3] == "taco(group_size=128,fmt=e4m3)" and rungs[4] == "none"
    own = parse_ladder("ladder(int4-hadamard(group_size=32),taco)").with_options({"group_size": 128})
    assert "group_size=32" in own.rungs[0]  # a rung's own option wins over the config's
    assert build_codec("ladder(taco,none,start=1)") is None


def test_config_and_cli_lists_keep_a_ladder_whole():
    name, opts = codec_config(DEMO, {"group_size": 128})
    assert name == DEMO and opts == {"group_size": 128}
    assert split_specs(f"int6-hadamard,{DEMO}") == ["int6-hadamard", DEMO]


@pytest.mark.parametrize(
    "bad",
    ["ladder(taco)", "ladder(taco,taco)", "ladder(taco,nosuch)", "ladder(taco,none,start=2)",
     "ladder(taco,none,start=x)", "ladder(taco,none,speed=1)", "ladder(taco,none"],
)  # fmt: skip
def test_malformed_ladders_raise_value_error(bad):
    with pytest.raises(ValueError):
        parse_ladder(bad)
