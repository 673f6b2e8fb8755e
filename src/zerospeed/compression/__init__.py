"""DeepSpeed 0.19.6's compression library, written again: quantization-aware training (fixed bits or MoQ's
falling bits), activation quantization, sparse / row / head / channel pruning and layer reduction, configured by
the ``compression_training`` section (``config/compression_training.py``).

``init_compression`` swaps the layers (``apply.py``, ``replace.py``, ``layers.py``), the engine's
``CompressionScheduler`` switches the techniques on by step, ``redundancy_clean`` makes the result permanent
and smaller (``shrink.py``). DeepSpeed's import paths (``deepspeed.compression.compress`` & co.) are served
from ``zerospeed/_aliases.py``.
"""

from .apply import init_compression, redundancy_clean
from .replace import convert_conv1d_to_linear
from .scheduler import compression_scheduler

__all__ = ["compression_scheduler", "convert_conv1d_to_linear", "init_compression", "redundancy_clean"]
