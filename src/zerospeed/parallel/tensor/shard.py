"""Shard sizes: how a dimension of ``total_size`` splits over a tensor-parallel group (DeepSpeed's rules).

The rules are DeepSpeed's ``module_inject/tp_shard.py`` (0.19.8), so a layer sharded here holds the same
rows as DeepSpeed's AutoTP would give that rank:

* **kv-head aware.** When the model's key/value head count is known, the dimension divides by it and the
  layer is not an MLP / MoE-MLP / lm-head layer (by name), the dimension is cut on head (group) boundaries:
  rank ``r`` gets ``kv // tp + (r < kv % tp)`` head groups of ``total // kv`` rows each. Under GQA the query
  projection (``heads * head_dim`` rows) is cut into the same ``kv`` groups, so each rank's queries stay
  with its keys and values.
* **grain size** otherwise: the dimension is cut in units of ``tp_grain_size`` rows, the first
  ``units % tp`` ranks taking one unit more, and the last rank also taking the ``total % grain`` tail.
* a dimension smaller than the grain is split as evenly as possible.

Unlike DeepSpeed's pre-0.19 ``set_num_kv_heads`` / ``set_tp_grain_size`` globals, the model's numbers
travel in an :class:`AutoTPMeta` value (DeepSpeed 0.19.8 does the same), so two models in one process
never share them. Both call forms work: ``get_shard_size(total, tp, name, rank, meta=meta)`` and
DeepSpeed 0.19.8's ``get_shard_size(total, tp, meta, name, rank)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
                  "num_attention_heads", "n_heads", "attention_heads")
_ATTN_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
_LAST_LINEAR = ("lm_head", "embed_out")
_MOE_MLP = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


class ShardSizeError(ValueError):
    """A dimension (or head count) of a named layer cannot be split over the tensor-parallel group."""


def _first_attr(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


@dataclass(frozen=True)
class AutoTPMeta:
    """A model's numbers that decide its shard sizes: kv heads, query heads, hidden size, grain."""

    num_kv_heads: int | None = None
    num_attention_heads: int | None = None
    n_embd: int | None = None
    tp_grain_size: int = 1

    @classmethod
    def from_model_config(cls, model_config: Any, tp_grain_size: int = 1) -> AutoTPMeta:
        """Read a Hugging Face style config (``text_config`` first when present); None gives the defaults."""
        if model_config is None:
            return cls(tp_grain_size=tp_grain_size)
        model_config = getattr(model_config, "text_config", None) or model_config
        n_embd = _first_attr(model_config, ("n_embd", "hidden_size"))
        return cls(num_kv_heads=_first_attr(model_config, _KV_HEAD_ATTRS),
                   num_attention_heads=_first_attr(model_config, _ATTN_HEAD_ATTRS),
                   n_embd=n_embd, tp_grain_size=tp_grain_size)


def _normalise(name: Any, rank: Any, meta: Any) -> tuple[str | None, int | None, AutoTPMeta]:
    """Accept DeepSpeed 0.19.8's order ``(meta, name, rank)`` as well as ``(name, rank, meta=)``."""
    if isinstance(name, AutoTPMeta):
        name, rank, meta = rank, meta, name
    if meta is None:
        meta = AutoTPMeta()
    if not isinstance(meta, AutoTPMeta):
        raise TypeError(f"meta must be an AutoTPMeta, got {type(meta).__name__}")
    return (None if name is None else str(name)), rank, meta


def _group_rank(mp_size: int, mp_group: Any) -> int:
    from ... import comm  # only when no rank was given

    if mp_group is not None:
        return comm.get_rank(mp_group)
    world = comm.get_world_size()
    if world != mp_size:
        raise ValueError(f"get_shard_size needs a group-local rank or mp_group when mp_size ({mp_size}) differs "
                         f"from the world size ({world})")
    return comm.get_rank()


