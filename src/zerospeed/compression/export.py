"""A quantization-aware-trained model to the inference engine's INT8/INT4 weights, with the training's own scales.

Each compression-aware linear whose weight quantization is on becomes an ``inference.quantization.
QuantizedLinear`` holding the integer levels and scales (and zero points) that the training's forward used,
so ``init_inference`` serves exactly what was trained, with no new calibration: weights of 5 to 8 bits are
stored as INT8, 3 and 4 bits as INT4 (two per byte). DeepSpeed's groups cut the flattened weight; they map to
the engine's per-row groups when a group is whole rows (one scale per row, repeated) or a row holds a whole
number of groups. Embeddings and other layers keep floating weights; a quantized embedding is stored with its
quantized values. Use ``init_inference(model, dtype=torch.float32)`` (or the training dtype): ``dtype=int8``
would quantize the remaining linears with the engine's own post-training formula.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config.errors import NotSupportedYetError
from ..inference.quantization import QuantizedLinear
from .layers import Embedding_Compress, LinearLayer_Compress
from .quantizers import QuantSpec, codes_and_scales
from .weight_quant import WeightQuant


def _per_row(t: torch.Tensor, out: int, inp: int, name: str) -> torch.Tensor:
    """DeepSpeed's per-group values ``[G, 1]`` (groups over the flattened ``[out, in]``) as ``[out, groups/row]``."""
    groups = t.shape[0]
    if out % groups == 0:
        return t.reshape(groups, 1).repeat_interleave(out // groups, dim=0)
    if groups % out == 0 and inp % (groups // out) == 0:
        return t.reshape(out, groups // out)
    raise NotSupportedYetError("compression_training.weight_quantization.shared_parameters.quantize_groups",
                               f"exporting '{name}': {groups} groups over a [{out}, {inp}] weight neither hold whole "
                               "rows nor divide them: not supported yet by zerospeed")


def exported_linear(layer: LinearLayer_Compress, name: str = "") -> QuantizedLinear:
    """``layer``'s quantized weight as a ``QuantizedLinear`` (same levels, scales and zero points)."""
    wq: WeightQuant = layer.weight_quant  # type: ignore[assignment]
    bits = wq.target_bits if wq.in_forward else wq.bits
    if bits < 3 or bits > 8:
        raise NotSupportedYetError("compression_training.weight_quantization", f"exporting '{name}' at {bits} bits "
                                   "(INT8 holds 5-8 bits, INT4 3-4; ternary and binary weights are not supported yet)")
    if not wq.in_forward and wq.mixed and wq.ratio > 0:
        raise ValueError(f"'{name}': MoQ's fp16 mixing ratio is still {wq.ratio:.3f} (the forward is not fully "
                         "quantized yet); train until it reaches 0 before exporting")
    out, inp = layer.weight.shape
    spec = QuantSpec(bits, wq.symmetric, wq.groups)  # nearest rounding: the stored levels are deterministic
    with torch.no_grad():
        levels, scale, zero = codes_and_scales(layer.weight.detach().float(), spec)
    return QuantizedLinear.from_levels(levels.reshape(out, inp), _per_row(scale, out, inp, name),
                                       None if zero is None else _per_row(zero, out, inp, name),
                                       8 if bits > 4 else 4, layer.bias)


def export_quantized(model: nn.Module) -> list[str]:
    """Swap each weight-quantized compression-aware linear of ``model`` for its ``QuantizedLinear``; returns their
    names. Quantized embeddings store their quantized values."""
    done = []
    for name, module in list(model.named_modules()):
        active = getattr(module, "weight_quant", None) is not None and (
            module.weight_quant.in_forward or module.weight_quant.started)
        if not active:
            continue
        if isinstance(module, LinearLayer_Compress):
            parent_name, _, child = name.rpartition(".")
            model.get_submodule(parent_name).register_module(child, exported_linear(module, name))
            done.append(name)
        elif isinstance(module, Embedding_Compress):
            module.fix_weight_quantization()
    return done


__all__ = ["export_quantized", "exported_linear"]
