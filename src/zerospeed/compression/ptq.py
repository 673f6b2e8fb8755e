"""``weight_quantization.post_init_quant``: post-training weight quantization when ``initialize`` loads the model.

Each ``nn.Linear`` whose name contains one of the section's keys (at most one) becomes the inference engine's
``QuantizedLinear`` with that entry's bits and groups of ``group_size`` input columns: DeepSpeed's asymmetric
formula ``q = round((w - min) / s)``, ``s = (max - min) / (2^b - 1)``, which is the engine's. The layer then
holds INT8/INT4 codes and dequantizes in its forward (for evaluation and serving; its weight no longer trains).

``weight_quantization.quantized_initialization`` on a model not built under ``zero.Init`` (which quantizes as it
builds: ``zero/stage3/quantized_shard.py``): every ``nn.Linear`` and ``nn.Embedding`` (those types exactly, as
DeepSpeed) becomes the engine's ``QuantizedLinear`` / ``QuantizedEmbedding`` holding the same codes and scales
(``inference/group_quant.py``), so the model computes what it would have under ``zero.Init``. Its bias stays the
module's own parameter (it still trains, as under ``zero.Init``).
"""

from __future__ import annotations

from torch import nn

from ..config.compression_training import GroupWiseQuant, WeightQuantizationConfig
from ..config.errors import ConfigError, NotSupportedYetError
from ..inference.config import QuantTypeEnum, WeightQuantConfig
from ..inference.group_quant import GroupSpec, QuantizedEmbedding, quantize_groups
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


_KEY = "weight_quantization.quantized_initialization"


def _built_quantized(module: nn.Module, name: str) -> bool:
    """Whether ``zero.Init`` already keeps this weight quantized (else it must be a plain, whole tensor)."""
    from ..zero.stage3.param_store import shard_of

    shard = shard_of(module.weight)
    if shard is None:
        return False
    if shard.codec is None:
        raise ConfigError(_KEY, f"'{name}' was built under zero.Init without {_KEY}: build the model under "
                          "zero.Init with this config (or outside zero.Init)")
    return True


def initialization_quantization(model: nn.Module, spec: GroupSpec) -> list[str]:
    """Quantize ``model``'s plain ``nn.Linear`` / ``nn.Embedding`` layers in place (module docstring); returns
    their names."""
    done = []
    for name, module in list(model.named_modules()):
        if type(module) not in (nn.Linear, nn.Embedding) or _built_quantized(module, name):
            continue
        if type(module) is nn.Linear and spec.group_dim not in (1, -1):
            raise NotSupportedYetError(f"{_KEY}.group_dim", f"group_dim {spec.group_dim} on linear '{name}' without "
                                       "zero.Init: the inference engine's quantized linears group input columns "
                                       "(group_dim 1); not supported yet by zerospeed")
        try:
            if type(module) is nn.Embedding:
                layer: nn.Module = QuantizedEmbedding(module, spec)
            else:
                layer = QuantizedLinear(quantize_groups(module.weight, spec), None)
                layer.bias = module.bias
        except ValueError as exc:
            raise ConfigError(_KEY, f"'{name}': {exc}") from exc
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, layer)
        done.append(name)
    return done
