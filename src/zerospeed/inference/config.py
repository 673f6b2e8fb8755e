"""DeepSpeed's inference config (``deepspeed.init_inference``) as a typed pydantic section.

Same keys, aliases and defaults as DeepSpeed 0.19's ``DeepSpeedInferenceConfig``. The keys select what
zerospeed does; a key naming a feature zerospeed has not built yet is accepted only at its default, and
``unsupported_settings`` lists the ones set otherwise so the engine can refuse them by name.
"""

from __future__ import annotations

import json
import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, PositiveInt, field_validator, model_validator

from zerospeed.config.base import Section, translate_validation_error
from zerospeed.config.errors import NotSupportedYetError

__all__ = ["DeepSpeedInferenceConfig", "QuantizationConfig", "RaggedInferenceEngineConfig", "StateManagerConfig",
           "load_inference_config", "parse_dtype"]

_DTYPES: dict[torch.dtype, tuple[str, ...]] = {
    torch.float16: ("torch.float16", "fp16", "float16", "half"),
    torch.float32: ("torch.float32", "fp32", "float32", "float"),
    torch.bfloat16: ("torch.bfloat16", "bf16", "bfloat16", "bfloat"),
    torch.int8: ("torch.int8", "int8"),
}


def parse_dtype(value: Any) -> torch.dtype:
    """A torch dtype, or one of DeepSpeed's names for it ("fp16", "half", "bf16", "float", "int8", ...)."""
    if isinstance(value, torch.dtype):
        if value not in _DTYPES:
            raise ValueError(f"dtype {value} is not one of {sorted(str(d) for d in _DTYPES)}")
        return value
    if isinstance(value, str):
        for dtype, names in _DTYPES.items():
            if value in names:
                return dtype
        names = [n for ns in _DTYPES.values() for n in ns]
        raise ValueError(f"'{value}' is not a valid dtype; use one of {names}")
    raise ValueError(f"dtype must be a torch.dtype or a string, got {type(value).__name__}")


class TensorParallelConfig(Section):
    """``tensor_parallel`` (alias ``tp``): ``tp_size`` ranks share each matrix; ``tp_group`` / ``mpu``: the group."""

    enabled: bool = True
    tp_size: PositiveInt = 1
    tp_grain_size: PositiveInt = 64
    mpu: Any = None
    tp_group: Any = None


class MoEConfig(Section):
    enabled: bool = True
    ep_size: PositiveInt = 1
    moe_experts: list[int] = Field(default_factory=lambda: [1], alias="num_experts")
    type: str = "standard"
    ep_mp_group: Any = None
    ep_group: Any = Field(None, alias="expert_group")


class QuantTypeEnum(str, Enum):
    asym = "asymmetric"
    sym = "symmetric"


class BaseQuantConfig(Section):
    enabled: bool = True
    num_bits: int = 8
    q_type: QuantTypeEnum = QuantTypeEnum.sym
    q_groups: PositiveInt = 1


class WeightQuantConfig(BaseQuantConfig):
    """``quant.weight``: ``num_bits`` 8 or 4; ``q_groups`` groups per output row (1 = per channel).

    ``kernel`` (zerospeed's key): ``dequant`` (default) rebuilds the float weight in each forward;
    ``int`` calls PyTorch's weight-only int kernels (``_weight_int8pack_mm``: INT8 symmetric per channel;
    ``_weight_int4pack_mm_for_cpu``: INT4 asymmetric, 32-256 columns per group, CPU only).
    """

    quantized_initialization: dict[str, Any] = Field(default_factory=dict)
    post_init_quant: dict[str, Any] = Field(default_factory=dict)
    kernel: Literal["dequant", "int"] = "dequant"

    @field_validator("num_bits")
    @classmethod
    def _bits(cls, value: int) -> int:
        if value not in (4, 8):
            raise ValueError(f"num_bits must be 4 or 8, got {value}")
        return value


class ActivationQuantConfig(BaseQuantConfig):
    pass


class QKVQuantConfig(Section):
    enabled: bool = True


class QuantizationConfig(Section):
    """``quant``: weight-only quantization of every linear layer when enabled (see docs/inference.md)."""

    enabled: bool = True
    activation: ActivationQuantConfig = Field(default_factory=ActivationQuantConfig)
    weight: WeightQuantConfig = Field(default_factory=WeightQuantConfig)
    qkv: QKVQuantConfig = Field(default_factory=QKVQuantConfig)


class CheckpointConfig(Section):
    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None


