"""The ``hybrid_engine`` section: DeepSpeed-Chat's train-and-generate engine (DeepSpeed's ``HybridEngineConfig``).

``enabled`` turns on ``engine.generate()`` rollout phases (``runtime/hybrid_engine.py``); ``max_out_tokens``
bounds prompt + generated tokens and sizes the phase's KV cache; ``pin_parameters`` gathers the ZeRO-3 weights
once per phase (false: per module, per forward, as training does); ``release_inference_cache`` frees the cache
and the gathered weights after every ``generate()``. ``inference_tp_size`` > 1 generates tensor-parallel over
groups of that many consecutive ranks (``runtime/hybrid_tp.py``); ``enable_cuda_graph`` is not supported yet
(CUDA only); ``tp_gather_partition_size`` is a hint (DeepSpeed's layer-group gather size).
"""

from __future__ import annotations

from pydantic import Field

from .base import Section


class HybridEngineConfig(Section):
    enabled: bool = False
    max_out_tokens: int = Field(512, ge=1)
    inference_tp_size: int = Field(1, ge=1)
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: int = Field(8, ge=1)
    enable_cuda_graph: bool = False
