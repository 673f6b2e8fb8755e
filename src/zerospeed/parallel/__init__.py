"""Parallelisms beyond data parallelism: one folder each, over one shared process topology."""

from .topology import (PipeDataParallelTopology, PipelineParallelGrid, PipeModelDataParallelTopology,
                       ProcessCoord, ProcessTopology)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessCoord",
           "ProcessTopology"]