class MemoryConfig(Section):
    """FastGen's ``memory_config``: ``mode: allocate`` takes ``size`` KV blocks (``reserve`` is not built yet)."""

    mode: str = "reserve"
    size: PositiveInt = 1_000_000_000


class StateManagerConfig(Section):
    """DeepSpeed-FastGen's ``state_manager`` limits for the serving engine (plus the KV block size)."""

    max_tracked_sequences: PositiveInt = 2048
    max_ragged_batch_size: PositiveInt = 768
    max_ragged_sequence_count: PositiveInt = 512
    max_context: PositiveInt = 8192
    memory_config: MemoryConfig = Field(default_factory=MemoryConfig)
    offload: bool = False
    kv_block_size: PositiveInt = 64  # zerospeed's key: FastGen fixes the block size per model

    @model_validator(mode="after")
    def _limits(self) -> StateManagerConfig:
        if self.max_ragged_sequence_count > self.max_tracked_sequences:
            raise ValueError("max_ragged_sequence_count must be <= max_tracked_sequences")
        if self.max_ragged_sequence_count > self.max_ragged_batch_size:
            raise ValueError("max_ragged_sequence_count must be <= max_ragged_batch_size")
        if self.memory_config.mode not in ("allocate", "reserve"):
            raise ValueError(f"memory_config.mode must be 'allocate' or 'reserve', got {self.memory_config.mode!r}")
        return self


class FastGenQuantizationConfig(Section):
    """FastGen's ``quantization``: only ``quantization_mode: None`` (FP6 'wf6af16' is a CUDA kernel)."""

    quantization_mode: str | None = None


class RaggedInferenceEngineConfig(Section):
    """DeepSpeed-FastGen's engine config: ``tensor_parallel``, ``state_manager`` (alias ``manager``), ``quantization``."""

    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig, alias="tp")
    state_manager: StateManagerConfig = Field(default_factory=StateManagerConfig, alias="manager")
    quantization: FastGenQuantizationConfig = Field(default_factory=FastGenQuantizationConfig)

    def check_supported(self) -> None:
        """Raise ``NotSupportedYetError`` for a setting zerospeed's serving engine does not do yet."""
        sm = self.state_manager
        bad = [(k, v) for k, v, on in [
            ("state_manager.offload", True, sm.offload),
            ("state_manager.memory_config.mode", "reserve", sm.memory_config.mode == "reserve"),
            ("quantization.quantization_mode", self.quantization.quantization_mode,
             self.quantization.quantization_mode is not None)] if on]
        if bad:
            key, value = bad[0]
            hint = " (use memory_config {mode: 'allocate', size: <KV blocks>})" if key.endswith("mode") else ""
            raise NotSupportedYetError(key, f"{key}={value!r}: not supported yet by zerospeed{hint}")


