"""``init_compression`` and ``redundancy_clean`` (DeepSpeed path ``deepspeed.compression.compress``).

``init_compression(model, config)``: layer reduction first (the student's layers start as the teacher's
``teacher_layer``), then every compressible layer becomes compression-aware and each enabled technique is
configured on its groups' modules; the techniques act once the scheduler reaches their ``schedule_offset``.
``redundancy_clean(model, config)`` after training: quantized weights are stored quantized and pruning is made
permanent, pruned rows / heads / channels cut out where ``related_modules`` say which layers follow them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from ..compat.compression_helper import recursive_getattr, recursive_setattr
from ..config.compression_training import (
    ActQuantParams,
    ActQuantShared,
    CompressionTrainingConfig,
    DenseRatioParams,
    LayerReduction,
    RowShared,
    SparseShared,
    WeightQuantParams,
    WeightQuantShared,
)
from ..config.errors import ConfigError, NotSupportedYetError
from ..parallel.tensor.layer import TensorParallelLayer
from . import shrink
from .groups import MatchedGroup, get_module_name, match_groups
from .replace import compression_preparation


def compression_config(config: Any) -> CompressionTrainingConfig:
    """The ``compression_training`` section of a ds_config (dict, JSON path or zerospeed config)."""
    if isinstance(config, CompressionTrainingConfig):
        return config
    if hasattr(config, "compression_training"):  # a ZeroSpeedConfig
        return config.compression_training  # type: ignore[no-any-return]
    if isinstance(config, (str, Path)):
        if not Path(config).exists():
            raise ValueError(f"Expected a string path to an existing deepspeed config, or a dictionary. "
                             f"Received: {config}")
        config = json.loads(Path(config).read_text())
    if not isinstance(config, dict):
        raise ValueError(f"Expected a deepspeed config dict or path, got {type(config).__name__}")
    cfg = CompressionTrainingConfig.parse_section(config.get("compression_training"), "compression_training")
    check_supported(cfg)
    return cfg


def check_supported(cfg: CompressionTrainingConfig) -> None:
    sp = cfg.sparse_pruning.shared_parameters
    if sp.enabled and sp.method == "snip_momentum":
        raise NotSupportedYetError("compression_training.sparse_pruning.shared_parameters.method",
                                   "snip_momentum sparse pruning (Intel Neural Compressor's pruners) is not "
                                   "supported yet by zerospeed: use 'l1' or 'topk'")


def enable(module: nn.Module, technique: str, group: MatchedGroup, name: str) -> None:
    """Configure ``group``'s ``technique`` on the compression-aware ``module`` called ``name``."""
    method = {"weight_quantization": "enable_weight_quantization", "row_pruning": "enable_row_pruning",
              "activation_quantization": "enable_activation_quantization", "sparse_pruning": "enable_sparse_pruning",
              "head_pruning": "enable_head_pruning", "channel_pruning": "enable_channel_pruning"}[technique]
    if not hasattr(module, method):
        raise ConfigError(f"compression_training.{technique}", f"module '{name}' ({type(module).__name__}) cannot "
                          f"take {technique.replace('_', ' ')}")
    if technique == "weight_quantization":
        _enable_weights(module, group.params, group.shared)
    elif technique == "activation_quantization":
        _enable_activations(module, group.params, group.shared)
    elif technique == "head_pruning":
        module.enable_head_pruning(group.params.dense_ratio, group.shared.method, group.shared.num_heads)
    else:
        _enable_pruning(getattr(module, method), group.params, group.shared)


def _enable_weights(module: Any, p: WeightQuantParams, s: WeightQuantShared) -> None:
    module.enable_weight_quantization(p.start_bits, p.target_bits, p.quantization_period, s.quantize_weight_in_forward,
                                      s.quantization_type, s.quantize_groups, s.rounding, s.fp16_mixed_quantize.enabled)


def _enable_activations(module: Any, p: ActQuantParams, s: ActQuantShared) -> None:
    module.enable_activation_quantization(p.bits, s.quantization_type, s.range_calibration)


def _enable_pruning(enable_fn: Any, p: DenseRatioParams, s: SparseShared | RowShared) -> None:
    enable_fn(p.dense_ratio, s.method)


