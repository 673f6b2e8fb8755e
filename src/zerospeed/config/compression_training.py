"""``compression_training``: DeepSpeed 0.19.6's compression library section (removed from DeepSpeed in 0.19.7).

Each technique has ``shared_parameters`` (on/off, method, ``schedule_offset``: the optimizer step from which
the technique is switched on) and ``different_groups``: named groups, each with its ``params`` (bits, dense
ratio), ``modules`` (regular expressions searched in the module names; ``"*"`` matches every compressible
module) and, for row/head/channel pruning, ``related_modules`` (one list of patterns per ``modules`` pattern:
the layers whose input columns follow the pruned rows, so ``redundancy_clean`` shrinks both). A module may
belong to one group per technique. ``layer_reduction`` keeps ``teacher_layer``'s layers of the teacher as the
student's first layers. The code lives in ``zerospeed/compression/``.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .base import Section

_log = logging.getLogger("zerospeed.config")


class _Group(Section):
    modules: list[str] = Field(default_factory=lambda: ["*"])
    related_modules: list[list[str]] | None = None

    @model_validator(mode="after")
    def _related(self) -> _Group:
        if self.related_modules is not None and len(self.related_modules) != len(self.modules):
            raise ValueError(f"related_modules has {len(self.related_modules)} lists for {len(self.modules)} modules "
                             "patterns: give one list of related patterns per modules pattern")
        return self


class _Shared(Section):
    """What every technique's ``shared_parameters`` holds: on/off and the optimizer step it starts at."""

    enabled: bool = False
    schedule_offset: int = Field(1000, ge=0)


# --- weight quantization ---------------------------------------------------------------------------------
class WeightQuantParams(Section):
    start_bits: int = Field(ge=1, le=16)
    target_bits: int = Field(ge=1, le=8)
    quantization_period: int = Field(1, ge=1)
    """MoQ: steps at ``start_bits`` before the first one-bit drop; the period doubles at each drop."""

    @model_validator(mode="after")
    def _bits(self) -> WeightQuantParams:
        if self.start_bits < self.target_bits:
            raise ValueError(f"start_bits {self.start_bits} is below target_bits {self.target_bits}")
        return self


class WeightQuantGroup(_Group):
    params: WeightQuantParams


class Fp16MixedQuantize(Section):
    enabled: bool = False
    quantize_change_ratio: float = Field(0.001, ge=0, le=1)
    """MoQ: the forward uses ``r w + (1 - r) Q(w)``; ``r`` starts at 1 and falls by this much each step."""


class WeightQuantShared(_Shared):
    quantizer_kernel: bool = False
    """DeepSpeed's CUDA quantizer kernel: the same formula, computed here by PyTorch on every device (an accepted
    hint: config/hints.py)."""
    schedule_offset: int = Field(0, ge=0)
    quantize_groups: int = Field(1, ge=1)
    """Scales per weight: the flattened weight is cut into this many equal groups."""
    quantize_verbose: bool = False
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    quantize_weight_in_forward: bool = False
    """``true``: the forward fake-quantizes the weight at ``target_bits`` (straight-through gradient).
    ``false`` (MoQ): bits fall from ``start_bits`` to ``target_bits`` over the periods (``quantize_training``)."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    fp16_mixed_quantize: Fp16MixedQuantize = Field(default_factory=Fp16MixedQuantize)


class WeightQuantization(Section):
    shared_parameters: WeightQuantShared = Field(default_factory=WeightQuantShared)
    different_groups: dict[str, WeightQuantGroup] = Field(default_factory=dict)


# --- activation quantization -----------------------------------------------------------------------------
class ActQuantParams(Section):
    bits: Literal[4, 8]


class ActQuantGroup(_Group):
    params: ActQuantParams


class ActQuantShared(_Shared):
    quantization_type: Literal["symmetric", "asymmetric"] = "symmetric"
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    """``dynamic``: each token's own range. ``static``: one range, a running min/max (momentum 0.95) in training,
    over every data-parallel replica's micro-batch."""


