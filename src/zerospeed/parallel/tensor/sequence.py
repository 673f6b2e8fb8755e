"""Megatron sequence parallelism over the tensor-parallel group: what the layers do not do themselves.

Between a row-parallel layer and the next column-parallel layer (LayerNorm, dropout, residual adds)
every rank holds only ``seq/tp`` tokens: the row layer reduce-scatters its output along the sequence
instead of all-reducing it, the column layer all-gathers its input (``sequence_parallel=True`` on both,
and on the vocab-parallel embedding). Same math as plain tensor parallelism, with those regions'
activations ``÷ tp``, and the same bytes on the wire (an all-reduce is a reduce-scatter + all-gather).

What remains is here:

* entering and leaving the region (:func:`scatter_to_sequence_parallel_region` for a replicated input,
  :func:`gather_from_sequence_parallel_region` with ``tensor_parallel_output_grad=False`` before a
  replicated consumer such as a loss), re-exported from :mod:`.mappings`;
* parameters used inside the region (LayerNorm weight and bias) see only this rank's tokens, so their
  gradients must be summed over the group: :class:`SequenceParallelGradSync` adds that all-reduce as a
  gradient hook (before accumulation into ``.grad``, so it composes with gradient accumulation and
  with data-parallel reduction that runs after it).

Dropout in the region draws its mask for this rank's tokens only; a parity test against an unsplit
model needs dropout 0 (a tensor-parallel RNG tracker is not part of zerospeed yet).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ... import comm
from .mappings import (gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region,
                       scatter_to_sequence_parallel_region, tp_world_size)

__all__ = ["SequenceParallelGradSync", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "scatter_to_sequence_parallel_region"]


class SequenceParallelGradSync:
    """All-reduce over ``group`` the gradients of ``params`` (a module: all its parameters) as they arrive.

    Keep the object (or call :meth:`remove`) for as long as the hooks should stay.
    """

    def __init__(self, params: nn.Module | Iterable[torch.Tensor], group: Any) -> None:
        self.group = group
        self.params = list(params.parameters() if isinstance(params, nn.Module) else params)
        self._handles: list[Any] = []
        if tp_world_size(group) > 1:
            self._handles = [p.register_hook(self._reduce) for p in self.params if p.requires_grad]

    def _reduce(self, grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()
        comm.all_reduce(out, self.group)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
