"""The module's state-dict entries as the checkpoint sees them, without calling ``state_dict()``.

Under ZeRO-3 a parameter's data is an empty placeholder between uses (and ``state_dict()`` refuses to
run), so entries are walked directly: parameters (tied ones under every name) and persistent buffers,
in ``state_dict`` order, each with its *full* shape. Entries the optimizer owns come from the fp32
master (see ``universal``); the rest (frozen parameters, buffers) are written whole by rank 0 into
``model_states.safetensors``, gathered first when ZeRO-3 partitioned them (a collective). Frozen MoE
expert parameters differ between expert-parallel ranks, so rank 0 cannot write them all: the first rank of
each expert-data-parallel group writes its own experts' into its shard file, as whole ``master/<name>``
entries (fp32, like a master weight), which loading and ``to-fp32`` already read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...parallel.expert.auto.layer import expert_slice
from ...parallel.expert.checkpoint import expert_writers, other_expert_keys, rename
from ...parallel.tensor.checkpoint import full_shapes, saved_shape, transposed_names
from ...zero.stage3 import GatheredParameters, shard_of
from ...zero.stage3.export import state_entries
from .errors import CheckpointError
from .universal import CheckpointReader
from .tensor_file import TensorReader


def entries(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """State entries under their checkpoint names (MoE experts by global expert id)."""
    return rename(state_entries(module), module)


def _other_experts(module: nn.Module) -> list[tuple[str, str]]:
    return other_expert_keys(entries(module), module)


def full_shape(t: torch.Tensor) -> torch.Size:
    """The checkpoint's shape of ``t``: whole under ZeRO-3, all experts for an AutoEP expert slice."""
    ep = expert_slice(t)
    if ep is not None:
        return ep.shape
    s = shard_of(t)
    return s.shape if s is not None else t.shape


def _canonical(module: nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    return {key: first.setdefault(id(t), key) for key, t in entries(module)}


def _gathered(tensors: list[torch.Tensor], modifier_rank: int | None) -> Any:
    sharded = [t for t in tensors if shard_of(t) is not None]
    return GatheredParameters(sharded, modifier_rank=modifier_rank) if sharded else contextlib.nullcontext()


def _expert_keys(module: nn.Module) -> dict[str, int]:
    """Checkpoint names of this rank's expert tensors -> whether this rank writes them (edp rank 0)."""
    return expert_writers(entries(module), module)


def frozen_experts(module: nn.Module, grouped: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """This rank's share of the frozen expert tensors: ``master/<name>`` entries and their ranges.

    Collective over the expert-data-parallel groups when ZeRO-3 partitioned them (every rank must call it).
    """
    writes = _expert_keys(module)
    frozen = [(k, t) for k, t in entries(module) if k in writes and k not in grouped]
    tensors: dict[str, torch.Tensor] = {}
    with _gathered([t for _, t in frozen], None):
        for key, t in frozen:
            if writes[key]:
                tensors[f"master/{key}"] = t.detach().to("cpu", torch.float32, copy=True).reshape(-1)
    return tensors, {k: [0, v.numel()] for k, v in tensors.items()}


def describe(module: nn.Module, grouped: set[str], rank: int, copy: bool, exclude_frozen: bool = False
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Every entry's shape/dtype/source; on rank 0 also the tensors the optimizer does not own (frozen
    experts excepted: :func:`frozen_experts`).

    ``exclude_frozen``: frozen parameters (``requires_grad=False``) get source ``excluded`` and no data.
    Collective when ZeRO-3 partitioned some of those tensors (every rank must call it).
    """
    canon = _canonical(module)
    listing = list(entries(module))
    meta: dict[str, Any] = {}
    experts = _expert_keys(module)
    excluded = {k for k, t in listing if exclude_frozen and canon[k] == k and k not in grouped
                and isinstance(t, nn.Parameter) and not t.requires_grad}
    rest = [(k, t) for k, t in listing if canon[k] == k and k not in grouped and k not in experts and k not in excluded]
    tensors: dict[str, torch.Tensor] = {}
    with _gathered([t for _, t in rest], None):
        for key, t in listing:
            base = canon[key]
            meta[key] = {"shape": list(full_shape(t)), "dtype": str(t.dtype).removeprefix("torch."),
                         "source": "excluded" if base in excluded else
                         "master" if base in grouped or base in experts else "module"}
            if base != key:
                meta[key]["alias_of"] = base
        for key, like in _other_experts(module):  # experts other expert-parallel ranks hold
            meta[key] = dict(meta[like])
        if rank == 0:
            for key, t in rest:
                d = t.detach()
                tensors[key] = d.to("cpu", copy=True) if copy or d.device.type != "cpu" or shard_of(t) else d
    return meta, tensors


def check_names(module: nn.Module, saved: dict[str, Any], strict: bool, partial: bool = False) -> None:
    """The saved entries match the model's names and shapes; ``strict``: none missing, none unexpected
    (``partial``: this module is one pipeline stage of the saved model, so the other stages' are expected)."""
    current = {k: full_shape(t) for k, t in entries(module)}
    current.update({k: current[like] for k, like in _other_experts(module)})
    current.update({k: torch.Size(s) for k, s in full_shapes(module).items() if k in current})
    here_t = transposed_names(module)
    missing = [k for k in current if k not in saved]
    unexpected = [] if partial else [k for k in saved if k not in current]
    if strict and (missing or unexpected):
        more = " (and more)" if len(missing) > 10 or len(unexpected) > 10 else ""
        raise CheckpointError(f"checkpoint does not match the model: missing {missing[:10]}, "
                              f"unexpected {unexpected[:10]}{more}")
    for k, shape in current.items():
        if k in saved and list(shape) != saved_shape(saved[k], k in here_t):
            raise CheckpointError(f"checkpoint tensor {k!r} has shape {saved[k]['shape']}, the model has {list(shape)}")


@torch.no_grad()
def load_rest(module: nn.Module, grouped: set[str], saved: dict[str, Any], module_file: str,
              reader: CheckpointReader) -> None:
    """Frozen parameters and buffers (and parameters now outside any optimizer group). Collective under ZeRO-3.
    Entries saved with ``exclude_frozen_parameters`` keep the model's current values."""
    canon = _canonical(module)
    rest = [(k, t) for k, t in entries(module) if canon[k] == k and k not in grouped and k in saved
            and saved[k].get("source") != "excluded"]
    with TensorReader(module_file) as mf, _gathered([t for _, t in rest], 0):
        for key, t in rest:
            if key in mf.entries:
                src = mf.read(key)
            elif reader.has(f"master/{key}"):
                src = reader.read_range(f"master/{key}", 0, t.numel()).view(t.shape)
            elif reader.has(f"module/{key}"):  # written by its pipeline stage (checkpoint.parallel_write)
                src = reader.read_range(f"module/{key}", 0, t.numel()).view(t.shape)
            else:
                raise CheckpointError(f"checkpoint has no data for {key!r}")
            t.data.copy_(src)
