"""Inference: ``init_inference`` (DeepSpeed's engine), KV-cache decoding, weight quantization, serving."""

from .config import DeepSpeedInferenceConfig, RaggedInferenceEngineConfig
from .engine import InferenceEngine, init_inference
from .sampling import SamplingParams
from .serving import QueueFullError, ServingEngine

__all__ = ["DeepSpeedInferenceConfig", "InferenceEngine", "QueueFullError", "RaggedInferenceEngineConfig",
           "SamplingParams", "ServingEngine", "init_inference"]
