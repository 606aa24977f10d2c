"""Codecs inside a bf16 autocast region (the trainer's forward and backward): the same bytes as outside.

CPU autocast runs matmuls in bf16; the eager group functions (the Hadamard rotation is a matmul)
must not, or the scales come out bf16 and the wire layout breaks (issue 13: int6/int5-hadamard
training under train.dtype = "bf16").
"""

import pytest
import torch

import taco


@pytest.mark.parametrize("name", ["taco", "int8-hadamard", "int6-hadamard", "int5-hadamard", "fp8-group"])
def test_eager_codec_is_unchanged_by_autocast(name):
    codec = taco.get_codec(name, backend="eager")
    x = torch.randn(4, 1000).bfloat16()
    plain = codec.encode(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packed = codec.encode(x)
        y = codec.decode(packed)
    assert torch.equal(packed.data, plain.data)
    assert torch.equal(y, codec.decode(plain)) and y.dtype == x.dtype
