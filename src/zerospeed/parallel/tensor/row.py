"""Row-parallel linear: each rank holds a slice of the input features (DeepSpeed's ``LinearAllreduce``).

``W`` ``[out, in]`` is cut along ``in``; the input arrives already split the same way (the output of a
column-parallel layer). Each rank computes a partial ``x_r W_r^T``; the partials are all-reduced and
the bias — kept whole on every rank — is added once, after the reduce. Backward needs no collective:
the output gradient is already the same on every rank.

Under sequence parallelism the partials are reduce-scattered along ``seq_dim`` instead, so the output
holds ``seq/tp`` tokens; the bias gradient (each rank's own tokens) is then all-reduced over the group.
``input_is_parallel=False`` takes a replicated input and keeps this rank's features of it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layer import TensorParallelLayer
from .mappings import (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region)
from .partition import TPShardSpec
from .shard import AutoTPMeta, checked_shard_sizes


class LinearAllreduce(TensorParallelLayer):
    """``LinearAllreduce(module, mp_group=None, **kwargs)``.

    Keyword arguments: ``name``, ``tp_meta``, ``input_is_parallel`` (default True), ``sequence_parallel``,
    ``seq_dim`` (default 1), ``overlap_comm`` (accepted for symmetry with :class:`LinearLayer`; a
    row-parallel layer has no input-gradient collective to overlap).
    """

    def __init__(self, module: nn.Module, mp_group: Any = None, *, name: str | None = None,
                 tp_meta: AutoTPMeta | None = None, input_is_parallel: bool = True, sequence_parallel: bool = False,
                 seq_dim: int = 1, overlap_comm: bool = False) -> None:
        super().__init__(mp_group, name=name, tp_meta=tp_meta)
        out_features, in_features = self._take_weight(module)
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        self.overlap_comm = overlap_comm
        widths = self._in_widths(in_features)
        self.partition_sizes = tuple(sum(w[r] for w in widths) for r in range(self.tp_world_size))
        self._keep_shard("weight", TPShardSpec(tuple(self.weight.shape), self._dim(1), widths))
        if self.bias is not None:
            self._keep_shard("bias", TPShardSpec(tuple(self.bias.shape), None))

    def _in_widths(self, in_features: int) -> tuple[tuple[int, ...], ...]:
        return (checked_shard_sizes(in_features, self.tp_world_size, self.label, "input features",
                                    self.tp_meta, self.name),)

    @property
    def in_features(self) -> int:
        """Input features this rank takes (``sum(partition_sizes)`` is the full width)."""
        return self.linear_weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.linear_weight.shape[0]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.project(input, self.linear_weight, self.bias)

    def project(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's forward with this rank's ``weight [out, in_r]`` and the whole ``bias`` given (a
        compression-aware twin passes its quantized, masked ones)."""
        group = self.mp_group
        if self.tp_world_size == 1:
            return F.linear(input, weight, bias)
        if not self.input_is_parallel:
            input = scatter_to_tensor_model_parallel_region(input, group, self.partition_sizes)
        partial = F.linear(input, weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, group, self.seq_dim)
            bias = None if bias is None else copy_to_tensor_model_parallel_region(bias, group)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, group)
        return out if bias is None else out + bias

    @classmethod
    def from_features(cls, in_features: int, out_features: int, mp_group: Any = None, bias: bool = True,
                      device: Any = None, dtype: torch.dtype | None = None, **kwargs: Any) -> LinearAllreduce:
        """Plain constructor: an ``nn.Linear(in_features, out_features)`` initialised as usual, then cut."""
        return cls(nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype), mp_group, **kwargs)


Conv_LinearALlreduce = LinearAllreduce  # DeepSpeed's name (sic): a Conv1D is recognised by the layer itself


class LinearAllreduceWithReplicatedInput(LinearAllreduce):
    """A row-parallel layer fed a replicated input (DeepSpeed's name): ``input_is_parallel=False``."""

    def __init__(self, module: nn.Module, mp_group: Any = None, **kwargs: Any) -> None:
        kwargs["input_is_parallel"] = False
        super().__init__(module, mp_group, **kwargs)
