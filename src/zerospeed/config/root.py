"""The whole DeepSpeed config, validated once; each component gets its own section."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

import math

from pydantic import Field, PrivateAttr, field_validator

from .base import Section, known_keys
from .compression import GradientCompressionConfig
from .compression_training import (
    CompressionTrainingConfig,
    EigenvalueConfig,
    QuantizeTrainingConfig,
    WeightQuantizationConfig,
)
from .data_types import DataTypesConfig
from .data_efficiency import DataEfficiencyConfig, LegacyCurriculumConfig, ProgressiveLayerDropConfig
from .allreduce_rules import refuse_sum_combinations
from .autotuning import AutotuningConfig
from .batch import BatchSizes, resolve_batch
from .checkpoint import CheckpointConfig, DataStatesConfig, NebulaConfig
from .compile import CompileConfig
from .expert_parallel import ExpertParallelConfig
from .hybrid_engine import HybridEngineConfig
from .elasticity import ElasticityConfig, ElasticityConfigError
from .errors import ConfigError, UnknownKeyError
from .hjson_file import no_duplicate_keys, read_hjson
from .fp8 import Fp8Config
from .offload import AioConfig
from .monitoring import (
    ActivationCheckpointingConfig,
    CometConfig,
    CommsLoggerConfig,
    CsvMonitorConfig,
    FlopsProfilerConfig,
    LogLevel,
    TensorBoardConfig,
    TimersConfig,
    WandbConfig,
)
from .optimizer import OptimizerConfig, SchedulerConfig
from .pipeline import PipelineConfig
from .precision import Bf16Config, Fp16Config, TorchAutocastConfig, check_master_weights
from .sparse_attention import SparseAttentionConfig
from .tensor_parallel import TensorParallelConfig
from .unsupported import NOT_SUPPORTED_YET, check_not_supported
from .zero import ZeroConfig

_log = logging.getLogger("zerospeed.config")

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class ZerospeedOptions(Section):
    """zerospeed only: how the config itself is read. DeepSpeed ignores unknown top-level keys, so a config
    carrying this section still runs under DeepSpeed."""

    unknown_keys: Literal["error", "warn"] = "error"
    """``error``: an unknown key is a ConfigError with a did-you-mean. ``warn``: each unknown key is dropped
    with one logged warning (for real configs carrying keys DeepSpeed ignores, e.g. ``cuda_visible_devices``)."""


class ZeroSpeedConfig(Section):
    """A DeepSpeed ``ds_config.json``. Batch sizes are resolved against the data-parallel size."""

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = Field(1.0, ge=0)
    """DeepSpeed 0.19.8's default is 1.0 (it was 0.0, off, before 0.19.3); 0 switches clipping off."""
    fp16: Fp16Config = Field(default_factory=Fp16Config)
    bf16: Bf16Config = Field(default_factory=Bf16Config)
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    steps_per_print: int | None = Field(None, ge=1)
    """DeepSpeed's default None prints no progress line."""
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    dump_state: bool = False
    vocabulary_size: int | None = Field(None, ge=1)
    """DeepSpeed's hint: a start-up warning when it is not a multiple of 8 (tensor-core alignment)."""
    prescale_gradients: bool = False
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """DeepSpeed's: average the data-parallel gradients (``mean``) or sum them (``sum``: no pre/post scaling)."""
    managed_gradient_accumulation: bool = True
    """DeepSpeed's: ``false`` lets the caller own the accumulation boundary: every backward accumulates, every
    ``step()`` reduces what is held and applies the update (runtime/torch_backward.py)."""
    sparse_gradients: bool = False
    """DeepSpeed's: at stage 0 the gradients of ``nn.Embedding`` / ``nn.EmbeddingBag`` weights travel as their
    nonzero rows (row indices and rows all-gathered) instead of a dense all-reduce; no effect with ZeRO (as DeepSpeed)."""
    gradient_predivide_factor: float = Field(1.0, gt=0)
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    seq_parallel_communication_data_type: Literal["fp32", "fp16", "bf16"] = "fp32"
    """DeepSpeed: with sequence_parallel_size > 1 the gradients are reduced in this dtype (it replaces
    communication_data_type there)."""
    disable_allgather: bool = False
    """Parsed by DeepSpeed 0.19.8 and read nowhere (every stage still all-gathers what its math needs): true is
    accepted with a warning saying so."""
    graph_harvesting: bool = False
    """DeepSpeed's CUDA-graph capture of the bf16 optimizer's norm and gradient copy (runtime/graphs.py)."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    timers: TimersConfig = Field(default_factory=TimersConfig)
    log_level: LogLevel | None = None
    """The ``zerospeed`` logger's level (and its handlers'), set when the engine is built; case-insensitive."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    dataloader_drop_last: bool = False
    seed: int | None = None
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    nebula: NebulaConfig = Field(default_factory=NebulaConfig)
    datastates_ckpt: DataStatesConfig | None = None

    @field_validator("datastates_ckpt", mode="before")
    @classmethod
    def _datastates_on(cls, v: object) -> object:
        """DeepSpeed: the section is on whenever it is present and not ``false``."""
        return None if v is False else {} if v is True else v
    aio: AioConfig = Field(default_factory=AioConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    sequence_parallel_size: int = Field(1, ge=1)
    """Ulysses sequence parallelism: ranks per sequence group (1 = off). The world splits into
    world/sequence_parallel_size data-parallel replicas; batch sizes count those replicas."""
    data_parallel_size: int | None = Field(None, ge=1)
    """With ``sequence_parallel_size``: the data axis of DeepSpeed's (data, sequence) mesh; data x sequence
    must be the world size (``runtime/deepspeed_rules.py``). Alone it has no effect, as in DeepSpeed."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """AutoTP training (``zerospeed.tp_model_init``): degree, layer rules, presets."""
    use_data_before_expert_parallelism: bool = False
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)
    """AutoEP: expert parallelism for Hugging Face MoE blocks (config/expert_parallel.py)."""
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    """DeepSpeed-Chat's hybrid engine: ``engine.generate()`` rollout phases (config/hybrid_engine.py)."""
    """MoE groups: ``true`` puts expert-data-parallel peers adjacent ("D + E") instead of expert peers."""
    comms_timeout_s: float | None = Field(None, gt=0)
    """zerospeed only: seconds a collective may wait for its peers before the rank fails naming the rank,
    the collective and the group (torch's default, 30 minutes, when unset)."""
    zero_local_grad_accumulation: bool = False
    """zerospeed only (top level: DeepSpeed refuses unknown keys inside ``zero_optimization``). ZeRO stage 2 with
    gradient accumulation: ``true`` accumulates the micro-steps' gradients in a full-size local buffer (4Ψ bytes
    more per rank in fp32, made on the first micro-step that does not end an accumulation) and reduce-scatters
    once per boundary, 2Ψ on the wire per step as DDP with ``no_sync``; ``false`` (DeepSpeed's way) keeps no
    full-size gradient and reduce-scatters every micro-step, (gas+1)Ψ. No effect at other stages (0-1 always
    accumulate locally; stage 3 warns) or when gradients bypass device memory (offload on an accelerator, NVMe)."""
    zerospeed: ZerospeedOptions = Field(default_factory=ZerospeedOptions)
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    """DeepSpeed's autotuner section: ``zerospeed autotune`` plans experiments from it; the engine profiles them."""
    gradient_compression: GradientCompressionConfig = Field(default_factory=GradientCompressionConfig)
    """zerospeed only: top-k sparsified gradient averaging with error feedback (config/compression.py)."""
    compression_training: CompressionTrainingConfig = Field(default_factory=CompressionTrainingConfig)
    """DeepSpeed 0.19.6's compression library: the engine steps its scheduler (zerospeed/compression/)."""
    quantize_training: QuantizeTrainingConfig = Field(default_factory=QuantizeTrainingConfig)
    """MoQ over every 2-D weight, with its ``eigenvalue`` subsection (config/compression_training.py)."""
    eigenvalue: EigenvalueConfig = Field(default_factory=EigenvalueConfig)
    """The eigenvalue section at the top level: the same as ``quantize_training.eigenvalue``."""
    weight_quantization: WeightQuantizationConfig | None = None
    """Post-training weight quantization at load (``post_init_quant``), into the inference engine's INT8/INT4 linears."""
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    """When enabled, the batch sizes come from ``zerospeed.elasticity`` for the data-parallel size."""
    fp8: Fp8Config = Field(default_factory=Fp8Config)
    """zerospeed only: FP8 matmuls in the linear layers (config/fp8.py), and an FP8 weight all-gather under ZeRO-3."""
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    """Curriculum data sampling and random-LTD (``zerospeed/data_pipeline/``)."""
    curriculum_learning: LegacyCurriculumConfig = Field(default_factory=LegacyCurriculumConfig)
    """DeepSpeed's legacy sequence-length curriculum: ``curriculum_seqlen=`` into the model's forward."""
    progressive_layer_drop: ProgressiveLayerDropConfig = Field(default_factory=ProgressiveLayerDropConfig)
    """``progressive_layer_drop=True, pld_theta=...`` into the model's forward."""
    compile: CompileConfig = Field(default_factory=CompileConfig)
    """``engine.compile()``: torch.compile of the model; DeepCompile's keys are refused (config/compile.py)."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """DeepSpeed's dtype overrides of the module cast: buffers keep theirs unless ``buffer_dtype`` is set."""
    sparse_attention: SparseAttentionConfig | None = None
    """Block-sparse attention layout (DeepSpeed's section; None when absent): the model builds its
    ``SparsityConfig`` from ``engine.config.sparse_attention.sparsity_config(num_heads)``."""

    @field_validator(*_BATCH_KEYS, mode="before")
    @classmethod
    def _auto_batch(cls, v: Any) -> Any:
        return None if v == "auto" else v

    @field_validator("gradient_clipping", mode="before")
    @classmethod
    def _auto_clip(cls, v: Any) -> Any:
        if v == "auto":
            raise ValueError("'auto' cannot be derived here; set a number (0 disables clipping)")
        return v

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _op_case(cls, v: Any) -> Any:
        v = v.lower() if isinstance(v, str) else v  # DeepSpeed reads it case-insensitively
        if v not in ("mean", "sum"):  # DeepSpeed's wording, which its users and tests match on
            raise ValueError(f"Invalid gradient_allreduce_op. Supported operations: ['mean', 'sum']. Got: {v!r}")
        return v

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _print_never(cls, v: Any) -> Any:
        """Accelerate and the HF Trainer write ``float("inf")`` (JSON ``Infinity``): never print, as DeepSpeed."""
        return None if isinstance(v, float) and math.isinf(v) and v > 0 else v

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_lower(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v

    @field_validator("disable_allgather")
    @classmethod
    def _disable_allgather_has_no_effect(cls, v: bool) -> bool:
        if v:
            _log.warning("disable_allgather: true has no effect: DeepSpeed 0.19.8 parses it and reads it nowhere (every "
                         "ZeRO stage still all-gathers what its math needs); zerospeed does the same")
        return v

    @field_validator("communication_data_type", "seq_parallel_communication_data_type", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        aliases = {"float32": "fp32", "fp32": "fp32", "float16": "fp16", "half": "fp16", "fp16": "fp16",
                   "bfloat16": "bf16", "bf16": "bf16"}
        return aliases.get(str(v).lower(), v) if v is not None else None

    # --- DeepSpeed's ``engine.config`` is the user's dict: read access as a mapping ------------------
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        """``engine.config["zero_optimization"]``: the value as the user wrote it, else the validated
        section (with its defaults) as a plain dict."""
        if key in self._raw:
            return self._raw[key]
        if key in type(self).model_fields:
            value = getattr(self, key)
            return value.model_dump() if hasattr(value, "model_dump") else value
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def keys(self) -> list[str]:
        return list(self._raw)

    def items(self) -> list[tuple[str, Any]]:
        return list(self._raw.items())

    def to_dict(self) -> dict[str, Any]:
        """A copy of the config as the user wrote it (after dotted keys were expanded)."""
        import copy

        return copy.deepcopy(self._raw)

    # --- resolved views -------------------------------------------------------------------------
    def batch(self, dp_world_size: int) -> BatchSizes:
        if self.elasticity.enabled:  # DeepSpeed: the elastic batch for this size replaces the batch keys
            from ..elasticity.elasticity import elastic_batch

            total, _, micro = elastic_batch(self.elasticity, world_size=dp_world_size)  # type: ignore[misc]
            return resolve_batch(total, micro, total // (micro * dp_world_size), dp_world_size)
        return resolve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                             self.gradient_accumulation_steps, dp_world_size)

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage


def _read(config: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    path = Path(config)
    if not path.exists():
        raise ConfigError("", f"config file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text(), object_pairs_hook=no_duplicate_keys)
    except json.JSONDecodeError as exc:
        data = read_hjson(path, exc)  # DeepSpeed reads config files as HJSON
    if not isinstance(data, dict):
        raise ConfigError("", f"config file {str(path)!r} must hold a JSON object")
    return data


def _parse(raw: dict[str, Any]) -> ZeroSpeedConfig:
    """Validate; with ``zerospeed.unknown_keys: warn`` drop each unknown key with one logged warning."""
    options = ZerospeedOptions.parse_section(raw.get("zerospeed"), "zerospeed")
    refuse_sum_combinations(raw)  # before the sections' own checks, as DeepSpeed (config/allreduce_rules.py)
    while True:
        try:
            return ZeroSpeedConfig.parse_section(raw, "")
        except UnknownKeyError as exc:
            if options.unknown_keys != "warn":
                raise
            try:
                _drop(raw, exc.loc)
            except (KeyError, TypeError):
                raise exc from None  # a location we cannot address: keep the error
            _log.warning("config key '%s' is unknown to zerospeed and was dropped (zerospeed.unknown_keys: warn)%s",
                         exc.key, exc.hint)


def _expand_dotted(raw: dict[str, Any]) -> dict[str, Any]:
    """``{"zero_optimization.stage": 3}`` (as some frameworks write keys) means ``{"zero_optimization":
    {"stage": 3}}``. DeepSpeed ignores such keys without a word; zerospeed applies them, and refuses one that
    contradicts the nested value."""
    out = {k: v for k, v in raw.items() if "." not in k}
    for key in [k for k in raw if "." in k]:
        *parents, leaf = key.split(".")
        node = out
        for i, part in enumerate(parents):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(key, f"'{'.'.join(parents[:i + 1])}' is {child!r}, not a section")
            node[part] = child = dict(child)
            node = child
        if leaf in node and node[leaf] != raw[key]:
            raise ConfigError(key, f"the dotted key sets {raw[key]!r} but '{key}' is also given nested as "
                                   f"{node[leaf]!r}; keep one")
        node[leaf] = raw[key]
    return out


def _drop(raw: dict[str, Any], loc: tuple[str, ...]) -> None:
    """Remove ``loc`` from ``raw`` (copying the dicts on the way, so the caller's config stays intact)."""
    node = raw
    for part in loc[:-1]:
        node[part] = dict(node[part])
        node = node[part]
    del node[loc[-1]]


def _check_elastic_batch_keys(cfg: ZeroSpeedConfig, section: dict[str, Any]) -> None:
    """DeepSpeed's rule: elasticity owns the batch sizes; explicit batch keys are an error unless
    ``ignore_non_elastic_batch_info`` (then they are ignored, with a warning). The scheduler check too."""
    from ..elasticity.elasticity import ensure_immutable_elastic_config

    ensure_immutable_elastic_config(section)
    given = [k for k in _BATCH_KEYS if k in cfg.model_fields_set]
    if given and not cfg.elasticity.ignore_non_elastic_batch_info:
        raise ElasticityConfigError(
            f"{', '.join(given)} set beside an enabled elasticity section, which takes control of the batch sizes "
            "(they would not be used). Remove them, or set elasticity.ignore_non_elastic_batch_info: true to have "
            "them ignored.", "elasticity")
    for k in given:
        _log.warning("[Elasticity] ignoring %s=%r: the elastic batch sizes replace it", k, getattr(cfg, k))


def load_config(config: str | Path | dict[str, Any] | ZeroSpeedConfig | None,
                dp_world_size: int | None = None) -> ZeroSpeedConfig:
    """Validate a JSON path, dict or config object. With ``dp_world_size`` the batch triple is checked."""
    if config is None:
        raise ConfigError("", "no config given: pass config=<path or dict> (or args.deepspeed_config)")
    if isinstance(config, ZeroSpeedConfig):
        cfg = config
    else:
        raw = _expand_dotted(_read(config))
        if "bfloat16" in raw and "bf16" not in raw:
            raw["bf16"] = raw.pop("bfloat16")
        written = dict(raw)
        raw = check_not_supported(raw)
        try:
            cfg = _parse(raw)
        except ConfigError as exc:
            if exc.key.split(".")[0] != "elasticity" or isinstance(exc, ElasticityConfigError):
                raise
            raise ElasticityConfigError(str(exc).split(": ", 1)[-1], exc.key) from None
        if cfg.elasticity.enabled:
            _check_elastic_batch_keys(cfg, raw["elasticity"])
        cfg._raw = written
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError("fp16.enabled", "fp16 and bf16 cannot both be enabled")
    if cfg.fp16.auto_cast and not cfg.fp16.enabled:
        raise ConfigError("fp16.auto_cast", "casts the forward's inputs to fp16, but fp16.enabled is false (the "
                                            "model is not fp16): set fp16.enabled true or remove auto_cast")
    check_master_weights(cfg.fp16, cfg.bf16, cfg.data_types.grad_accum_dtype)
    if dp_world_size is not None:
        cfg.batch(dp_world_size)
    return cfg


ALL_TOP_LEVEL_KEYS = known_keys(ZeroSpeedConfig) | {k.split(".")[0] for k in NOT_SUPPORTED_YET}
