"""Fused / packed weights split per sub-matrix: fused QKV (with GQA q/k/v sizes), packed gate/up.

A fused ``[q; k; v]`` weight cut as one block would hand rank 0 all of q and rank 1 all of k and v.
Instead each sub-matrix is cut on its own with the shard-size rules and each rank keeps
``[q_r; k_r; v_r]`` (see :mod:`.partition`), so the local output splits into this rank's heads of q, k
and v exactly like the full output does. Under GQA (``tp_meta.num_kv_heads`` known) q is cut into the
same kv-head groups as k and v, so each rank's queries stay with their keys and values.

``SubParamLinearLayer`` / ``SubParamLinearAllreduce`` take DeepSpeed's ``shape`` spec for a 2-D weight:
``((q, k, v), -1)`` (explicit sub-matrix sizes), ``(3, -1)`` (three equal ones) or ``(-1, -1)`` (one).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .column import LinearLayer
from .layer import is_conv1d
from .row import LinearAllreduce
from .shard import ShardSizeError, checked_shard_sizes


def qkv_sizes(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """Rows of q, k and v in a fused QKV weight (``num_kv_heads < num_heads`` under GQA)."""
    return num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim


def _subparam_sizes(shape: Any, total: int, other: int, dim: int, layer: str) -> tuple[int, ...]:
    """Sub-matrix sizes along ``dim`` from DeepSpeed's 2-D ``shape`` spec (other dim: -1 or its size)."""
    if not isinstance(shape, (tuple, list)) or len(shape) != 2:
        raise ValueError(f"layer '{layer}': shape {shape!r} is not supported yet by zerospeed "
                         "(a 2-entry spec such as ((q, k, v), -1) or (3, -1))")
    spec, rest = shape[dim], shape[1 - dim]
    if rest not in (-1, other):
        raise ValueError(f"layer '{layer}': shape {shape!r} entry {rest} does not match the weight's size {other}")
    if isinstance(spec, (tuple, list)):
        sizes = tuple(int(s) for s in spec)
        if not sizes or min(sizes) <= 0 or sum(sizes) != total:
            raise ValueError(f"layer '{layer}': sub-parameter sizes {sizes} do not tile a dimension of {total}")
        return sizes
    if spec == -1:
        return (total,)
    if isinstance(spec, int) and spec > 0:
        if total % spec:
            raise ValueError(f"layer '{layer}': dimension {total} is not divisible by {spec} sub-parameters")
        return (total // spec,) * spec
    raise ValueError(f"layer '{layer}': shape entry {spec!r} must be a tuple of sizes, a positive count or -1")


def _features(module: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of an ``nn.Linear`` or a Hugging Face ``Conv1D``."""
    rows, cols = module.weight.shape
    return (cols, rows) if is_conv1d(module) else (rows, cols)


def _widths(layer: Any, sizes: tuple[int, ...], shard_name: str | None, what: str) -> tuple[tuple[int, ...], ...]:
    out = []
    for j, size in enumerate(sizes):
        try:
            out.append(checked_shard_sizes(size, layer.tp_world_size, layer.label, f"{what} (sub-parameter {j})",
                                           layer.tp_meta, shard_name))
        except ShardSizeError as exc:
            raise ShardSizeError(f"{exc} [sub-parameter sizes {sizes}]") from None
    return tuple(out)


class SubParamLinearLayer(LinearLayer):
    """Column-parallel layer over a fused weight: ``SubParamLinearLayer(module, mp_group, shape, partition_dim=0)``."""

    def __init__(self, module: nn.Module, mp_group: Any = None, shape: Any = (-1, -1), partition_dim: int = 0,
                 **kwargs: Any) -> None:
        if partition_dim != 0:
            raise ValueError(f"SubParamLinearLayer: partition_dim={partition_dim} is not supported yet by zerospeed "
                             "(column-parallel fused weights split dim 0)")
        out_features, in_features = _features(module)
        self._shape_spec = shape
        self.subparam_sizes = _subparam_sizes(shape, out_features, in_features, 0, kwargs.get("name") or "?")
        super().__init__(module, mp_group, **kwargs)

    def _out_widths(self, out_features: int) -> tuple[tuple[int, ...], ...]:
        return _widths(self, self.subparam_sizes, self.name, "output features")

    def local_subparam_sizes(self) -> tuple[int, ...]:
        """This rank's rows of each sub-matrix (how to split the local output, e.g. into q, k, v)."""
        return tuple(w[self.tp_index] for w in self.shard_specs()["weight"].widths)


class GateUpPack_LinearLayer(SubParamLinearLayer):  # noqa: N801 - DeepSpeed's name
    """Packed ``[gate; up]`` MLP weight: two equal halves, each cut with the MLP rules (DeepSpeed's name)."""

    def __init__(self, module: nn.Module, mp_group: Any = None, **kwargs: Any) -> None:
        super().__init__(module, mp_group, shape=(2, -1), **kwargs)

    def _out_widths(self, out_features: int) -> tuple[tuple[int, ...], ...]:
        return _widths(self, self.subparam_sizes, "mlp", "output features")


class FusedQKVLinear(SubParamLinearLayer):
    """Fused QKV projection from head counts: ``FusedQKVLinear(module, mp_group, num_heads, num_kv_heads)``.

    Head groups are dealt out kv-head aware (the model's ``num_kv_heads`` goes into ``tp_meta`` unless
    one is given), and a rank without a key/value head is an error naming the layer and the numbers.
    """

    def __init__(self, module: nn.Module, mp_group: Any = None, num_heads: int = 1, num_kv_heads: int | None = None,
                 **kwargs: Any) -> None:
        from dataclasses import replace

        from .shard import AutoTPMeta

        num_kv_heads = num_kv_heads or num_heads
        out_features = _features(module)[0]
        head_dim, rem = divmod(out_features, num_heads + 2 * num_kv_heads)
        if rem or head_dim == 0:
            raise ShardSizeError(f"layer '{kwargs.get('name') or 'qkv'}': {out_features} output rows are not "
                                 f"(heads {num_heads} + 2 x kv heads {num_kv_heads}) x head_dim")
        meta = kwargs.pop("tp_meta", None) or AutoTPMeta()
        if meta.num_kv_heads is None:
            meta = replace(meta, num_kv_heads=num_kv_heads, num_attention_heads=num_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        super().__init__(module, mp_group, shape=(qkv_sizes(num_heads, num_kv_heads, head_dim), -1), tp_meta=meta,
                         **kwargs)

    def _out_widths(self, out_features: int) -> tuple[tuple[int, ...], ...]:
        if self.num_kv_heads < self.tp_world_size:
            raise ShardSizeError(f"layer '{self.label}': {self.num_kv_heads} key/value heads cannot be split over "
                                 f"tensor-parallel size {self.tp_world_size} ({self.num_heads} query heads, "
                                 f"head_dim {self.head_dim})")
        return super()._out_widths(out_features)

    @property
    def local_heads(self) -> tuple[int, int]:
        """``(query heads, kv heads)`` on this rank."""
        q, k, _ = self.local_subparam_sizes()
        return q // self.head_dim, k // self.head_dim


class SubParamLinearAllreduce(LinearAllreduce):
    """Row-parallel layer over a weight whose input dim is fused: ``(out, (a, b))`` spec, ``partition_dim=1``."""

    def __init__(self, module: nn.Module, mp_group: Any = None, shape: Any = (-1, -1), partition_dim: int = 1,
                 **kwargs: Any) -> None:
        if partition_dim != 1:
            raise ValueError(f"SubParamLinearAllreduce: partition_dim={partition_dim} is not supported yet by "
                             "zerospeed (row-parallel fused weights split dim 1)")
        out_features, in_features = _features(module)
        self.subparam_sizes = _subparam_sizes(shape, in_features, out_features, 1, kwargs.get("name") or "?")
        if len(self.subparam_sizes) > 1 and kwargs.get("input_is_parallel") is False:
            raise ValueError(f"layer '{kwargs.get('name') or '?'}': a fused row-parallel weight needs its input "
                             "already split per sub-parameter (input_is_parallel=True)")
        super().__init__(module, mp_group, **kwargs)

    def _in_widths(self, in_features: int) -> tuple[tuple[int, ...], ...]:
        return _widths(self, self.subparam_sizes, self.name, "input features")


class fused_LinearLayer(SubParamLinearLayer):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed picks a fused-QKV layout from the model's block type (``fused_module``); not here."""

    def __init__(self, module: nn.Module, mp_group: Any = None, skip_partition: bool = False, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"fused_LinearLayer (a fused QKV layout chosen from the model's block type) is not supported yet by "
            f"zerospeed (layer '{kwargs.get('name') or '?'}'); use FusedQKVLinear(module, mp_group, num_heads, "
            "num_kv_heads) or SubParamLinearLayer(module, mp_group, shape=((q, k, v), -1))")
