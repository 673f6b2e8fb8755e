"""The ``tensor_parallel`` section: AutoTP training (DeepSpeed 0.19.8's ``TPTrainingConfig`` keys and defaults).

``autotp_size`` (0: off) is the tensor-parallel degree; ``tp.tp_size`` is DeepSpeed's older spelling of the
same number (both may be given; they must agree). ``partition_config`` holds user layer rules (first match
wins) and ``preset_model`` a built-in rule set; see ``parallel/tensor/autotp_config.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Section


class TPSection(Section):
    """``tensor_parallel.tp``: DeepSpeed's ``TPConfig``."""

    tp_size: int = Field(1, ge=1)
    tp_grain_size: int = Field(1, ge=1)
    """Shard sizes are multiples of this (the remainder goes to the last rank), as DeepSpeed's parser."""
    mpu: Any = None
    tp_group: Any = None


class TensorParallelConfig(Section):
    autotp_size: int = Field(0, ge=0)
    """Tensor-parallel degree for AutoTP training; 0 (default) is off."""
    dtype: Literal["fp32", "fp16", "bf16"] | None = None
    """Model dtype for ``tp_model_init`` (DeepSpeed's default fp16 applies only when it is called without one)."""
    tp_overlap_comm: bool = False
    """Overlap the input-gradient all-reduce of column layers with the weight-gradient matmul."""
    sequence_parallel: bool = False
    """zerospeed only (Megatron's sequence parallelism): inside the repeated blocks the residual stream and
    norms hold ``seq/tp`` tokens; all-gather before column layers and reduce-scatter after row layers."""
    vocab_parallel_lm_head: bool | None = None
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    tp: TPSection = Field(default_factory=TPSection)
    injection_policy_tuple: Any = None
    partition_config: dict[str, Any] | None = None
    """``{use_default_specs, layer_specs: [{patterns, partition_type, shape, partition_dim, gather_output,
    model_types, grad_allreduce}], strict_mode, lm_head_patterns, embedding_partition_dim}``."""
    preset_model: str | None = None
    """llama, qwen2, mistral, mixtral, bloom, chatglm, deepseek_v2, phi3."""
    keep_module_on_host: bool = False
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        names = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}
        if v is None or isinstance(v, str):
            return names.get(str(v).lower(), v) if v is not None else None
        return {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}.get(str(v), v)

    @model_validator(mode="after")
    def _agree(self) -> "TensorParallelConfig":
        if self.autotp_size > 1 and self.tp.tp_size > 1 and self.autotp_size != self.tp.tp_size:
            raise ValueError(f"autotp_size ({self.autotp_size}) and tp.tp_size ({self.tp.tp_size}) disagree")
        if self.replace_with_kernel_inject:
            raise ValueError("kernel_inject (inference kernels) is not supported yet by zerospeed in training")
        if self.injection_policy_tuple is not None:
            raise ValueError("injection_policy_tuple is not supported yet by zerospeed: use partition_config.layer_specs")
        if self.keep_module_on_host:
            raise ValueError("keep_module_on_host: true is not supported yet by zerospeed (AutoTP training splits the "
                             "model where it is)")
        if self.vocab_parallel_ce_backend != "torch":
            raise ValueError("vocab_parallel_ce_backend 'liger' is not supported yet by zerospeed; use 'torch'")
        return self

    @property
    def size(self) -> int:
        """The tensor-parallel degree (1: off)."""
        return max(self.autotp_size, self.tp.tp_size, 1)
