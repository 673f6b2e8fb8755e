"""New weights into a served model, in place: whole, or each tensor-parallel rank taking its shard (RL weight sync).

The pushed tensors are full, in the unsplit model's ``state_dict`` names and layout (what a training engine's
``save_16bit_model`` writes). :func:`fit_weights` checks them against the served model before anything changes:
every name known, every parameter covered (a tied alias counts), every shape equal to the *full* shape (a split
parameter's ``TPShardSpec.full_shape``), no float into an integer tensor (quantized codes). Then:

* one rank: :func:`copy_weights` copies each tensor into its parameter (``param.data.copy_``: fused buffers and
  compiled regions keep reading the same storage);
* tensor parallelism: rank 0 of the group owns the request, so it sends the workers (waiting in ``run_worker``)
  a ``WEIGHTS`` message whose payload is the indices, in ``state_dict`` order, of the parameters to load (the
  ranks hold the same model, so the same order), then broadcasts the full tensors in the parameters' dtype,
  in buckets of at most ``BUCKET_BYTES`` (one flat broadcast each); every rank, rank 0 included, keeps its own shard (``partition.shard``: fused QKV per
  sub-matrix, GPT-2's transposed ``Conv1D`` on the stored dimension) and copies it into its parameter.
  Replicated parameters (embeddings, norms, the head, a row-parallel bias) are copied whole. A worker holds one
  bucket of full tensors at a time (64 MiB, or one tensor larger than that). No pickled objects cross the group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from zerospeed import comm
from zerospeed.parallel.tensor import tp_shard_specs
from zerospeed.parallel.tensor.partition import TPShardSpec, shard

from .serving_tp import PlanChannel

__all__ = ["BUCKET_BYTES", "WeightPlan", "buckets", "fit_weights", "copy_weights", "send_weights", "receive_weights"]

BUCKET_BYTES = 64 << 20  # full tensors per broadcast (a larger tensor goes alone)

WeightPlan = list[tuple[int, torch.Tensor]]  # (index in the model's state_dict order, the full tensor)
Target = tuple[str, torch.Tensor, TPShardSpec | None]  # name, the served tensor, its split (None: whole)


def _targets(model: nn.Module) -> list[Target]:
    """The served model's tensors in ``state_dict`` order, each with its tensor-parallel split (or None)."""
    specs = tp_shard_specs(model)
    out: list[Target] = []
    for k, t in model.state_dict(keep_vars=True).items():
        spec = specs.get(k)
        out.append((k, t, spec if spec is not None and spec.dim is not None and spec.tp_size > 1 else None))
    return out


def _full_shape(target: Target) -> tuple[int, ...]:
    _, own, spec = target
    return spec.full_shape if spec is not None else tuple(own.shape)


def fit_weights(model: nn.Module, state: Mapping[str, torch.Tensor]) -> WeightPlan:
    """The tensors of ``state`` to load, one per distinct parameter; ``ValueError`` naming what does not fit."""
    targets = _targets(model)
    own = {target[0]: target for target in targets}
    unknown = sorted(set(state) - set(own))
    covered = {id(own[k][1]) for k in state if k in own}
    missing = sorted(k for k, t, _ in targets if id(t) not in covered)  # a tied alias counts as covered
    shapes, kinds = [], []
    for k, v in state.items():
        if k not in own:
            continue
        target = own[k]
        t = target[1]
        if tuple(v.shape) != _full_shape(target):
            shapes.append(f"{k} {tuple(v.shape)} != {_full_shape(target)}")
        if v.is_floating_point() and not t.is_floating_point():
            kinds.append(f"{k} {v.dtype} into {t.dtype}")
    if unknown or missing or shapes or kinds:
        raise ValueError(f"update_weights: the weights do not fit the served model (unknown: {unknown[:5]}, "
                         f"missing: {missing[:5]}, shapes: {shapes[:5]}, dtypes: {kinds[:5]}); nothing was changed")
    seen: set[int] = set()
    plan: WeightPlan = []
    for i, (k, t, _) in enumerate(targets):
        if k in state and id(t) not in seen:
            seen.add(id(t))
            plan.append((i, state[k]))
    return plan


def _load(target: Target, full: torch.Tensor, rank: int) -> None:
    _, own, spec = target
    own.data.copy_(shard(full, spec, rank) if spec is not None else full)


@torch.no_grad()
def copy_weights(model: nn.Module, plan: WeightPlan) -> None:
    """One rank (no tensor parallelism): every planned tensor into its parameter."""
    targets = _targets(model)
    for i, full in plan:
        _load(targets[i], full, 0)


def buckets(targets: list[Target], indices: list[int], cap: int = BUCKET_BYTES) -> list[list[int]]:
    """``indices`` cut into runs of one dtype and at most ``cap`` bytes of full tensors (a larger tensor alone):
    one broadcast each. Pure, so rank 0 and the workers cut the same runs from the same indices."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i in indices:
        own = targets[i][1]
        nbytes = own.element_size() * _numel(targets[i])
        if not out or own.dtype != dtype or size + nbytes > cap:
            out.append([])
            size, dtype = 0, own.dtype
        out[-1].append(i)
        size += nbytes
    return out


def _numel(target: Target) -> int:
    return math.prod(_full_shape(target))


def _broadcast_bucket(channel: PlanChannel, targets: list[Target], bucket: list[int],
                      fulls: list[torch.Tensor] | None) -> None:
    """One flat broadcast of the bucket's full tensors (rank 0 gives ``fulls``); each rank keeps its shards."""
    dtype = targets[bucket[0]][1].dtype
    if fulls is not None:
        flat = torch.cat([f.to(device=channel.device, dtype=dtype).reshape(-1) for f in fulls])
    else:
        flat = torch.empty(sum(_numel(targets[i]) for i in bucket), dtype=dtype, device=channel.device)
    comm.broadcast(flat, channel.src, channel.group)
    for i, piece in zip(bucket, flat.split([_numel(targets[i]) for i in bucket])):
        _load(targets[i], piece.view(_full_shape(targets[i])), channel.rank)


@torch.no_grad()
def send_weights(channel: PlanChannel, model: nn.Module, plan: WeightPlan) -> None:
    """Rank 0 of the tensor-parallel group: announce the plan, broadcast the full tensors by bucket, keep rank 0's
    shards."""
    targets = _targets(model)
    given = dict(plan)
    channel.send_weights(list(given))
    for bucket in buckets(targets, list(given)):
        _broadcast_bucket(channel, targets, bucket, [given[i] for i in bucket])


@torch.no_grad()
def receive_weights(channel: PlanChannel, model: nn.Module, indices: list[int]) -> None:
    """A worker, after a ``WEIGHTS`` message: receive the buckets rank 0 broadcasts, keep this rank's shards."""
    targets = _targets(model)
    for bucket in buckets(targets, indices):
        _broadcast_bucket(channel, targets, bucket, None)