class ActivationQuantization(Section):
    shared_parameters: ActQuantShared = Field(default_factory=ActQuantShared)
    different_groups: dict[str, ActQuantGroup] = Field(default_factory=dict)


# --- pruning -----------------------------------------------------------------------------------------------
class DenseRatioParams(Section):
    dense_ratio: float = Field(gt=0, le=1)
    """The fraction kept: weights (sparse), rows (row), heads (head) or output channels (channel)."""


class PruneGroup(_Group):
    params: DenseRatioParams


class SparseShared(_Shared):
    method: Literal["l1", "topk", "snip_momentum"] = "l1"
    """``l1``: the mask keeps the largest ``|w|`` at switch-on, fixed. ``topk``: learned scores (a parameter) pick
    the kept weights at every forward. ``snip_momentum`` needs Intel Neural Compressor: not supported yet."""
    schedule_offset_end: int | None = Field(None, ge=0)
    schedule_offset_stride: int = Field(1, ge=1)
    block_pattern: str = "4x1"
    dense_ratio: float = Field(0.1, gt=0, lt=1)
    excluded_modules: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _snip_only(self) -> SparseShared:
        """``block_pattern``, ``dense_ratio``, ``excluded_modules``, ``schedule_offset_end`` and
        ``schedule_offset_stride`` belong to ``snip_momentum`` (refused: compression/apply.py); with ``l1`` or
        ``topk`` DeepSpeed ignores them, so a warning names them."""
        snip = {"block_pattern": self.block_pattern, "dense_ratio": self.dense_ratio,
                "excluded_modules": self.excluded_modules, "schedule_offset_end": self.schedule_offset_end,
                "schedule_offset_stride": self.schedule_offset_stride}
        unused = sorted(set(snip) & self.model_fields_set)
        if self.method != "snip_momentum" and unused:
            _log.warning("compression_training.sparse_pruning.shared_parameters: %s only apply to method "
                         "snip_momentum; ignored with %r (as in DeepSpeed)", unused, self.method)
        return self


class RowShared(_Shared):
    """Row pruning's (and channel pruning's) shared parameters."""

    method: Literal["l1", "topk"] = "l1"


class HeadShared(_Shared):
    method: Literal["topk"] = "topk"
    """DeepSpeed 0.19.6's layers prune heads by learned top-k scores only."""
    num_heads: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _heads(self) -> HeadShared:
        if self.enabled and self.num_heads is None:
            raise ValueError("num_heads must be specified for head pruning")
        return self


class _Pruning(Section):
    """A pruning technique: its ``shared_parameters`` (each subclass's own) and its groups' dense ratios."""

    different_groups: dict[str, PruneGroup] = Field(default_factory=dict)


class SparsePruning(_Pruning):
    shared_parameters: SparseShared = Field(default_factory=SparseShared)


class RowPruning(_Pruning):
    shared_parameters: RowShared = Field(default_factory=RowShared)


class HeadPruning(_Pruning):
    shared_parameters: HeadShared = Field(default_factory=HeadShared)


class ChannelPruning(_Pruning):
    shared_parameters: RowShared = Field(default_factory=RowShared)


# --- layer reduction ------------------------------------------------------------------------------------------
class LayerReduction(Section):
    enabled: bool = False
    keep_number_layer: int | None = Field(None, ge=1)
    module_name_prefix: str = ""
    """The layer list's path, e.g. ``transformer.h`` (GPT-2) or ``bert.encoder.layer``."""
    teacher_layer: list[int] = Field(default_factory=list)
    """Student layer ``i`` starts as teacher layer ``teacher_layer[i]``."""
    other_module_name: list[str] = Field(default_factory=list)
    """Modules copied from the teacher as they are (embeddings, final norm, head)."""

    @model_validator(mode="after")
    def _layers(self) -> LayerReduction:
        if self.enabled and (not self.module_name_prefix or not self.teacher_layer):
            raise ValueError("layer reduction needs module_name_prefix and teacher_layer")
        if self.enabled and self.keep_number_layer is not None and self.keep_number_layer != len(self.teacher_layer):
            raise ValueError(f"keep_number_layer {self.keep_number_layer} differs from the "
                             f"{len(self.teacher_layer)} teacher_layer entries")
        return self


