"""DeepSpeed's autotuner on zerospeed: ``zerospeed autotune`` (or ``zerospeed launch --autotuning tune|run``)."""

from .runner import Autotuner, Result
from .space import DEFAULT_TUNING_SPACE, canonical_name, expand
from .tuner import TUNERS, GridSearchTuner, ModelBasedTuner, RandomTuner

__all__ = ["DEFAULT_TUNING_SPACE", "TUNERS", "Autotuner", "GridSearchTuner", "ModelBasedTuner", "RandomTuner",
           "Result", "canonical_name", "expand"]
