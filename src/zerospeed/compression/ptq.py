"""``weight_quantization.post_init_quant``: post-training weight quantization when ``initialize`` loads the model.

Each ``nn.Linear`` whose name contains one of the section's keys (at most one) becomes the inference engine's
``QuantizedLinear`` with that entry's bits and groups of ``group_size`` input columns: DeepSpeed's asymmetric
formula ``q = round((w - min) / s)``, ``s = (max - min) / (2^b - 1)``, which is the engine's. The layer then
holds INT8/INT4 codes and dequantizes in its forward (for evaluation and serving; its weight no longer trains).
"""

from __future__ import annotations

from torch import nn

from ..config.compression_training import GroupWiseQuant, WeightQuantizationConfig
from ..config.errors import ConfigError, NotSupportedYetError
from ..inference.config import QuantTypeEnum, WeightQuantConfig
from ..inference.quantization import QuantizedLinear


def _entry_config(entry: GroupWiseQuant, section: WeightQuantizationConfig, inp: int, key: str) -> WeightQuantConfig:
    size = entry.group_size or inp // section.q_groups
    if inp % size or (entry.group_size is None and inp % section.q_groups):
        raise ConfigError(f"weight_quantization.post_init_quant.{key}.group_size",
                          f"groups of {size} columns do not cut a matched layer's {inp} input columns")
    symmetric = entry.symmetric if entry.symmetric is not None else section.q_type == "symmetric"
    return WeightQuantConfig(num_bits=entry.num_bits or section.num_bits, q_groups=inp // size,
                             q_type=QuantTypeEnum.sym if symmetric else QuantTypeEnum.asym)


def post_init_quantization(model: nn.Module, section: WeightQuantizationConfig) -> list[str]:
    """Quantize ``model``'s matched linears in place (module docstring); returns their names."""
    if not section.enabled:
        return []
    done = []
    for name, module in list(model.named_modules()):
        keys = [k for k in section.post_init_quant if k in name]
        if not keys or not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        if len(keys) > 1:
            raise ConfigError("weight_quantization.post_init_quant", f"module '{name}' matches several keys {keys}")
        if isinstance(module, nn.Embedding):
            raise NotSupportedYetError(f"weight_quantization.post_init_quant.{keys[0]}", f"quantizing embedding "
                                       f"'{name}' is not supported yet by zerospeed (linear layers are)")
        cfg = _entry_config(section.post_init_quant[keys[0]], section, module.in_features, keys[0])
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, QuantizedLinear(module.weight, module.bias, cfg))
        done.append(name)
    return done