def get_shard_size(total_size: int, mp_size: int, name: Any = None, rank: Any = None, meta: Any = None,
                   mp_group: Any = None) -> int:
    """Rows of ``total_size`` that tensor-parallel rank ``rank`` (group-local, in ``[0, mp_size)``) holds."""
    name, rank, meta = _normalise(name, rank, meta)
    if mp_size < 1:
        raise ValueError(f"mp_size must be >= 1, got {mp_size}")
    if rank is None:
        rank = _group_rank(mp_size, mp_group)
    kv, grain = meta.num_kv_heads, meta.tp_grain_size
    text = str(name)
    mlp_like = "mlp" in text or text in _LAST_LINEAR or any(s in text for s in _MOE_MLP)
    if kv is not None and total_size % kv == 0 and not mlp_like:
        groups = kv // mp_size + (1 if rank < kv % mp_size else 0)
        return total_size * groups // kv
    if total_size >= grain:
        units, tail = divmod(total_size, grain)
        size = (units // mp_size + (1 if rank < units % mp_size else 0)) * grain
        return size + tail if rank == mp_size - 1 else size
    return total_size // mp_size + (1 if rank < total_size % mp_size else 0)


def get_shard_size_list(total_size: int, mp_size: int, name: Any = None, meta: Any = None) -> list[int]:
    """Every rank's :func:`get_shard_size`, in rank order (they sum to ``total_size``)."""
    if isinstance(name, AutoTPMeta):  # DeepSpeed 0.19.8's order: (total, tp, meta, name)
        name, meta = meta, name
    name, _, meta = _normalise(name, None, meta)
    sizes = [get_shard_size(total_size, mp_size, name, r, meta=meta) for r in range(mp_size)]
    assert sum(sizes) == total_size, (sizes, total_size)
    return sizes


def checked_shard_sizes(total_size: int, mp_size: int, layer: str, what: str, meta: AutoTPMeta | None = None,
                        shard_name: str | None = None) -> tuple[int, ...]:
    """:func:`get_shard_size_list`, refusing a split that leaves a rank with nothing (names layer and numbers).

    ``shard_name`` is the name the size rules see (defaults to ``layer``); ``what`` says which dimension.
    """
    rule_name = layer if shard_name is None else shard_name
    sizes = get_shard_size_list(total_size, mp_size, rule_name, meta=meta)
    if min(sizes) == 0:
        meta = meta or AutoTPMeta()
        extra = f", num_kv_heads={meta.num_kv_heads}" if meta.num_kv_heads is not None else ""
        fits = next(t for t in range(mp_size, 0, -1) if min(get_shard_size_list(total_size, t, rule_name, meta=meta)))
        raise ShardSizeError(
            f"layer '{layer}': {what} of {total_size} cannot be split over tensor-parallel size {mp_size} "
            f"(shard sizes {sizes}, tp_grain_size={meta.tp_grain_size}{extra}); the largest tensor-parallel "
            f"size that gives every rank a share is {fits}")
    return tuple(sizes)


def split_heads(num_heads: int, num_kv_heads: int, mp_size: int, layer: str = "attention") -> list[tuple[int, int]]:
    """Per rank ``(query heads, kv heads)`` under DeepSpeed's kv-head-aware split.

    Key/value heads are dealt out like :func:`get_shard_size` deals head groups (the first
    ``kv % tp`` ranks one more); each rank's query heads are its kv heads times ``heads // kv``.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ShardSizeError(f"layer '{layer}': {num_heads} attention heads are not a multiple of "
                             f"{num_kv_heads} key/value heads")
    if num_kv_heads < mp_size:
        raise ShardSizeError(f"layer '{layer}': {num_kv_heads} key/value heads cannot be split over "
                             f"tensor-parallel size {mp_size} (every rank needs at least one kv head)")
    group = num_heads // num_kv_heads
    out = []
    for r in range(mp_size):
        kv = num_kv_heads // mp_size + (1 if r < num_kv_heads % mp_size else 0)
        out.append((kv * group, kv))
    return out
