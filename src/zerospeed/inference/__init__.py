"""Inference: ``init_inference`` (DeepSpeed's engine), KV-cache decoding, weight quantization, serving."""

from .config import DeepSpeedInferenceConfig
from .engine import InferenceEngine, init_inference

__all__ = ["DeepSpeedInferenceConfig", "InferenceEngine", "init_inference"]
