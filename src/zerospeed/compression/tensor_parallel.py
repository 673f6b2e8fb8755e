"""Compression under tensor parallelism: the compression-aware twins of AutoTP's column- and row-parallel layers.

AutoTP (``parallel/tensor/model_init.py``) asks each linear it splits for its tensor-parallel layer; a
``LinearLayer_Compress`` answers with a twin here (DeepSpeed 0.19.6's ``ColumnParallelLinear_Compress`` /
``RowParallelLinear_Compress`` names). The twin is the plain tensor-parallel layer (same constructor, same
communication, same shard of the weight) whose forward uses the compressed local weight. Every technique acts
on this rank's shard, by one **per-shard rule**, so a shard's result never depends on the other shards:

* weight quantization: the ``quantize_groups`` groups (and MoQ's bits) cut this rank's shard, flattened;
* sparse pruning: ``l1`` keeps the ``ceil(dense_ratio * n)`` largest ``|w|`` of the shard; ``topk`` learns
  scores cut like the weight (this rank's slice of the scores ``init_compression`` drew). An ``l1`` mask is
  rebuilt from the weights the model is built with, not checkpointed (a checkpoint stores module buffers
  whole; a resumed run builds the model as the saved one was, then loads);
* row pruning (column-parallel layers, whose rows are split): each shard keeps ``ceil(dense_ratio * rows_r)``
  of its own rows (by l1 norm, or by its slice of the learned scores), so the shards stay equal in size;
* head pruning (row-parallel layers: the attention output projection, its input columns split by head):
  each rank holds ``num_heads / tp`` whole heads and keeps ``ceil(dense_ratio * heads_r)`` of them by its
  slice of the learned scores; on a column-parallel layer the input columns are whole and nothing changes;
* activation quantization on a column-parallel layer (its input is the same on every rank).

Row pruning of a row-parallel layer and activation quantization of its split input would need the other
shards (a row's l1 norm, a token's range): they raise "not supported yet", as do packed (fused) weights.
A single process reproduces a tensor-parallel run by applying the same rule to each shard's slice of the
full weight (the parity test in ``tests/dist/test_compression_tp.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config.errors import NotSupportedYetError
from ..parallel.tensor.column import LinearLayer
from ..parallel.tensor.layer import TensorParallelLayer
from ..parallel.tensor.partition import TPShardSpec
from ..parallel.tensor.row import LinearAllreduce
from . import masks
from .layers import _LinearCompressed


def _refuse(what: str) -> NotSupportedYetError:
    return NotSupportedYetError("compression_training", f"{what} under tensor parallelism is not supported yet "
                                "by zerospeed")


def _compressed(src: Any) -> bool:
    return src.weight_quant is not None or src._act_quant is not None or any(
        getattr(src, f"{unit}_pruning_method") is not None for unit in ("sparse", "row", "head"))


def parallel_twin(source: Any, kind: str, fused: bool) -> type[TensorParallelLayer] | None:
    """The twin class AutoTP builds from the compression-aware linear ``source`` (``kind``: column or row);
    None (AutoTP's own layer) when no technique is configured on it."""
    if not _compressed(source):
        return None
    if fused:
        raise _refuse("compression of a packed (fused) weight split per sub-matrix")
    return ColumnParallelLinear_Compress if kind == "column" else RowParallelLinear_Compress


class _Twin(_LinearCompressed):
    """Adopts the source layer's techniques for this rank's shard (module docstring)."""

    weight: nn.Parameter
    tp_index: int
    tp_world_size: int
    cut_dim: int  # the nn.Linear dimension the layer splits (0: output rows, 1: input columns)

    def __init__(self, module: nn.Module, mp_group: Any = None, **kwargs: Any) -> None:
        super().__init__(module, mp_group, **kwargs)  # type: ignore[call-arg] # the plain tensor-parallel layer's
        self._adopt(module, self.cut_dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        weight, bias = self.compressed_weight_and_bias()
        x = self._quantized_input(input, input.numel() // input.size(-1))
        return self.project(x, weight, bias)  # type: ignore[attr-defined,no-any-return]

    def _adopt(self, src: Any, cut_dim: int) -> None:
        """``cut_dim``: the ``nn.Linear`` dimension this layer splits (0: output rows, 1: input columns)."""
        self._init_compression()
        self.weight_quant = src.weight_quant  # the same object: MoQ moves its bits
        if src._act_quant is not None:
            if cut_dim == 1 and self.tp_world_size > 1:
                raise _refuse("activation quantization of a row-parallel layer's split input")
            self._act_quant, self.activation_quantization_method = src._act_quant, src.activation_quantization_method
            if src._act_quant[2] is not None:
                self.activation_quantizer = src._act_quant[2]
        for unit in ("sparse", "row"):
            if getattr(src, f"{unit}_pruning_method") is not None:
                if unit == "row" and cut_dim == 1 and self.tp_world_size > 1:
                    raise _refuse("row pruning of a row-parallel layer")
                self._adopt_mask(src, unit, cut_dim)
        if src.head_pruning_method is not None:
            self._adopt_heads(src, cut_dim)

    def _widths(self) -> tuple[int, ...]:
        return self.shard_specs()["weight"].widths[0]  # type: ignore[attr-defined,no-any-return]

    def _cut(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of ``t`` along ``dim``, as the weight is cut."""
        widths = self._widths()
        return t.detach().narrow(dim, sum(widths[:self.tp_index]), widths[self.tp_index]).clone()

    def _split(self, attr: str, full_shape: tuple[int, ...], dim: int, widths: tuple[int, ...]) -> None:
        """Record ``attr`` (already this rank's slice) as split, like the weight: checkpoints and the gradient
        norm then treat it per shard."""
        self._keep_shard(attr, TPShardSpec(full_shape, dim, (widths,)), partition=False)  # type: ignore[attr-defined]

    def _adopt_mask(self, src: Any, unit: str, cut_dim: int) -> None:
        ratio, method = getattr(src, f"{unit}_pruning_ratio"), getattr(src, f"{unit}_pruning_method")
        setattr(self, f"{unit}_pruning_ratio", ratio)
        setattr(self, f"{unit}_pruning_method", method)
        shape = tuple(self.weight.shape) if unit == "sparse" else (self.weight.shape[0], 1)
        weight_spec = self.shard_specs()["weight"]  # type: ignore[attr-defined]
        full = weight_spec.full_shape if unit == "sparse" else (src.out_features, 1)
        if method == "l1":  # the shard's own l1 scores, from the weights the model is built with
            mask = masks.topk_mask(masks.l1_scores(self.weight, unit), ratio).reshape(shape)
            self.register_buffer(f"{unit}_pruning_mask", mask, persistent=False)  # rebuilt, not checkpointed
            return
        scores = getattr(src, f"{unit}_mask_scores")
        mine = self._cut(scores, cut_dim) if self.tp_world_size > 1 else scores.detach().clone()
        setattr(self, f"{unit}_mask_scores", nn.Parameter(mine))
        self.register_buffer(f"{unit}_pruning_mask", None)
        if self.tp_world_size > 1:
            self._split(f"{unit}_mask_scores", full, cut_dim, self._widths())

    def _adopt_heads(self, src: Any, cut_dim: int) -> None:
        heads, scores = src.num_heads, src.head_pruning_scores.detach()
        if cut_dim == 1 and self.tp_world_size > 1:
            head_dim = src.in_features // heads
            if heads % self.tp_world_size or self.weight.shape[1] != heads // self.tp_world_size * head_dim:
                raise ValueError(f"head pruning: {heads} heads of {head_dim} columns do not split into whole heads "
                                 f"over {self.tp_world_size} ranks (this rank holds {self.weight.shape[1]} columns)")
            heads //= self.tp_world_size
            scores = scores.narrow(1, self.tp_index * heads, heads).clone()
        self.num_heads, self.head_pruning_ratio, self.head_pruning_method = heads, src.head_pruning_ratio, "topk"
        self.head_pruning_scores = nn.Parameter(scores)
        if heads != src.num_heads:
            self._split("head_pruning_scores", (1, src.num_heads), 1, (heads,) * self.tp_world_size)


class ColumnParallelLinear_Compress(_Twin, LinearLayer):  # noqa: N801 - DeepSpeed's name
    """AutoTP's column-parallel layer with the compression of the ``LinearLayer_Compress`` it was made from."""

    cut_dim = 0


class RowParallelLinear_Compress(_Twin, LinearAllreduce):  # noqa: N801 - DeepSpeed's name
    """AutoTP's row-parallel layer with the compression of the ``LinearLayer_Compress`` it was made from."""

    cut_dim = 1


__all__ = ["ColumnParallelLinear_Compress", "RowParallelLinear_Compress", "parallel_twin"]
