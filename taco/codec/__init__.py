"""Pure tensor math for compressing TP intermediate tensors: formats, Hadamard, codecs, calibration.

No torch.distributed here (docs/design.md 2): collectives in `taco.comm` move the buffers these make.
"""

from .backend import KernelBackend
from .base import Codec, Packed
from .calibrate import CalibrationChoice, calibrate
from .codecs import (
    FP8GroupCodec,
    FP8TensorCodec,
    Int4HadamardCodec,
    Int8GroupCodec,
    Int8HadamardCodec,
    NoneCodec,
    Taco1sCodec,
    TacoCodec,
    sqnr_db,
)
from .formats import FP8_FORMATS, fp8_format
from .hadamard import GROUP_SIZES, hadamard_matrix
from .registry import CODECS, accepted_options, codec_options, get_codec, list_codecs
from .specs import CodecSpec, Ladder, build_codec, parse_ladder, parse_spec

__all__ = [
    "CODECS",
    "FP8_FORMATS",
    "GROUP_SIZES",
    "CalibrationChoice",
    "Codec",
    "CodecSpec",
    "FP8GroupCodec",
    "FP8TensorCodec",
    "Int4HadamardCodec",
    "Int8GroupCodec",
    "Int8HadamardCodec",
    "KernelBackend",
    "Ladder",
    "NoneCodec",
    "Packed",
    "Taco1sCodec",
    "TacoCodec",
    "accepted_options",
    "build_codec",
    "calibrate",
    "codec_options",
    "fp8_format",
    "get_codec",
    "hadamard_matrix",
    "list_codecs",
    "parse_ladder",
    "parse_spec",
    "sqnr_db",
]
