"""Weight-only quantization of every linear layer: INT8 and INT4 (two per byte), per channel or per group.

Each output row of a weight ``[out, in]`` is cut into ``q_groups`` groups of ``in / q_groups`` columns; each
group gets its own scale (and, for asymmetric, its own offset = the group minimum):

* symmetric, ``b`` bits:  ``q = round(w / s)`` in ``[-(2^(b-1)-1), 2^(b-1)-1]``, ``s = max|w| / (2^(b-1)-1)``
* asymmetric, ``b`` bits: ``q = round((w - m) / s)`` in ``[0, 2^b - 1]``, ``s = (max w - m) / (2^b - 1)``, ``m = min w``

and ``w ~ q * s (+ m)``. INT8 codes are stored as ``int8``; INT4 codes as unsigned nibbles, two per ``uint8``
(even column in the low nibble). Scales are fp32 for INT8 and fp16 for INT4 (so INT4's per-group overhead is
4 bytes). ``QuantizedLinear`` keeps only the codes and scales and dequantizes to the activation dtype inside
``forward``: memory shrinks ~4x / ~8x, compute stays in floating point. With ``kernel: int`` it calls
PyTorch's own weight-only kernels instead (same bytes, same codes): ``torch._weight_int8pack_mm`` for INT8
symmetric per channel (CPU and CUDA) and ``torch._weight_int4pack_mm_for_cpu`` for INT4 asymmetric groups of
32/64/128/256 columns (its ``w = (q - 8) * s + z`` is ours with ``z = m + 8 s``); other combinations raise
``NotSupportedYetError``. Hugging Face's ``Conv1D`` (GPT-2's transposed linear) is converted the same way.

Under tensor parallelism the model is cut first and each rank quantizes its own shards ("per shard group
scales"): a column-parallel layer (``LinearLayer``, ``FusedQKVLinear``) keeps whole rows, so its codes and
scales are exactly tp=1's rows; a row-parallel layer (``LinearAllreduce``) holds ``L`` of the ``in`` columns
and uses groups of ``gcd(L, in / q_groups)`` columns — tp=1's groups when they fall inside a shard (then the
codes equal tp=1's), else each shard's piece of a group gets its own scale — and all-reduces its partial
output (``QuantizedRowParallel``) before adding the whole bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed import comm

from zerospeed.config.errors import NotSupportedYetError

from .config import QuantTypeEnum, WeightQuantConfig

_INT4_GROUP_SIZES = (32, 64, 128, 256)

__all__ = ["PackedWeight", "QuantizedLinear", "QuantizedRowParallel", "dequantize", "model_bytes", "quantize", "quantize_model"]


def _grouped(w: torch.Tensor, groups: int) -> torch.Tensor:
    out, inp = w.shape
    if inp % groups:
        raise ValueError(f"in_features {inp} is not divisible by quant.weight.q_groups={groups}")
    return w.reshape(out, groups, inp // groups)


def quantize(w: torch.Tensor, bits: int, symmetric: bool, groups: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes, scale [out, groups], offset [out, groups] or None)`` for a weight ``[out, in]``."""
    g = _grouped(w.detach().float(), groups)
    scale_dtype = torch.float32 if bits == 8 else torch.float16
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (g.abs().amax(-1, keepdim=True) / qmax).to(scale_dtype).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(g / scale).clamp(-qmax, qmax)
        offset = None
        codes = q if bits == 8 else q + 2 ** (bits - 1)  # INT4 stored unsigned: 1..15
    else:
        qmax = 2**bits - 1
        lo = g.amin(-1, keepdim=True).to(scale_dtype).float()
        scale = ((g.amax(-1, keepdim=True) - lo) / qmax).to(scale_dtype).float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round((g - lo) / scale).clamp(0, qmax)
        offset = lo.squeeze(-1).to(scale_dtype)
        if bits == 8:
            codes = codes - 128  # int8 storage of 0..255
    return _pack(codes.reshape(w.shape), bits), scale.squeeze(-1).to(scale_dtype), offset


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Stored codes ``[out, in]`` (already shifted to int8 / unsigned-nibble range): int8, or two per uint8."""
    if bits == 8:
        return codes.to(torch.int8)
    if codes.shape[1] % 2:
        raise ValueError(f"INT4 needs an even in_features, got {codes.shape[1]}")
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The ``[out, in]`` weight in ``dtype`` from ``quantize``'s output."""
    if bits == 8:
        q = codes.float() + (128.0 if offset is not None else 0.0)
    else:
        q = torch.stack((codes & 0x0F, codes >> 4), dim=-1).reshape(codes.shape[0], -1).float()
        if offset is None:
            q = q - 2 ** (bits - 1)
    out, groups = scale.shape
    g = q.reshape(out, groups, -1) * scale.float()[..., None]
    if offset is not None:
        g = g + offset.float()[..., None]
    return g.reshape(out, -1).to(dtype)


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out, in]`` as ``QuantizedLinear`` holds it: stored codes, per-group scales (and offsets for
    asymmetric), bits, and the kernel that reads them."""

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    bits: int
    out_features: int
    in_features: int
    kernel: str = "dequant"

    @classmethod
    def quantized(cls, weight: torch.Tensor, cfg: WeightQuantConfig) -> PackedWeight:
        """``weight`` quantized as ``cfg`` says (module docstring)."""
        if cfg.kernel == "int":
            _check_int_kernel(cfg, weight.shape, weight.device)
        codes, scale, offset = quantize(weight, cfg.num_bits, cfg.q_type is QuantTypeEnum.sym, cfg.q_groups)
        if cfg.kernel == "int" and cfg.num_bits == 4:
            codes = _int4pack(codes)
        return cls(codes, scale, offset, cfg.num_bits, weight.shape[0], weight.shape[1], cfg.kernel)

    @classmethod
    def from_levels(cls, levels: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                    bits: int) -> PackedWeight:
        """Codes and scales computed elsewhere (a quantization-aware-trained layer's): ``w = levels * scale
        (+ offset)`` per group of a row, ``levels`` integers in the ``bits`` range (signed when ``offset`` is
        None, else ``0 .. 2^bits - 1``); scales kept in fp32."""
        shift = (-128 if offset is not None else 0) if bits == 8 else (0 if offset is not None else 2 ** (bits - 1))
        return cls(_pack(levels + shift, bits), scale.float().contiguous(),
                   None if offset is None else offset.float().contiguous(), bits, *levels.shape)


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held as INT8/INT4 codes plus per-group scales (see module docstring).

    ``QuantizedLinear(weight, bias, cfg)`` quantizes ``weight``; ``QuantizedLinear(packed, bias)`` holds a
    ``PackedWeight`` made elsewhere (``from_levels``); both go through this one constructor."""

    def __init__(self, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None,
                 cfg: WeightQuantConfig | None = None) -> None:
        super().__init__()
        if not isinstance(weight, PackedWeight):
            if cfg is None:
                raise ValueError("QuantizedLinear(weight, bias, cfg): a float weight needs its WeightQuantConfig")
            weight = PackedWeight.quantized(weight, cfg)
        self.bits, self.kernel = weight.bits, weight.kernel
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("offset", weight.offset)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_levels(cls, levels: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
                    bias: torch.Tensor | None) -> QuantizedLinear:
        """A layer holding ``PackedWeight.from_levels(levels, scale, offset, bits)``."""
        return cls(PackedWeight.from_levels(levels, scale, offset, bits), bias)

    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset) if t is not None)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kernel == "int":  # the kernel's own layout: read the weight back through it
            return self._int_matmul(torch.eye(self.in_features, dtype=dtype, device=self.codes.device)).t()
        return dequantize(self.codes, self.scale, self.offset, self.bits, dtype)

    def _int_matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return torch._weight_int8pack_mm(x2d, self.codes, self.scale.squeeze(1).to(x2d.dtype))
        scale, offset = self.scale.to(x2d.dtype), self.offset.to(x2d.dtype)  # [out, groups]
        zeros = offset + 8 * scale  # the kernel's w = (q - 8) * s + z
        scale_zeros = torch.stack((scale.t(), zeros.t()), dim=-1).contiguous()  # [groups, out, 2]
        return torch._weight_int4pack_mm_for_cpu(x2d, self.codes, self.in_features // self.scale.shape[1],
                                                 scale_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.kernel == "int":
            y = self._int_matmul(x.reshape(-1, self.in_features).contiguous())
            y = y.reshape(*x.shape[:-1], self.out_features)
            return y if bias is None else y + bias
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        kind = "sym" if self.offset is None else "asym"
        return (f"in={self.in_features}, out={self.out_features}, int{self.bits} {kind}, groups={self.scale.shape[1]}, "
                f"kernel={self.kernel}")


def _check_int_kernel(cfg: WeightQuantConfig, shape: torch.Size, device: torch.device) -> None:
    """``NotSupportedYetError`` unless PyTorch has a weight-only kernel for this layout."""
    symmetric, group = cfg.q_type is QuantTypeEnum.sym, shape[1] // cfg.q_groups
    if cfg.num_bits == 8 and (not symmetric or cfg.q_groups != 1):
        raise NotSupportedYetError("quant.weight.kernel", "kernel 'int' with INT8 needs q_type symmetric and "
                                   f"q_groups 1 (got {cfg.q_type.value}, {cfg.q_groups}): not supported yet by "
                                   "zerospeed")
    if cfg.num_bits == 4 and (symmetric or group not in _INT4_GROUP_SIZES or shape[0] % 16 or device.type != "cpu"):
        raise NotSupportedYetError("quant.weight.kernel", f"kernel 'int' with INT4 needs q_type asymmetric, "
                                   f"{_INT4_GROUP_SIZES} columns per group, out_features a multiple of 16 and a CPU "
                                   f"weight (got {cfg.q_type.value}, {group} columns, {shape[0]} out, {device.type}): "
                                   "not supported yet by zerospeed")


def _int4pack(codes: torch.Tensor) -> torch.Tensor:
    """Our two-per-byte codes ``[out, in/2]`` in the layout of ``_weight_int4pack_mm_for_cpu``."""
    q = torch.stack((codes & 0x0F, codes >> 4), dim=-1).reshape(codes.shape[0], -1).to(torch.int32)
    return torch._convert_weight_to_int4pack_for_cpu(q, 1)


class QuantizedRowParallel(nn.Module):
    """A quantized row-parallel shard: ``all_reduce(x_r Q(W_r)^T) + b`` over the tensor-parallel group."""

    def __init__(self, layer: nn.Module, cfg: WeightQuantConfig) -> None:
        super().__init__()
        if layer.sequence_parallel or not layer.input_is_parallel:
            raise NotSupportedYetError("quant", f"quantizing row-parallel layer '{layer.label}' with sequence "
                                       "parallelism or a replicated input: not supported yet by zerospeed")
        weight = layer.linear_weight
        full_in = sum(layer.partition_sizes)
        if full_in % cfg.q_groups:
            raise ValueError(f"in_features {full_in} of '{layer.label}' is not divisible by quant.weight.q_groups="
                             f"{cfg.q_groups}")
        width = math.gcd(weight.shape[1], full_in // cfg.q_groups)
        self.linear = QuantizedLinear(weight, None, cfg.model_copy(update={"q_groups": weight.shape[1] // width}))
        self.bias = layer.bias
        self.group = layer.mp_group

    def weight_nbytes(self) -> int:
        return self.linear.weight_nbytes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        comm.all_reduce(y, self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def _quantized(module: nn.Module, cfg: WeightQuantConfig) -> nn.Module | None:
    """The quantized replacement of a linear (plain or tensor-parallel shard), else None."""
    from zerospeed.parallel.tensor import LinearAllreduce, LinearLayer

    if isinstance(module, LinearAllreduce):
        return QuantizedRowParallel(module, cfg) if module.tp_world_size > 1 else QuantizedLinear(
            module.linear_weight, module.bias, cfg)
    if isinstance(module, LinearLayer):
        if module.tp_world_size > 1 and (module.gather_output or module.sequence_parallel or module.overlap_comm):
            raise NotSupportedYetError("quant", f"quantizing column-parallel layer '{module.label}' with gathered "
                                       "output, sequence parallelism or overlap: not supported yet by zerospeed")
        return QuantizedLinear(module.linear_weight, module.bias, cfg)  # whole rows: no communication forward
    found = _linear_weight(module)
    return None if found is None else QuantizedLinear(found[0], found[1], cfg)


def _linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight [out, in], bias)`` of a linear layer (nn.Linear or HF Conv1D), else None."""
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        return module.weight.t(), module.bias
    return None


@torch.no_grad()
def quantize_model(model: nn.Module, cfg: WeightQuantConfig) -> int:
    """Replace every linear layer of ``model`` in place by a ``QuantizedLinear``; returns how many.

    Layers are swapped one at a time, so each full-precision weight can be freed before the next is
    quantized (peak memory: the model plus one layer's temporaries, not two models). Tensor-parallel
    shards (``zerospeed.parallel.tensor`` layers, after ``shard_for_inference``) are quantized per shard.
    """
    from zerospeed.parallel.tensor import LinearAllreduce, LinearLayer

    targets = [(module, child_name) for module in model.modules() for child_name, child in module.named_children()
               if isinstance(child, (LinearLayer, LinearAllreduce)) or _linear_weight(child) is not None]
    for parent, child_name in targets:
        setattr(parent, child_name, _quantized(getattr(parent, child_name), cfg))
    return len(targets)


def model_bytes(model: nn.Module, linear_weights_only: bool = False) -> int:
    """Bytes held by ``model``'s tensors, each storage counted once; or only its linear weights (codes+scales)."""
    if linear_weights_only:
        total = 0
        for m in model.modules():
            if isinstance(m, QuantizedLinear):
                total += m.weight_nbytes()
            elif hasattr(m, "linear_weight") and not isinstance(m, QuantizedRowParallel):  # a tensor-parallel shard
                total += m.weight.numel() * m.weight.element_size()
            elif (found := _linear_weight(m)) is not None:
                total += found[0].numel() * found[0].element_size()
        return total
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total