TECHNIQUES = ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning", "head_pruning",
              "channel_pruning")


class CompressionTrainingConfig(Section):
    """DeepSpeed 0.19.6's ``compression_training`` section (module docstring)."""

    weight_quantization: WeightQuantization = Field(default_factory=WeightQuantization)
    activation_quantization: ActivationQuantization = Field(default_factory=ActivationQuantization)
    sparse_pruning: SparsePruning = Field(default_factory=SparsePruning)
    row_pruning: RowPruning = Field(default_factory=RowPruning)
    head_pruning: HeadPruning = Field(default_factory=HeadPruning)
    channel_pruning: ChannelPruning = Field(default_factory=ChannelPruning)
    layer_reduction: LayerReduction = Field(default_factory=LayerReduction)

    @model_validator(mode="after")
    def _groups(self) -> CompressionTrainingConfig:
        for name in TECHNIQUES:
            tech = getattr(self, name)
            if tech.shared_parameters.enabled and not tech.different_groups:
                raise ValueError(f"{name} is enabled: different_groups must be specified")
        return self

    def technique(self, name: str) -> Section:
        return getattr(self, name)  # type: ignore[no-any-return]

    @property
    def any_enabled(self) -> bool:
        return self.layer_reduction.enabled or any(self.technique(n).shared_parameters.enabled  # type: ignore[attr-defined]
                                                   for n in TECHNIQUES)


# --- MoQ (legacy ``quantize_training``) and the eigenvalue section ---------------------------------------------
class EigenvalueConfig(Section):
    """Power iteration on the Hessian-vector product per layer block (``layer_name``'s first ``layer_num``
    entries); MoQ lengthens a block's next period by ``1 + floor(4 * eigenvalue / max eigenvalue)``."""

    enabled: bool = False
    verbose: bool = False
    max_iter: int = Field(100, ge=1)
    tol: float = Field(1e-2, gt=0)
    stability: float = Field(1e-6, ge=0)
    gas_boundary_resolution: int = Field(1, ge=1)
    """Compute the eigenvalues every this many accumulation boundaries."""
    layer_name: str = "bert.encoder.layer"
    layer_num: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _layers(self) -> EigenvalueConfig:
        if self.enabled and self.layer_num < 1:
            raise ValueError("eigenvalue needs layer_num >= 1 (the number of blocks under layer_name)")
        return self


class QuantizeBits(Section):
    start_bits: int = Field(16, ge=1, le=16)
    target_bits: int = Field(8, ge=1, le=8)


class QuantizeSchedule(Section):
    quantize_period: int = Field(1000, ge=1)
    schedule_offset: int = Field(1000, ge=0)


class QuantizeAlgo(Section):
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    rounding: Literal["nearest", "stochastic"] = "nearest"


class QuantizeTrainingConfig(Section):
    """MoQ's own section (DeepSpeed's MoQ tutorial): every 2-D weight (linear, embedding, convolution) is
    quantized from ``start_bits`` down to ``target_bits``, one bit per period, the period doubling each time.
    Runs as ``compression_training.weight_quantization`` with ``quantize_weight_in_forward: false`` on all
    layers (``compression/moq.py``)."""

    enabled: bool = False
    quantize_verbose: bool = False
    quantizer_kernel: bool = False
    """DeepSpeed's CUDA quantizer kernel: the same formula, computed here by PyTorch on every device (an accepted
    hint: config/hints.py)."""
    quantize_type: Literal["symmetric", "asymmetric"] | None = None
    quantize_algo: QuantizeAlgo = Field(default_factory=QuantizeAlgo, alias="quantize-algo")
    quantize_bits: QuantizeBits = Field(default_factory=QuantizeBits)
    quantize_schedule: QuantizeSchedule = Field(default_factory=QuantizeSchedule)
    quantize_groups: int = Field(1, ge=1)
    fp16_mixed_quantize: Fp16MixedQuantize = Field(default_factory=Fp16MixedQuantize)
    eigenvalue: EigenvalueConfig = Field(default_factory=EigenvalueConfig)

    def as_weight_quantization(self) -> WeightQuantization:
        """The same MoQ as a ``compression_training.weight_quantization`` section over every layer."""
        shared = WeightQuantShared(enabled=self.enabled, schedule_offset=self.quantize_schedule.schedule_offset,
                                   quantize_groups=self.quantize_groups, quantize_verbose=self.quantize_verbose,
                                   quantization_type=self.quantize_type or self.quantize_algo.q_type,
                                   rounding=self.quantize_algo.rounding, fp16_mixed_quantize=self.fp16_mixed_quantize)
        params = WeightQuantParams(start_bits=self.quantize_bits.start_bits, target_bits=self.quantize_bits.target_bits,
                                   quantization_period=self.quantize_schedule.quantize_period)
        return WeightQuantization(shared_parameters=shared,
                                  different_groups={"quantize_training": WeightQuantGroup(params=params)})


