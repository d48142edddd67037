"""The run configuration: what a run is, validated before anything runs.

Modules: `schema` (the sections: every field with its type, bounds, default and description),
`axes` (the mesh axes, their default rules, the `mesh` section, and `resolve`, the one resolver
from logical axis names to mesh axes), `rules` (the checks between fields), `loader` (the root
`Config`, YAML with `base_config` and `a.b=c` overrides, one line per problem) and `explain`
(`kiln config --explain`).

May import: `kiln.errors`, `kiln.util`, `kiln.data` (`load_config` fills `model.vocab_size: auto`
and the shards' tokenizer from the data). Imports no JAX.

Public names: `Config`, `load_config`, `read_run_config`, `config_from_dict`, `yaml_layers`,
`schema_rows`, `check_devices`, the section classes (`ModelConfig`, `DataConfig`, ...),
`MESH_AXES`, `MeshAxis`, `FAMILY_SECTIONS` and `ATTENTION_KERNELS` (the registries of
`model.family` and `model.attention`), `DEFAULT_AXIS_RULES`, `INT32_MAX`, `MAX_EXPERTS`,
`SEED_LIMIT`, `DEFAULT_MAX_KD_SCALE`, `pipeline_split` (a step's accumulation and pipeline
micro-batches).
"""

from kiln.config.axes import DEFAULT_AXIS_RULES, MESH_AXES, MeshAxis, MeshConfig
from kiln.config.loader import (
    Config,
    check_devices,
    config_from_dict,
    load_config,
    read_run_config,
    schema_rows,
    yaml_layers,
)
from kiln.config.rules import pipeline_split
from kiln.config.schema import (
    ATTENTION_KERNELS,
    DEFAULT_MAX_KD_SCALE,
    FAMILY_SECTIONS,
    INT32_MAX,
    MAX_EXPERTS,
    SEED_LIMIT,
    CheckpointConfig,
    DataConfig,
    DeepseekConfig,
    DistillationConfig,
    DistributedConfig,
    LoggingConfig,
    LossConfig,
    ModelConfig,
    MoeConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
)

__all__ = [
    "ATTENTION_KERNELS",
    "DEFAULT_AXIS_RULES",
    "DEFAULT_MAX_KD_SCALE",
    "FAMILY_SECTIONS",
    "INT32_MAX",
    "MAX_EXPERTS",
    "MESH_AXES",
    "SEED_LIMIT",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DeepseekConfig",
    "DistillationConfig",
    "DistributedConfig",
    "LoggingConfig",
    "LossConfig",
    "MeshAxis",
    "MeshConfig",
    "ModelConfig",
    "MoeConfig",
    "OptimConfig",
    "PipelineConfig",
    "TrainConfig",
    "check_devices",
    "config_from_dict",
    "load_config",
    "pipeline_split",
    "read_run_config",
    "schema_rows",
    "yaml_layers",
]
