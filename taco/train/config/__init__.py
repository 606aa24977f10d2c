"""Run configuration: one validated dataclass per TOML section, plus `--section.key=value` overrides.

Why this package exists: every knob of a training run (model size, the (dp, pp, tp) mesh, which
codec compresses which collective, optimiser, data) lives in one place, is checked once with an
error that names the field and the fix, and is written back into the run directory
(`config_to_toml`) so that a run can be reproduced or resumed from its own folder. The layout
follows Megatron-core and torchtitan: a dataclass per section, enums parsed in `__post_init__`.

    cfg = load_config("configs/demo.toml", ["--parallel.tp=4", "--train.steps", "50"])
    cfg.parallel.tp            # 4
    config_to_toml(cfg)        # the resolved config, commented, loadable again

Files: `schema.py` (the [model], [train] and [data] sections and their `_Section` base, each
field's doc in its `metadata`), `parallel.py` ([parallel]), `compression.py` ([compression]),
`choices.py` (the enums), `run.py`
(`Config`: the sections checked against each other, built from a nested dict), `coerce.py` (TOML
and command-line values to field types), `loading.py` (file + overrides -> `Config`),
`writing.py` (`Config` -> commented TOML, `--help` text). Model sizes and presets come from
`taco.models.presets`, the mesh format from `taco.parallel.ParallelDims`; the codec names are
checked apart (`check_codecs`) so that nothing here needs the codec registry.

Parsing library: none; the ~150-line coercer of `coerce.py` stays. tyro (torchtitan's choice)
would add a dependency, reads field docs from source code too (the failure this package just
removed), and its CLI syntax is not the `--section.key=value` contract of `taco train` (nor the
key-by-key overrides of an inline table); pydantic, cattrs and omegaconf are outside the allowed
dependencies, and the types here are a handful (scalars, str enums, optionals, lists, tables).
"""

from taco.models.presets import PRESETS
from taco.train.config.choices import Backend, CommDtype, DatasetKind, Device, Dtype, ModelKind, PPSchedule
from taco.train.config.compression import CompressionConfig
from taco.train.config.loading import check_codecs, load_config, parse_overrides
from taco.train.config.parallel import ParallelConfig
from taco.train.config.run import Config
from taco.train.config.schema import DataConfig, ModelConfig, TrainConfig, default_cache_dir, field_docs
from taco.train.config.writing import config_help, config_reference, config_to_toml

__all__ = [
    "Backend",
    "CompressionConfig",
    "Config",
    "DataConfig",
    "DatasetKind",
    "CommDtype",
    "Device",
    "Dtype",
    "ModelConfig",
    "ModelKind",
    "PPSchedule",
    "ParallelConfig",
    "PRESETS",
    "TrainConfig",
    "check_codecs",
    "config_help",
    "config_reference",
    "config_to_toml",
    "default_cache_dir",
    "field_docs",
    "load_config",
    "parse_overrides",
]