# --- weight_quantization: post-training weight quantization at load ---------------------------------------------
class GroupWiseQuant(Section):
    """One ``post_init_quant`` entry: asymmetric ``num_bits`` codes in groups of ``group_size`` along ``group_dim``
    (1: the input columns of each row, the only layout the inference engine's quantized linears hold)."""

    num_bits: Literal[4, 8] | None = None
    group_size: int | None = Field(None, ge=1)
    """None: the section's ``q_groups`` groups per row."""
    group_dim: int = 1
    symmetric: bool | None = None

    @field_validator("group_dim")
    @classmethod
    def _dim(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"group_dim {value}: only 1 (groups of input columns) is supported yet by zerospeed")
        return value


class QuantizedInitialization(Section):
    """``weight_quantization.quantized_initialization``: under ``zero.Init``, every ``nn.Linear`` and ``nn.Embedding``
    weight is kept as ``num_bits`` codes in groups of ``group_size`` elements along ``group_dim`` from the moment it
    is built (``zero/stage3/quantized_shard.py``); without ``zero.Init``, ``initialize`` quantizes them into the
    inference engine's quantized layers (``compression/ptq.py``). DeepSpeed 0.19.6 requires every key and
    asymmetric quantization; here only ``group_size`` is required."""

    num_bits: Literal[4, 8] = 8
    group_size: int = Field(ge=1)
    group_dim: int = 1
    symmetric: bool = False

    @field_validator("symmetric")
    @classmethod
    def _asymmetric(cls, value: bool) -> bool:
        if value:
            raise ValueError("only asymmetric quantization (symmetric: false) is supported, as in DeepSpeed 0.19.6")
        return value


class WeightQuantizationConfig(Section):
    """DeepSpeed's top-level ``weight_quantization``: ``post_init_quant`` maps a module-name substring to its
    quantization; ``initialize`` swaps each matched linear for the inference engine's ``QuantizedLinear`` before
    placing the model (``compression/ptq.py``). ``num_bits`` and ``q_type`` are the entries' defaults."""

    enabled: bool = True
    num_bits: Literal[4, 8] = 8
    q_type: Literal["symmetric", "asymmetric"] = "asymmetric"
    q_groups: int = Field(1, ge=1)
    """Groups per row for an entry without ``group_size``."""
    post_init_quant: dict[str, GroupWiseQuant] = Field(default_factory=dict)
    quantized_initialization: QuantizedInitialization | None = None
    """Weights quantized as they are made (``{}``, DeepSpeed's default: off)."""

    @field_validator("quantized_initialization", mode="before")
    @classmethod
    def _empty_is_off(cls, value: Any) -> Any:
        return None if value == {} else value

    def initialization_spec(self) -> Any:
        """The ``quantized_initialization`` groups in force (a ``GroupSpec``), or None (off, or the section
        disabled)."""
        from ..inference.group_quant import GroupSpec

        q = self.quantized_initialization
        return GroupSpec(q.num_bits, q.group_size, q.group_dim) if self.enabled and q is not None else None
