"""The config sections: every field with its type, bounds, default and description.

A constraint on one field lives on that field (bounds, `Literal`, a field validator); rules
that relate several fields are in `kiln.config`.
"""

from kiln.config.schema.base import (
    DEFAULT_MAX_KD_SCALE,
    INT32_MAX,
    SEED_LIMIT,
    Z_LOSS_MAX,
    Count,
    PositiveInt,
    Section,
    Seed,
)
from kiln.config.schema.data import PER_SOURCE, DataConfig
from kiln.config.schema.distillation import DistillationConfig
from kiln.config.schema.families import MAX_EXPERTS, DeepseekConfig, MoeConfig
from kiln.config.schema.model import ATTENTION_KERNELS, FAMILY_SECTIONS, ModelConfig
from kiln.config.schema.runtime import DistributedConfig, LoggingConfig
from kiln.config.schema.training import (
    CheckpointConfig,
    LossConfig,
    OptimConfig,
    PipelineConfig,
    TrainConfig,
)

__all__ = [
    "ATTENTION_KERNELS",
    "DEFAULT_MAX_KD_SCALE",
    "FAMILY_SECTIONS",
    "INT32_MAX",
    "MAX_EXPERTS",
    "PER_SOURCE",
    "SEED_LIMIT",
    "Z_LOSS_MAX",
    "CheckpointConfig",
    "Count",
    "DataConfig",
    "DeepseekConfig",
    "DistillationConfig",
    "DistributedConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "MoeConfig",
    "OptimConfig",
    "PipelineConfig",
    "PositiveInt",
    "Section",
    "Seed",
    "TrainConfig",
]
