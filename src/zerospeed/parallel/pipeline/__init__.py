"""Pipeline parallelism: PipelineModule (layers cut into stages), pure schedules, and the engine that runs them.

DeepSpeed's ``deepspeed.pipe`` / ``deepspeed.runtime.pipe`` names are served from here (see ``_aliases.py``).
"""

from ..topology import (PipeDataParallelTopology, PipelineParallelGrid, PipeModelDataParallelTopology,
                        ProcessTopology)
from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from .partition import partition_balanced, partition_uniform

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineError",
           "PipelineModule", "PipelineParallelGrid", "ProcessTopology", "TiedLayerSpec", "partition_balanced",
           "partition_uniform"]
