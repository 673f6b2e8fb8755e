"""DeepSpeed's ``deepspeed.runtime.sequence_parallel.ulysses_sp`` names (served as
``zerospeed.runtime.sequence_parallel.ulysses_sp`` by ``zerospeed/_aliases.py``)."""

from .tiled import SequenceTiledCompute, TiledMLP, sequence_tiled_compute
from .tiled_loss import TiledFusedLogitsLoss

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute"]
