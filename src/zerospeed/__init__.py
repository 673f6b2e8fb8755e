"""zerospeed: DeepSpeed's training contract, rewritten small and trustworthy on PyTorch."""

from .comm import init_distributed
from .config import ConfigError, NotSupportedYetError
from .runtime import Engine, initialize

__version__ = "0.1.0"

__all__ = ["ConfigError", "Engine", "NotSupportedYetError", "__version__", "init_distributed", "initialize"]
