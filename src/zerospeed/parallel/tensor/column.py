"""Column-parallel linear: each rank holds a slice of the output features (DeepSpeed's ``LinearLayer``).

``W`` ``[out, in]`` and ``b`` ``[out]`` are cut along ``out`` with the shard-size rules; the input is
replicated. Forward is identity on the input and ``y_r = x W_r^T + b_r`` (this rank's output
features); backward all-reduces the input gradient over the group, optionally overlapped with the
weight-gradient matmul (``overlap_comm``). ``gather_output=True`` all-gathers the output features.

Under sequence parallelism (``sequence_parallel=True``) the input holds ``seq/tp`` tokens along
``seq_dim``; it is all-gathered before the matmul and its gradient reduce-scattered back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .layer import TensorParallelLayer
from .mappings import copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region
from .overlap import ColumnParallelMatmul
from .partition import TPShardSpec, regroup_gathered
from .shard import AutoTPMeta, ShardSizeError, checked_shard_sizes


class LinearLayer(TensorParallelLayer):
    """``LinearLayer(module, mp_group=None, skip_partition=False, gather_output=False, **kwargs)``.

    Wraps ``module`` (an ``nn.Linear``-like module with ``weight`` ``[out, in]`` and optional ``bias``, or
    a Hugging Face ``Conv1D`` with ``weight`` ``[in, out]``) and keeps only this rank's output features.
    Keyword arguments: ``name``, ``tp_meta``, ``overlap_comm`` (async input-gradient all-reduce),
    ``sequence_parallel``, ``seq_dim`` (default 1: ``[batch, seq, hidden]``). ``skip_partition=True`` keeps
    the module's parameters uncut (only at a tensor-parallel size of 1, as DeepSpeed uses it).
    """

    def __init__(self, module: nn.Module, mp_group: Any = None, skip_partition: bool = False,
                 gather_output: bool = False, *, name: str | None = None, tp_meta: AutoTPMeta | None = None,
                 overlap_comm: bool = False, sequence_parallel: bool = False, seq_dim: int = 1) -> None:
        super().__init__(mp_group, name=name, tp_meta=tp_meta)
        self._features = self._take_weight(module)
        self.gather_output = gather_output
        self.overlap_comm = overlap_comm
        self.sequence_parallel = sequence_parallel
        self.seq_dim = seq_dim
        if skip_partition and self.tp_world_size > 1:
            raise ValueError(f"layer '{self.label}': skip_partition=True keeps the full weight, which only fits a "
                             f"tensor-parallel size of 1 (this group has {self.tp_world_size} ranks)")
        self._partition(not skip_partition)

    def _partition(self, cut: bool) -> None:
        out_features, _ = self._features
        widths = self._out_widths(out_features)
        self.partition_sizes = tuple(sum(w[r] for w in widths) for r in range(self.tp_world_size))
        self._keep_shard("weight", TPShardSpec(tuple(self.weight.shape), self._dim(0), widths), cut)
        if self.bias is not None:
            if tuple(self.bias.shape) != (out_features,):
                raise ValueError(f"layer '{self.label}': bias of shape {tuple(self.bias.shape)} does not match "
                                 f"{out_features} output features")
            self._keep_shard("bias", TPShardSpec((out_features,), 0, widths), cut)

    def _out_widths(self, out_features: int) -> tuple[tuple[int, ...], ...]:
        """Per sub-parameter, per rank widths of the output dimension (one sub-parameter here)."""
        return (checked_shard_sizes(out_features, self.tp_world_size, self.label, "output features",
                                    self.tp_meta, self.name),)

    @property
    def in_features(self) -> int:
        return self.linear_weight.shape[1]

    @property
    def out_features(self) -> int:
        """Output features this rank produces (``sum(partition_sizes)`` is the full width)."""
        return self.linear_weight.shape[0]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.project(input, self.linear_weight, self.bias)

    def project(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The layer's forward with this rank's ``weight [out_r, in]`` and ``bias`` given (a compression-aware
        twin passes its quantized, masked ones)."""
        group = self.mp_group
        if self.tp_world_size == 1:
            out = F.linear(input, weight, bias)
        elif self.overlap_comm or self.sequence_parallel:
            seq_dim = self.seq_dim if self.sequence_parallel else None
            out = ColumnParallelMatmul.apply(input, weight, bias, group, self.overlap_comm, seq_dim)
        else:
            out = F.linear(copy_to_tensor_model_parallel_region(input, group), weight, bias)
        if self.gather_output:
            out = gather_from_tensor_model_parallel_region(out, group, self.partition_sizes)
            out = regroup_gathered(out, self._specs["weight"])  # fused weights: back to [q | k | v]
        return out

    @classmethod
    def from_features(cls, in_features: int, out_features: int, mp_group: Any = None, bias: bool = True,
                      device: Any = None, dtype: torch.dtype | None = None, **kwargs: Any) -> LinearLayer:
        """Plain constructor: an ``nn.Linear(in_features, out_features)`` initialised as usual, then cut.

        The full matrix exists briefly, so the shard holds the same numbers as the unsplit layer
        built under the same seed.
        """
        return cls(nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype), mp_group, **kwargs)

    @classmethod
    def from_weights(cls, weight_shape: Any = None, dtype: torch.dtype = torch.half, weight: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, gather_output: bool = False) -> LinearLayer:
        """DeepSpeed's backward-compatible constructor: an unsplit layer (tensor-parallel size 1)."""
        if weight is None:
            linear = nn.Linear(weight_shape[1], weight_shape[0], bias=bias is not None, dtype=dtype)
        else:
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
            linear.weight.data = weight
            if bias is not None:
                linear.bias.data = bias  # type: ignore[union-attr]
        return cls(linear, None, skip_partition=True, gather_output=gather_output)


conv_LinearLayer = LinearLayer  # DeepSpeed's name: a Hugging Face Conv1D is recognised by the layer itself


class VocabParallelLinear(LinearLayer):
    """Column-parallel vocabulary projection (lm head) that keeps this rank's logits.

    Feed its output to :func:`~.cross_entropy.vocab_parallel_cross_entropy`: full logits never exist.
    """

    def __init__(self, module: nn.Module, mp_group: Any = None, **kwargs: Any) -> None:
        super().__init__(module, mp_group, gather_output=False, **kwargs)
        self.vocab_size = sum(self.partition_sizes)
        self.vocab_start_index = sum(self.partition_sizes[: self.tp_index])
        self.vocab_end_index = self.vocab_start_index + self.partition_sizes[self.tp_index]
        if min(self.partition_sizes) == 0:  # pragma: no cover - checked_shard_sizes refuses this first
            raise ShardSizeError(f"layer '{self.label}': vocabulary of {self.vocab_size} over "
                                 f"{self.tp_world_size} ranks")
