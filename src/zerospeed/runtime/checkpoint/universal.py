"""Universal (reshardable) model and optimizer state: every tensor addressed by parameter name + element range.

Saving: rank r writes, for each trainable parameter ``p`` (flattened, ``n`` elements), the elements
``[lo, hi)`` it owns under the partition it trains with (``ParamSlot.owned_range``; stage 0 means rank 0
owns everything) of the fp32 master and of every element-wise optimizer state tensor (Adam's ``exp_avg``,
``exp_avg_sq``; SGD's ``momentum_buffer``; Adagrad's ``sum``; found generically: a state tensor with as
many elements as the master shard). 0-d state tensors (``step``) are written once, by the owner of
element 0. Padding is never written. Keys: ``master/<name>``, ``optim/<state>/<name>``, ``scalar/<state>/<name>``.

Loading at any world size and stage: each rank computes its own ``[lo, hi)`` under the new partition
and reads exactly those elements from whichever files hold them (``index.json`` maps each key to its
``(file, lo, hi)`` pieces). The model parameters themselves are rebuilt from the full fp32 master
(cast to the compute dtype exactly as the optimizer's write-back does), so no separate copy of the
16-bit weights is stored.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...parallel.expert.auto.layer import expert_slice
from ...parallel.expert.checkpoint import global_param_names
from ...parallel.tensor.checkpoint import rename_split
from ...zero import ShardedGroup
from .errors import CheckpointError
from .tensor_file import TensorReader


def names_by_id(module: nn.Module) -> dict[int, str]:
    """Checkpoint name of each parameter: its ``named_parameters`` name, MoE experts by global expert id."""
    return rename_split(global_param_names(module), module)  # tensor-parallel shards: name@tp<r>of<T>


@dataclass(frozen=True)
class OwnedParam:
    """Parameter ``index`` of ``group``: its name and the flattened elements ``[lo, hi)`` this rank owns,
    counted in the checkpoint tensor, which starts ``base`` elements before the parameter (an AutoEP expert
    weight is a slice of the model's full experts tensor: ``parallel/expert/auto/layer.py``; 0 otherwise)."""

    name: str
    group: ShardedGroup
    index: int
    lo: int
    hi: int
    base: int = 0

    @property
    def numel(self) -> int:
        return self.group.plan.slots[self.index].numel

    @property
    def shape(self) -> torch.Size:
        """The full shape (under stage 3 the module parameter itself is a placeholder)."""
        return self.group.full_shape(self.index)

    @property
    def param(self) -> nn.Parameter:
        return self.group.params[self.index]

    @property
    def master_param(self) -> nn.Parameter:
        return self.group.master_params[self.index]

    def master_local(self) -> torch.Tensor:
        """A flat view of this rank's owned elements of the fp32 master (length ``hi - lo``)."""
        if self.group.alias:
            return self.param.data.view(-1)[self.lo - self.base:self.hi - self.base]
        assert self.group.master is not None
        start, _ = self.group.slot_range(self.index)
        return self.group.master_range(start, start + (self.hi - self.lo))

    def state_local(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1)[: self.hi - self.lo]

    def is_elementwise(self, t: torch.Tensor) -> bool:
        return t.dim() > 0 and t.numel() == self.master_param.numel()


def owned_params(groups: list[ShardedGroup], names: dict[int, str], dp_rank: int | None = None) -> Iterator[OwnedParam]:
    """Each parameter with the range this rank owns. With ``dp_rank`` (saving), a replicated group (one
    partition: stage 0) is owned by data-parallel rank 0 only, so exactly one rank writes each element."""
    for grp in groups:
        replica = dp_rank if dp_rank is None or grp.replica_rank is None else grp.replica_rank
        if replica not in (None, 0) and grp.num_partitions == 1:
            continue
        for i, p in enumerate(grp.params):
            if id(p) not in names:
                raise ValueError("an optimizer parameter is not a parameter of engine.module")
            lo, hi = grp.plan.slots[i].owned_range(grp.rank)
            piece = expert_slice(p)
            base = piece.offset if piece is not None else 0
            yield OwnedParam(names[id(p)], grp, i, lo + base, hi + base, base)


def _cpu(t: torch.Tensor, copy: bool) -> torch.Tensor:
    t = t.detach()
    return t.to("cpu", copy=True) if copy or t.device.type != "cpu" else t


def snapshot_shards(groups: list[ShardedGroup], names: dict[int, str], optimizer_state: Any, copy: bool,
                    dp_rank: int) -> tuple[dict[str, torch.Tensor], dict[str, list[int]], dict[str, dict[str, Any]]]:
    """This rank's tensors (key -> CPU tensor), their element ranges, and the per-parameter state layout.

    ``copy`` clones (for an async save, so training may go on); otherwise the tensors may be views.
    The layout (which state keys are element-wise, scalar or plain values) is complete only on the
    owner of element 0, i.e. rank 0.
    """
    tensors: dict[str, torch.Tensor] = {}
    ranges: dict[str, list[int]] = {}
    layout: dict[str, dict[str, Any]] = {}
    for op in owned_params(groups, names, dp_rank):
        if op.hi <= op.lo:
            continue
        tensors[f"master/{op.name}"] = _cpu(op.master_local(), copy)
        ranges[f"master/{op.name}"] = [op.lo, op.hi]
        lay: dict[str, Any] = {"elementwise": [], "scalar": [], "values": {}}
        for k, v in (optimizer_state.get(op.master_param, {}) if optimizer_state is not None else {}).items():
            if torch.is_tensor(v) and op.is_elementwise(v):
                tensors[f"optim/{k}/{op.name}"] = _cpu(op.state_local(v), copy)
                ranges[f"optim/{k}/{op.name}"] = [op.lo, op.hi]
                lay["elementwise"].append(k)
            elif torch.is_tensor(v) and v.numel() == 1:
                if op.lo == 0:
                    tensors[f"scalar/{k}/{op.name}"] = _cpu(v, True)
                    ranges[f"scalar/{k}/{op.name}"] = [0, 1]
                lay["scalar"].append(k)
            elif torch.is_tensor(v):
                raise ValueError(f"optimizer state {k!r} of {op.name} has shape {tuple(v.shape)}: neither element-wise "
                                 "nor scalar, so it cannot be resharded (factored optimizers are not supported)")
            elif isinstance(v, (bool, int, float, str)) or v is None:
                lay["values"][k] = v
            else:
                raise ValueError(f"optimizer state {k!r} of {op.name} is a {type(v).__name__}; cannot store it")
        if op.lo == 0:
            layout[op.name] = lay
    return tensors, ranges, layout


class CheckpointReader:
    """Reads element ranges of named tensors from whichever shard files hold them."""

    def __init__(self, ckpt: str, index: dict[str, list[list[Any]]]) -> None:
        self.ckpt = ckpt
        self.index = index
        self._open: dict[str, TensorReader] = {}

    def _file(self, name: str) -> TensorReader:
        if name not in self._open:
            self._open[name] = TensorReader(os.path.join(self.ckpt, name))
        return self._open[name]

    def has(self, key: str) -> bool:
        return key in self.index

    def dtype(self, key: str) -> torch.dtype:
        fname = self.index[key][0][0]
        return self._file(fname).entries[key][0]

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the full flattened tensor ``key``, assembled from its pieces."""
        if key not in self.index:
            raise CheckpointError(f"checkpoint {self.ckpt} has no tensor {key!r}")
        out = torch.empty(hi - lo, dtype=self.dtype(key))
        covered = 0
        for fname, plo, phi in self.index[key]:
            a, b = max(lo, plo), min(hi, phi)
            if a < b:
                out[a - lo:b - lo] = self._file(fname).read_range(key, a - plo, b - plo)
                covered += b - a
        if covered != hi - lo:
            raise CheckpointError(f"checkpoint {self.ckpt}: elements {lo}..{hi} of {key!r} are not all present")
        return out

    def covers(self, key: str, lo: int, hi: int) -> None:
        """Raise what :meth:`read_range` would when elements ``[lo, hi)`` of ``key`` are not all stored (from
        the index: nothing is read)."""
        if key not in self.index:
            raise CheckpointError(f"checkpoint {self.ckpt} has no tensor {key!r}")
        covered = sum(max(0, min(hi, phi) - max(lo, plo)) for _, plo, phi in self.index[key])
        if covered != hi - lo:
            raise CheckpointError(f"checkpoint {self.ckpt}: elements {lo}..{hi} of {key!r} are not all present")

    def read_scalar(self, key: str) -> torch.Tensor:
        fname = self.index[key][0][0]
        return self._file(fname).read(key)

    def close(self) -> None:
        for r in self._open.values():
            r.close()
        self._open.clear()


def master_read_range(op: OwnedParam) -> tuple[int, int]:
    """The elements of ``master/<name>`` ``load_params`` reads: the owned range under stage 3 (parameters
    sharded), the whole parameter otherwise (the module keeps it whole)."""
    if op.group.params_sharded and not op.group.alias:
        return op.lo, op.hi
    return op.base, op.base + op.numel


@torch.no_grad()
def load_params(groups: list[ShardedGroup], names: dict[int, str], reader: CheckpointReader,
                from_fp32: bool = True) -> None:
    """Model parameters (cast) and this rank's fp32 master shards, from the full fp32 master of each parameter.

    ``from_fp32=False`` (``zero_optimization.load_from_fp32_weights: false``) re-creates the master from the
    16-bit model weights instead, as DeepSpeed does: the saved master rounded to the parameter's dtype.
    """
    finish_params(write_masters(groups, names, reader, from_fp32))


def finish_params(sharded: list[ShardedGroup]) -> None:
    """Stage 3: the loaded masters into the local parameter shards (persistent parameters: one all-gather)."""
    for grp in sharded:
        grp.copy_master_to_params()


@torch.no_grad()
def write_masters(groups: list[ShardedGroup], names: dict[int, str], reader: CheckpointReader,
                  from_fp32: bool = True) -> list[ShardedGroup]:
    """:func:`load_params` without communication: the masters (and unsharded parameters) written; returns the
    stage-3 groups whose shards :func:`finish_params` must still write."""
    sharded: list[ShardedGroup] = []
    for op in owned_params(groups, names):
        params_sharded = op.group.params_sharded and not op.group.alias
        lp_dtype = None if from_fp32 or op.param.dtype == torch.float32 else op.param.dtype
        if params_sharded:  # stage 3: read only the owned range; the group writes its local shards below
            part = reader.read_range(f"master/{op.name}", *master_read_range(op))
            if lp_dtype is not None:
                part = part.to(lp_dtype).float()
            if not sharded or sharded[-1] is not op.group:
                sharded.append(op.group)
        else:
            full = reader.read_range(f"master/{op.name}", *master_read_range(op))
            if lp_dtype is not None:
                full = full.to(lp_dtype).float()
            op.param.data.copy_(full.view(op.shape))
            if op.group.alias:
                continue
            part = full[op.lo - op.base:op.hi - op.base]
        assert op.group.master is not None
        start, _ = op.group.slot_range(op.index)
        view = torch.zeros(op.master_param.numel(), dtype=torch.float32)
        view[: op.hi - op.lo].copy_(part)
        op.group.write_master_range(start, view)
    return sharded


@torch.no_grad()
def load_optimizer_state(groups: list[ShardedGroup], names: dict[int, str], reader: CheckpointReader,
                         layout: dict[str, dict[str, Any]], optimizer: torch.optim.Optimizer) -> None:
    """Rebuild ``optimizer.state`` for this rank's master shards, reading only the owned element ranges."""
    scalars_on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
    for op in owned_params(groups, names):
        mp = op.master_param
        lay = layout.get(op.name)
        if lay is None:
            optimizer.state.pop(mp, None)
            continue
        st: dict[str, Any] = {}
        for k in lay["elementwise"]:
            key = f"optim/{k}/{op.name}"
            t = torch.zeros(mp.numel(), dtype=reader.dtype(key))
            if op.hi > op.lo:
                t[: op.hi - op.lo] = reader.read_range(key, op.lo, op.hi)
            st[k] = t.view(mp.shape).to(mp.device)
        for k in lay["scalar"]:
            v = reader.read_scalar(f"scalar/{k}/{op.name}")
            st[k] = v.to(mp.device) if scalars_on_device else v
        st.update(lay["values"])
        optimizer.state[mp] = st
