"""Tensor-parallel shards in the universal checkpoint: saved per shard, reassembled for any tp size.

A split parameter ``p`` is stored as one checkpoint tensor per tensor-parallel rank, each addressed like any
other parameter by element ranges (so ZeRO's data-parallel partitions of a shard are written by their owners)::

    master/<p>@tp<r>of<T>      rank r's shard (its local shape), fp32 master; optim/<state>/... likewise

``meta.json`` lists ``p`` once, with its full shape in the model's layout and ``"tp": {size, dim, widths,
transposed}`` (the ``TPShardSpec`` and whether the model stores the weight transposed, as for Hugging Face's
``Conv1D``). Replicated parameters are saved under their plain names by the first tensor-parallel rank only.

Loading at the same tp size reads the shards back as they are (bitwise). At another size — including a
plain model with no tensor parallelism — :class:`TPReader` serves each key this engine asks for by reading
every saved shard of the parameter, reassembling the full tensor (``unshard``) and cutting this rank's
shard with the new layout (``shard``); ``consolidate`` uses the same reassembly to export full tensors.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

_TP = re.compile(r"^(?P<base>.+)@tp(?P<rank>\d+)of(?P<size>\d+)$")


def shard_name(base: str, rank: int, size: int) -> str:
    return f"{base}@tp{rank}of{size}"


def base_name(name: str) -> str:
    """The parameter name without its tensor-parallel shard suffix."""
    m = _TP.match(name)
    return m.group("base") if m else name


def _state(module: nn.Module) -> Any:
    from .model_init import tp_state

    st = tp_state(module)
    return st if st is not None and st.size > 1 else None


def rename_split(names: dict[int, str], module: nn.Module) -> dict[int, str]:
    """``id(param) -> checkpoint name`` with this rank's shard suffix on every split parameter."""
    st = _state(module)
    if st is None:
        return names
    split = st.split_params(module)
    return {i: shard_name(n, st.rank, st.size) if i in split else n for i, n in names.items()}


def writes_replicated(module: nn.Module) -> bool:
    """Whether this rank writes replicated parameters (the first rank of its tensor-parallel group)."""
    st = _state(module)
    return st is None or st.rank == 0


def describe_split(module: nn.Module, entries: dict[str, Any]) -> None:
    """Give the meta entries of split parameters their full shape and layout (in place)."""
    st = _state(module)
    if st is None:
        return
    for name, spec in st.specs.items():
        if spec.dim is None or name not in entries:
            continue
        entries[name]["shape"] = list(spec.full_shape)
        entries[name]["source"] = "master"
        entries[name]["tp"] = {"size": st.size, "dim": spec.dim, "widths": [list(w) for w in spec.widths],
                               "transposed": name in st.transposed}


def full_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Full shapes (model layout) of this module's split parameters, for the name check on load."""
    st = _state(module)
    return {} if st is None else {n: tuple(s.full_shape) for n, s in st.specs.items() if s.dim is not None}


def transposed_names(module: nn.Module) -> set[str]:
    st = _state(module)
    return set() if st is None else set(st.transposed)


def saved_shape(entry: dict[str, Any], transposed_here: bool) -> list[int]:
    """A saved entry's shape as this model stores it (a transposed ``Conv1D`` weight saved plain, or vice versa)."""
    shape = list(entry["shape"])
    was = bool(entry.get("tp", {}).get("transposed", False))
    return shape[::-1] if was != transposed_here else shape


def remap_layout(layout: dict[str, Any], names: dict[int, str]) -> dict[str, Any]:
    """The saved optimizer-state layout under this engine's names (another tp size: by base name)."""
    by_base = {base_name(k): v for k, v in layout.items()}
    out = dict(layout)
    for n in names.values():
        if n not in out and base_name(n) in by_base:
            out[n] = by_base[base_name(n)]
    return out


class TPReader:
    """A ``CheckpointReader`` that also serves keys of another tensor-parallel layout by reassembly."""

    def __init__(self, inner: Any, saved: dict[str, Any], module: nn.Module | None) -> None:
        self.inner = inner
        self.saved = saved  # meta["tensors"]
        st = _state(module) if module is not None else None
        self.rank = st.rank if st is not None else 0
        self.specs = {} if st is None else {n: s for n, s in st.specs.items() if s.dim is not None}
        self.transposed = set() if st is None else set(st.transposed)
        self._cache: tuple[str, torch.Tensor] | None = None

    @staticmethod
    def _split_key(key: str) -> tuple[str, str]:
        prefix, _, name = key.rpartition("/")
        return prefix, name

    def has(self, key: str) -> bool:
        return self.inner.has(key) or self._pieces(key) is not None

    def _pieces(self, key: str) -> list[str] | None:
        """The saved keys holding ``key``'s parameter, in shard order (one plain key if saved unsplit)."""
        prefix, name = self._split_key(key)
        base = base_name(name)
        tp = self.saved.get(base, {}).get("tp")
        keys = [f"{prefix}/{shard_name(base, r, tp['size'])}" for r in range(tp["size"])] if tp else [f"{prefix}/{base}"]
        return keys if all(self.inner.has(k) for k in keys) else None

    def dtype(self, key: str) -> torch.dtype:
        if self.inner.has(key):
            return self.inner.dtype(key)
        pieces = self._pieces(key)
        if pieces is None:
            return self.inner.dtype(key)  # raises the reader's own error
        return self.inner.dtype(pieces[0])

    def read_scalar(self, key: str) -> torch.Tensor:
        if self.inner.has(key):
            return self.inner.read_scalar(key)
        pieces = self._pieces(key)
        return self.inner.read_scalar(pieces[0] if pieces else key)

    def covers(self, key: str, lo: int, hi: int) -> None:
        """Raise unless ``key``'s elements ``[lo, hi)`` can be read (a reassembled key: all its pieces stored)."""
        if self.inner.has(key) or self._pieces(key) is None:
            self.inner.covers(key, lo, hi)

    def read_range(self, key: str, lo: int, hi: int) -> torch.Tensor:
        if self.inner.has(key):
            return self.inner.read_range(key, lo, hi)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._target(key).reshape(-1))
        return self._cache[1][lo:hi].clone()

    def _full(self, key: str) -> tuple[torch.Tensor, bool]:
        """The whole saved tensor of ``key``'s parameter, and whether it is stored transposed."""
        from .partition import TPShardSpec, unshard

        pieces = self._pieces(key)
        if pieces is None:
            return self.inner.read_range(key, 0, 0), False  # raises: not present
        base = base_name(self._split_key(key)[1])
        entry = self.saved[base]
        tp = entry.get("tp")
        if tp is None:
            shape = entry["shape"]
            n = 1
            for d in shape:
                n *= d
            return self.inner.read_range(pieces[0], 0, n).view(shape), False
        spec = TPShardSpec(tuple(entry["shape"]), tp["dim"], tuple(tuple(w) for w in tp["widths"]))
        shards = []
        for r, k in enumerate(pieces):
            shape = spec.local_shape(r)
            n = 1
            for d in shape:
                n *= d
            shards.append(self.inner.read_range(k, 0, n).view(shape))
        return unshard(shards, spec), bool(tp["transposed"])

    def _target(self, key: str) -> torch.Tensor:
        """This rank's tensor for ``key`` in this model's layout."""
        from .partition import shard

        full, was_t = self._full(key)
        base = base_name(self._split_key(key)[1])
        if was_t != (base in self.transposed):
            full = full.t()
        spec = self.specs.get(base)
        return shard(full.contiguous(), spec, self.rank) if spec is not None else full

    def close(self) -> None:
        self.inner.close()
