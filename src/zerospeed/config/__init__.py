"""DeepSpeed's JSON config as typed pydantic sections, with precise errors."""

from .batch import BatchSizes, resolve_batch
from .errors import ConfigError, NotSupportedYetError, did_you_mean
from .root import ZeroSpeedConfig, load_config

__all__ = ["BatchSizes", "ConfigError", "NotSupportedYetError", "ZeroSpeedConfig", "did_you_mean",
           "load_config", "resolve_batch"]