class DeepSpeedInferenceConfig(Section):
    """The ``init_inference`` config: DeepSpeed's keys and defaults (``dtype`` defaults to fp16 as there)."""

    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject")
    dtype: Any = torch.float16
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig, alias="tp")
    enable_cuda_graph: bool = False
    use_triton: bool = False
    triton_autotune: bool = False
    zero: dict[str, Any] = Field(default_factory=dict)
    triangular_masking: bool = Field(True, alias="tm")
    moe: bool | MoEConfig = Field(default_factory=MoEConfig)
    keep_module_on_host: bool = False
    quant: QuantizationConfig = Field(default_factory=QuantizationConfig)
    checkpoint: str | dict[str, Any] | None = None
    base_dir: str = ""
    set_empty_params: bool = False
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: CheckpointConfig = Field(default_factory=CheckpointConfig, alias="ckpt_config")
    return_tuple: bool = True
    training_mp_size: PositiveInt = 1
    replace_method: str = "auto"
    injection_policy: dict[Any, Any] | None = Field(None, alias="injection_dict")
    injection_policy_tuple: tuple[Any, ...] | None = None
    config: dict[str, Any] | None = Field(None, alias="args")
    max_out_tokens: int = Field(1024, alias="max_tokens", gt=0)
    min_out_tokens: int = Field(1, alias="min_tokens")
    transposed_mode: bool = False
    mp_size: PositiveInt = 1
    mpu: Any = None
    ep_size: PositiveInt = 1
    ep_group: Any = Field(None, alias="expert_group")
    ep_mp_group: Any = Field(None, alias="expert_mp_group")
    moe_experts: list[int] = Field(default_factory=lambda: [1])
    moe_type: str = "standard"

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> torch.dtype:
        return parse_dtype(value)

    @model_validator(mode="after")
    def _mp_size(self) -> DeepSpeedInferenceConfig:
        if self.mp_size > 1 and self.tensor_parallel.tp_size > 1 and self.mp_size != self.tensor_parallel.tp_size:
            raise ValueError(f"mp_size={self.mp_size} (deprecated) and tensor_parallel.tp_size="
                             f"{self.tensor_parallel.tp_size} disagree; set tensor_parallel.tp_size only")
        return self

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size: ``tensor_parallel.tp_size``, or DeepSpeed's deprecated ``mp_size``."""
        return self.tensor_parallel.tp_size if self.tensor_parallel.tp_size > 1 else self.mp_size

    @property
    def weight_quantization(self) -> WeightQuantConfig | None:
        """The weight-quantization settings in force, or None: on for ``dtype=int8`` or an explicit ``quant``."""
        explicit = "quant" in self.model_fields_set and self.quant.enabled and self.quant.weight.enabled
        return self.quant.weight if explicit or self.dtype is torch.int8 else None

    def unsupported_settings(self) -> list[str]:
        """Keys set to something zerospeed does not do yet, each as 'key=value'."""
        out = []
        checks: list[tuple[str, Any, bool]] = [
            ("training_mp_size", self.training_mp_size, self.training_mp_size > 1),
            ("enable_cuda_graph", True, self.enable_cuda_graph),
            ("use_triton", True, self.use_triton),
            ("triton_autotune", True, self.triton_autotune),
            ("zero", self.zero, bool(self.zero)),
            ("triangular_masking", False, not self.triangular_masking),
            ("checkpoint", self.checkpoint, self.checkpoint is not None),
            ("base_dir", self.base_dir, bool(self.base_dir)),
            ("save_mp_checkpoint_path", self.save_mp_checkpoint_path, self.save_mp_checkpoint_path is not None),
            ("checkpoint_config", self.checkpoint_config, "checkpoint_config" in self.model_fields_set),
            ("set_empty_params", True, self.set_empty_params),
            ("keep_module_on_host", True, self.keep_module_on_host),
            ("injection_policy", self.injection_policy, self.injection_policy is not None),
            ("injection_policy_tuple", self.injection_policy_tuple, self.injection_policy_tuple is not None),
            ("transposed_mode", True, self.transposed_mode),
            ("ep_size", self.ep_size, self.ep_size > 1),
            ("moe", self.moe, "moe" in self.model_fields_set and bool(self.moe)
             and (not isinstance(self.moe, MoEConfig) or self.moe.enabled)),
        ]
        for key, value, bad in checks:
            if bad:
                out.append(f"{key}={value!r}")
        if "quant" in self.model_fields_set and self.quant.enabled:
            act = self.quant.activation
            if "activation" in self.quant.model_fields_set and act.enabled:
                out.append("quant.activation.enabled=True (activation quantization)")
            for key in ("quantized_initialization", "post_init_quant"):
                if getattr(self.quant.weight, key):
                    out.append(f"quant.weight.{key}")
        return out

    def check_supported(self) -> None:
        """Raise ``NotSupportedYetError`` naming every key set to a feature not built yet; warn on no-ops.

        ``replace_with_kernel_inject=True`` means fused kernels: the engine ``torch.compile``s its regions."""
        bad = self.unsupported_settings()
        if bad:
            raise NotSupportedYetError(bad[0].split("=")[0], f"{', '.join(bad)}: not supported yet by zerospeed")
        if "replace_method" in self.model_fields_set:
            warnings.warn("replace_method is deprecated in DeepSpeed and ignored", stacklevel=3)


def load_inference_config(config: str | Path | dict[str, Any] | None, kwargs: dict[str, Any]) -> DeepSpeedInferenceConfig:
    """DeepSpeed's merge: a JSON path or dict, updated by kwargs; a key given both ways with two values is an error."""
    if config is None:
        data: dict[str, Any] = {}
    elif isinstance(config, (str, Path)):
        data = json.loads(Path(config).read_text())
    elif isinstance(config, dict):
        data = dict(config)
    else:
        raise ValueError(f"'config' argument expected a path or a dict, got {type(config).__name__}")
    for key in set(data) & set(kwargs):
        if data[key] != kwargs[key]:
            raise ValueError(f"Conflicting argument '{key}' in 'config': {data[key]!r} and kwargs: {kwargs[key]!r}")
    data.update(kwargs)
    try:
        return DeepSpeedInferenceConfig.model_validate(data)
    except Exception as exc:  # pydantic's ValidationError, translated to name the key
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            raise translate_validation_error(exc, DeepSpeedInferenceConfig, "") from None
        raise


