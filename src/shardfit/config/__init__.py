"""One typed config tree: dataclasses, TOML files and `--section.key=value` overrides map onto it."""

from shardfit.config.loader import accumulation_steps, config_to_dict, config_to_toml, load_config
from shardfit.config.options import parse_overrides
from shardfit.config.schema import (
    CheckpointConfig,
    ComputeConfig,
    Config,
    DataConfig,
    LoggingConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
)

__all__ = [
    "accumulation_steps",
    "CheckpointConfig",
    "ComputeConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "MemoryConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "parse_overrides",
]
