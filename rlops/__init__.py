"""rlops: configuration, the embedded stack supervisor and the CLI of the RL post-training MLOps backbone."""
from rlops.config import Config, ConfigError, load_config

__all__ = ["Config", "ConfigError", "load_config"]
