"""DeepSpeed's ``weight_quantization.quantized_initialization`` format: asymmetric groups along any dimension.

DeepSpeed 0.19.6 (``deepspeed/inference/quantization/utils.py``) quantizes a weight in groups of
``group_size`` consecutive elements along ``group_dim``: per group, with ``m = min``, ``M = max`` and
``R = 2^b - 1`` (``b`` = ``num_bits``, 4 or 8)::

    q = round(clamp((w - m) * R / (M - m), 0, R))        w ~ q / (R / (M - m)) + m

Here the weight is first viewed as *rows*: ``group_dim`` moved last and the other dimensions flattened
(``[out, in]`` with ``group_dim`` 1: the rows themselves; ``group_dim`` 0: the columns), so every group is a
run of ``group_size`` columns of a row, the layout of the inference engine's ``PackedWeight``. The levels
``q`` are DeepSpeed's; they are stored as ``PackedWeight.from_levels(q, s, m)`` with the step
``s = (M - m) / R`` and ``m`` in fp32 (DeepSpeed keeps ``R / (M - m)`` and ``m`` in the weight's dtype), and
read back by the engine's ``dequantize`` (``q * s + m``, the same value to float rounding). A constant group
(``M = m``) gets ``q = 0`` and gives back ``m`` exactly (DeepSpeed computes ``0 * inf`` there).

``QuantizedEmbedding`` is the embedding counterpart of ``QuantizedLinear``: codes and scales in buffers, the
table dequantized in ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .quantization import PackedWeight, dequantize


@dataclass(frozen=True)
class GroupSpec:
    """``num_bits`` (4 or 8) codes in groups of ``group_size`` elements along ``group_dim`` (asymmetric)."""

    num_bits: int
    group_size: int
    group_dim: int = 1


def _rows(w: torch.Tensor, dim: int) -> torch.Tensor:
    return w.movedim(dim, -1).reshape(-1, w.shape[dim])


def check_shape(shape: torch.Size | tuple[int, ...], spec: GroupSpec, what: str) -> None:
    """``ValueError`` naming ``what`` unless ``spec``'s groups cut a weight of ``shape`` (and INT4 pairs it)."""
    if not -len(shape) <= spec.group_dim < len(shape):
        raise ValueError(f"{what}: group_dim {spec.group_dim} is not a dimension of its shape {tuple(shape)}")
    size = shape[spec.group_dim]
    if size % spec.group_size:
        raise ValueError(f"{what}: group_size {spec.group_size} does not divide dimension {spec.group_dim} "
                         f"({size}) of its shape {tuple(shape)}")
    if spec.num_bits == 4 and size % 2:
        raise ValueError(f"{what}: INT4 packs two codes per byte along group_dim, whose size {size} is odd")


@torch.no_grad()
def quantize_groups(w: torch.Tensor, spec: GroupSpec) -> PackedWeight:
    """``w`` as DeepSpeed's levels in the engine's row layout (module docstring)."""
    check_shape(w.shape, spec, "weight")
    rows = _rows(w.detach().float(), spec.group_dim)
    g = rows.reshape(rows.shape[0], -1, spec.group_size)
    top = 2 ** spec.num_bits - 1
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    flat = hi == lo
    ratio = torch.where(flat, torch.ones_like(hi), top / (hi - lo))  # DeepSpeed's ``scale``
    levels = ((g - lo) * ratio).clamp(0, top).round().masked_fill(flat, 0)
    step = torch.where(flat, torch.zeros_like(hi), (hi - lo) / top)
    return PackedWeight.from_levels(levels.reshape(rows.shape).to(torch.int32), step.squeeze(-1),
                                    lo.squeeze(-1), spec.num_bits)


def dequantize_groups(packed: PackedWeight, shape: torch.Size | tuple[int, ...], group_dim: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The weight of ``shape`` in ``dtype`` back from ``quantize_groups``' output."""
    rows = dequantize(packed.codes, packed.scale, packed.offset, packed.bits, dtype)
    moved = list(shape)
    moved.append(moved.pop(group_dim))
    return rows.reshape(moved).movedim(-1, group_dim)


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding`` (no ``max_norm``, dense gradients) with its table held as ``quantize_groups`` codes."""

    def __init__(self, embedding: nn.Embedding, spec: GroupSpec) -> None:
        super().__init__()
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("QuantizedEmbedding: max_norm, scale_grad_by_freq and sparse are not supported "
                             "(DeepSpeed's QuantizedEmbedding refuses them too)")
        packed = quantize_groups(embedding.weight, spec)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.bits, self.group_dim = embedding.padding_idx, spec.num_bits, spec.group_dim
        self.dtype = embedding.weight.dtype
        self.rows = (packed.out_features, packed.in_features)  # the row view's shape
        self.register_buffer("codes", packed.codes)
        self.register_buffer("scale", packed.scale)
        self.register_buffer("offset", packed.offset)

    def weight_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))

    def dequantized_weight(self) -> torch.Tensor:
        packed = PackedWeight(self.codes, self.scale, self.offset, self.bits, *self.rows)
        return dequantize_groups(packed, (self.num_embeddings, self.embedding_dim), self.group_dim, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.dequantized_weight(), self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.bits} asym, groups={self.scale.shape[1]}"