def _root(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def init_compression(model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None,
                     mpu: Any = None) -> nn.Module:
    """Make ``model`` compression-aware as its config's ``compression_training`` says (module docstring).

    Layer reduction without a ``teacher_model`` (a zerospeed extension; DeepSpeed requires one) keeps the
    model's own ``teacher_layer`` layers in place."""
    cfg = compression_config(deepspeed_config)
    root = _root(model)
    if cfg.layer_reduction.enabled:
        if teacher_model is None:
            keep_layers(root, cfg.layer_reduction)
        else:
            student_initialization(root, _root(teacher_model), cfg)
    groups = match_groups(root, cfg)
    compression_preparation(root, [(g.modules, g.related, {g.technique: g}) for g in groups], mpu)
    return model


def keep_layers(model: nn.Module, lr: LayerReduction) -> None:
    """Replace the layer list at ``module_name_prefix`` by its ``teacher_layer`` entries, in that order."""
    layers = recursive_getattr(model, lr.module_name_prefix)
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise ConfigError("compression_training.layer_reduction.module_name_prefix",
                          f"'{lr.module_name_prefix}' is a {type(layers).__name__}, not a ModuleList")
    if max(lr.teacher_layer) >= len(layers):
        raise ConfigError("compression_training.layer_reduction.teacher_layer",
                          f"{lr.teacher_layer} names a layer beyond the model's {len(layers)}")
    recursive_setattr(model, lr.module_name_prefix, type(layers)(*[layers[i] for i in lr.teacher_layer])
                      if isinstance(layers, nn.Sequential) else nn.ModuleList(layers[i] for i in lr.teacher_layer))


def student_initialization(student_model: nn.Module, teacher_model: nn.Module, deepspeed_config: Any) -> None:
    """Student layer ``i`` takes teacher layer ``teacher_layer[i]``'s values; ``other_module_name`` copied too."""
    lr = compression_config(deepspeed_config).layer_reduction
    pairs = [(f"{lr.module_name_prefix}.{s}", f"{lr.module_name_prefix}.{t}") for s, t in enumerate(lr.teacher_layer)]
    pairs += [(name, name) for name in lr.other_module_name]
    for s_name, t_name in pairs:
        s_params = list(recursive_getattr(student_model, s_name).parameters())
        t_params = list(recursive_getattr(teacher_model, t_name).parameters())
        if [p.shape for p in s_params] != [p.shape for p in t_params]:
            raise ValueError(f"student '{s_name}' and teacher '{t_name}' have different parameter shapes")
        for s, t in zip(s_params, t_params):
            s.data.copy_(t.data)


_CLEAN_ORDER = ("weight_quantization", "sparse_pruning", "row_pruning", "head_pruning", "channel_pruning",
                "activation_quantization")


def _fix_group(root: nn.Module, group: MatchedGroup) -> None:
    reduce = bool(group.related)
    for i, names in enumerate(group.modules):
        kept = []
        for name in names:
            module = recursive_getattr(root, name)
            if reduce and isinstance(module, TensorParallelLayer) and module.tp_world_size > 1:
                raise NotSupportedYetError(f"compression_training.{group.technique}", f"redundancy_clean cutting the "
                                           f"pruned units of the tensor-parallel layer '{name}' out (related_modules) "
                                           "is not supported yet by zerospeed: drop related_modules to zero them")
            if group.technique == "weight_quantization":
                module.fix_weight_quantization()
            elif group.technique == "sparse_pruning":
                module.fix_sparse_pruning_helper()
            elif group.technique == "row_pruning":
                kept.append((shrink.fix_outputs(module, "row", reduce), None))
            elif group.technique == "head_pruning":
                head_dim = module.in_features // module.num_heads
                kept.append((shrink.fix_heads(module, reduce), head_dim))
            elif group.technique == "channel_pruning":
                kept.append((shrink.fix_outputs(module, "channel", reduce), None))
        for related_names in (group.related[i] if reduce else []):
            if len(related_names) != len(kept):
                raise ConfigError(f"compression_training.{group.technique}.different_groups.{group.name}",
                                  f"related pattern matched {len(related_names)} modules for {len(kept)} pruned ones")
            for name, (keep, head_dim) in zip(related_names, kept):
                _fix_related(recursive_getattr(root, name), group.technique, keep, head_dim)


def _fix_related(module: nn.Module, technique: str, keep: Any, head_dim: int | None) -> None:
    if technique == "row_pruning":
        shrink.fix_columns(module, keep)
    elif technique == "head_pruning":
        shrink.fix_head_rows(module, keep, head_dim or 1)
    else:
        shrink.fix_in_channels(module, keep)


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Make the compression permanent (module docstring); returns ``model``, now smaller where pruned."""
    if mpu is not None:
        raise NotSupportedYetError("compression_training", "redundancy_clean of tensor-parallel (mpu) layers is "
                                   "not supported yet by zerospeed")
    root = _root(model)
    groups = match_groups(root, compression_config(deepspeed_config))
    for group in sorted(groups, key=lambda g: _CLEAN_ORDER.index(g.technique)):
        _fix_group(root, group)
    return model


__all__ = ["get_module_name", "init_compression", "redundancy_clean", "student_initialization"]
