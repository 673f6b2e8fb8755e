"""DeepSpeed's 1-bit optimizers (removed from DeepSpeed in 0.19.7), on zerospeed's compressed all-reduce.

Also importable as ``zerospeed.runtime.fp16.onebit`` (DeepSpeed's path; see ``zerospeed/_aliases.py``).
"""

from .adam import OnebitAdam
from .base import CompressedOptimizer
from .lamb import OnebitLamb
from .zoadam import ZeroOneAdam

__all__ = ["CompressedOptimizer", "OnebitAdam", "OnebitLamb", "ZeroOneAdam"]
