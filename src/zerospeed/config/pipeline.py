"""The ``pipeline`` section (DeepSpeed's keys and defaults) for a model built as a PipelineModule.

Most pipeline choices are PipelineModule arguments (stages, partition method, seeds); the engine reads
``activation_checkpoint_interval`` (when > 0 it overrides the module's). ``pipe_partitioned`` /
``grad_partitioned`` only matter with tensor parallelism and are accepted for compatibility.
``schedule`` (zerospeed only; DeepSpeed has 1F1B alone): ``"1f1b"`` is DeepSpeed's ``TrainSchedule``;
``"eager_1f1b"`` keeps one more forward in flight per stage, which absorbs the stages' jitter
(``parallel/pipeline/eager.py``) for one more micro-batch of activations per stage.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class PipelineConfig(Section):
    stages: int | Literal["auto"] = "auto"
    partition: str = "best"
    seed_layers: bool = False
    activation_checkpoint_interval: int = Field(0, ge=0)
    pipe_partitioned: bool = True
    grad_partitioned: bool = True
    use_reentrant: bool = True
    schedule: Literal["1f1b", "eager_1f1b"] = "1f1b"
