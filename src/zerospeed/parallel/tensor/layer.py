"""What every tensor-parallel layer shares: its group, its rank, and a shard spec per parameter.

A layer wraps an existing module (DeepSpeed's ``LinearLayer(module, mp_group)``): it takes the module's
``weight`` / ``bias`` Parameter objects and replaces their data by this rank's shard, so the full matrix
is freed and anything holding the Parameter (a tied embedding, an optimizer built later) sees the shard.
The layout of each parameter is a :class:`~.partition.TPShardSpec` kept by the layer (``shard_specs()``),
not attributes on the Parameter; :func:`tp_shard_specs` collects them for a whole model, by name.

Hugging Face's ``Conv1D`` (GPT-2) stores its weight transposed, ``[in, out]``; the layers keep that layout
(so parameter shapes and checkpoints stay the model's own) and cut the matching dimension.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ... import comm
from .mappings import tp_rank, tp_world_size
from .partition import TPShardSpec, shard
from .shard import AutoTPMeta


class TensorParallelLayer(nn.Module):
    """Base of the tensor-parallel layers. ``mp_group=None``: a tensor-parallel size of 1 (no communication).

    Keyword arguments shared by all layers: ``name`` (used by the shard-size rules and in error
    messages) and ``tp_meta`` (:class:`~.shard.AutoTPMeta`: the model's kv heads and grain size).
    """

    def __init__(self, mp_group: Any = None, *, name: str | None = None, tp_meta: AutoTPMeta | None = None) -> None:
        super().__init__()
        self.mp_group = mp_group
        self.tp_world_size = tp_world_size(mp_group)
        self.tp_index = tp_rank(mp_group)
        self.name = name
        self.tp_meta = tp_meta or AutoTPMeta()
        self._specs: dict[str, TPShardSpec] = {}
        self.transposed = False   # weight stored [in, out] (Hugging Face Conv1D)

    def _take_weight(self, module: nn.Module) -> tuple[int, int]:
        """Adopt ``module``'s weight and bias; returns ``(out_features, in_features)``."""
        self.weight = module.weight
        self.bias = getattr(module, "bias", None)
        self.transposed = is_conv1d(module)
        if self.weight.dim() != 2:
            raise ValueError(f"layer '{self.label}': weight of shape {tuple(self.weight.shape)} is not a matrix")
        rows, cols = self.weight.shape
        return (cols, rows) if self.transposed else (rows, cols)

    def _dim(self, linear_dim: int) -> int:
        """The weight dimension that holds ``nn.Linear`` dimension ``linear_dim`` (0: out, 1: in)."""
        return 1 - linear_dim if self.transposed else linear_dim

    @property
    def linear_weight(self) -> torch.Tensor:
        """The weight as ``nn.Linear`` lays it out, ``[out, in]`` (a view when stored transposed)."""
        return self.weight.t() if self.transposed else self.weight

    # DeepSpeed's aliases for the two numbers above
    @property
    def world_size(self) -> int:
        return self.tp_world_size

    @property
    def rank(self) -> int:
        return self.tp_index

    @property
    def label(self) -> str:
        """How errors name this layer."""
        return self.name or type(self).__name__

    def _keep_shard(self, attr: str, spec: TPShardSpec, partition: bool = True) -> None:
        """Record ``attr``'s layout and (``partition``) replace its data by this rank's shard."""
        param = getattr(self, attr)
        self._specs[attr] = spec
        if partition and spec.dim is not None and self.tp_world_size > 1:
            param.data = shard(param.data, spec, self.tp_index).clone()

    def shard_specs(self) -> dict[str, TPShardSpec]:
        """Layout of each of this layer's parameters, by attribute name (``weight``, ``bias``)."""
        return dict(self._specs)

    @torch.no_grad()
    def gathered_parameters(self) -> dict[str, torch.Tensor]:
        """Full (unsplit) copies of this layer's parameters; collective over the group."""
        out = {}
        for attr, spec in self._specs.items():
            local = getattr(self, attr).detach()
            if spec.dim is None or self.tp_world_size == 1:
                out[attr] = local.clone()
                continue
            pieces = local.split([w[self.tp_index] for w in spec.widths], dim=spec.dim)
            full = [comm.all_gather_along_dim(p, spec.dim, self.mp_group, list(w)) for p, w in zip(pieces, spec.widths)]
            out[attr] = torch.cat(full, dim=spec.dim) if len(full) > 1 else full[0]
        return out

    def extra_repr(self) -> str:
        w = getattr(self, "weight", None)
        shape = tuple(w.shape) if w is not None else None
        return f"name={self.name!r}, tp={self.tp_index}/{self.tp_world_size}, local_weight={shape}"


TensorParallel_Layer = TensorParallelLayer  # DeepSpeed's name


@runtime_checkable
class HasParallelTwin(Protocol):
    """A linear that names the tensor-parallel layer AutoTP builds from it (a compression-aware linear: its
    twin keeps the compression state, cut like the weight). ``kind``: "column" or "row"; ``fused``: a
    packed weight split per sub-matrix. The twin takes the plain layer's constructor arguments; None: the
    plain layer."""

    def tensor_parallel_twin(self, kind: str, fused: bool) -> type[TensorParallelLayer] | None: ...


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D``: a linear layer with its weight stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def tp_shard_specs(model: nn.Module) -> dict[str, TPShardSpec]:
    """Every tensor-parallel parameter of ``model``, by qualified parameter name (replicated ones: ``dim=None``)."""
    out: dict[str, TPShardSpec] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, TensorParallelLayer):
            for attr, spec in module.shard_specs().items():
                out[f"{prefix}.{attr}" if prefix else attr] = spec
    return out
