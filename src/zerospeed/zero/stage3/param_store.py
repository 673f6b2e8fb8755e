"""Each parameter's storage under ZeRO-3: a local shard and an explicit state, checked at each transition.

A parameter of ``n`` elements is cut as in the partition plan: shard size ``s = ceil(n / N)``, rank
``r`` owns flattened elements ``[r*s, (r+1)*s)``, zero-padded to ``s``. The shard lives in a
:class:`ParamShard`, kept in a side table keyed by the parameter (never attributes on the parameter):

* ``SHARDED``: the ``nn.Parameter``'s data is an empty placeholder (shape ``(0,)``, same dtype and
  device); the real shape is kept in the state object;
* ``GATHERING``: an all-gather of the shard is in flight (a prefetch);
* ``GATHERED``: the parameter's data is the full tensor; it stays so while any *holder* (a module
  running forward or backward, a ``GatheredParameters`` block) holds it.

A *persistent* parameter (no more elements than ``stage3_param_persistence_threshold``, or any
parameter at world size 1 without parameter offload) is never cut: it is always ``GATHERED`` and has no
separate shard.

Under parameter offload (ZeRO-Infinity) a shard has a *home* (:class:`ShardHome`, implemented in
``offload/param_home.py``): host memory or a swap file. Between uses ``local`` is then an empty
placeholder (``resident`` is False); a gather loads the shards first and drops them once the full value
is there; a new shard value (after the optimizer step) is written to the home.

ZeRO++ hpZ (``zero_hpz_partition_size``): a shard with an :class:`HpzGroup` also keeps a *secondary*
partition of the parameter over that node-sized group (rank ``i`` of the group owns elements
``[i*t, (i+1)*t)``, ``t = ceil(n / group size)``), cut from the full value whenever the parameter leaves
``GATHERED`` and none is held. While it is held, gathers read it over the intra-node group instead of the
primary shard over all ranks. A new value of the parameter (the optimizer step, a modifier) drops it, so
the first forward after a step gathers across nodes and its release refills the secondary for backward
(DeepSpeed's ``ds_secondary_tensor``).

A shard with a *codec* (``weight_quantization.quantized_initialization``, ``quantized_shard.py``) holds the
parameter's packed bytes (codes and scales) instead of its elements: ``stored_numel`` bytes are cut as above,
a gather moves bytes and decodes them into the full (float) value, a write-back encodes the full value again.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ... import comm
from ...accelerator.huge_pages import advise_huge_pages, empty_buffer
from ..layout import gather_from
from ..partition import shard_size
from ...compat.zero_param_attrs import expose_ds_attributes

if TYPE_CHECKING:
    from .lockstep import Lockstep
    from .quantized_shard import WeightCodec


class ShardState(Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class ShardHome(Protocol):
    """Where offloaded shards live between uses (host memory or swap files)."""

    read_ahead_numel: int

    def adopt(self, shard: ParamShard) -> None: ...  # take ``shard.local`` in, leave a placeholder
    def load(self, shards: Sequence[ParamShard]) -> None: ...  # make ``local`` resident (raises on I/O error)
    def prefetch(self, shards: Sequence[ParamShard]) -> None: ...  # start reading, do not wait
    def evict(self, shard: ParamShard) -> None: ...  # drop the resident copy
    def store(self, shard: ParamShard, values: torch.Tensor) -> None: ...  # new shard value (flat)


@dataclass(frozen=True)
class HpzGroup:
    """The node-sized group a secondary partition is cut over (hpZ), and this rank's place in it."""

    group: comm.Group
    world: int
    rank: int


class ParamShard:
    """One parameter's ZeRO-3 state: shape, this rank's shard, who holds it gathered."""

    def __init__(self, param: nn.Parameter, group: comm.Group | None, persistent: bool) -> None:
        self._param = weakref.ref(param)
        self.shape = param.shape
        self.numel = param.numel()
        self.group = group
        self.world = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.persistent = persistent
        self.shard = shard_size(self.numel, self.world)
        self.local: torch.Tensor | None = None
        self.home: ShardHome | None = None  # parameter offload: where the shard lives between uses
        self.home_key = ""
        self.resident = True  # False while an offloaded shard is only in its home
        self.state = ShardState.GATHERED
        self.holders: set[object] = set()
        self.pending: GatherOp | None = None
        self.gathers = 0  # all-gathers that brought this parameter in (for tests and reports)
        self.lockstep: Lockstep | None = None  # checks that every rank gathers the same (set by setup)
        # The gathered value's buffer: freed by shrinking its storage (autograd's saved views of the weight,
        # e.g. ``W.t()`` in a linear layer, would otherwise keep every gathered weight alive from forward to
        # backward), and refilled in place by the next gather so those views see the value again.
        self._full: torch.Tensor | None = None
        # Called after the full value changed outside training (GatheredParameters with a modifier).
        self.on_modified: list[object] = []
        # ZeRO++ qwZ ("int8") or fp8.allgather_fp8 ("fp8"): the fetcher's gathers move quantised blocks
        # (comm/quantized.py); False: exact
        self.quantize_gather: str | bool = False
        self.hpz: HpzGroup | None = None  # ZeRO++ hpZ: the group of the secondary partition (set by setup)
        self.secondary: torch.Tensor | None = None  # this rank's secondary partition, while valid
        self.full_exact = True  # the gathered value is exact (not dequantised from a qwZ gather)
        # stage3_use_all_reduce_for_fetch_params: a gather of several parameters is one all-reduce of a zeroed
        # buffer holding this rank's shards; stage3_allgather_sequential: one collective per parameter
        self.fetch_all_reduce = False
        self.fetch_sequential = False
        self.levels: comm.Hierarchy | None = None  # MiCS hierarchical gather: across nodes, then inside the node
        self.sanity_checks = False  # zero_optimization.enable_sanity_checks (zero/stage3/sanity.py)
        self.secondary_exact = True  # the secondary was cut from an exact value: exact gathers may use it
        self.codec: WeightCodec | None = None  # quantized_initialization: the shard holds packed codes and scales

    def set_codec(self, codec: WeightCodec) -> None:
        """Before the first cut: keep the partition quantized (its shard: ``codec.nbytes / N`` bytes)."""
        if self.local is not None or self.persistent:
            raise RuntimeError("a quantized partition is set before the parameter is first cut, and never persistent")
        self.codec = codec
        self.shard = shard_size(codec.nbytes, self.world)

    @property
    def stored_numel(self) -> int:
        """Elements of the value that is cut: the parameter's, or its packed bytes with a codec."""
        return self.numel if self.codec is None else self.codec.nbytes

    @property
    def value_dtype(self) -> torch.dtype:
        """The gathered value's dtype (with a codec, not the stored bytes' ``dtype``)."""
        return self.dtype if self.codec is None else self.codec.dtype

    @property
    def secondary_shard(self) -> int:
        assert self.hpz is not None
        return shard_size(self.numel, self.hpz.world)

    @torch.no_grad()
    def _cut_secondary(self) -> None:
        """hpZ: keep this rank's slice of the (gathered) full value for gathers inside the node."""
        assert self.hpz is not None
        t = self.secondary_shard
        lo = min(self.hpz.rank * t, self.numel)
        hi = min(lo + t, self.numel)
        sec = torch.zeros(t, dtype=self.param.dtype, device=self.param.device)
        if hi > lo:
            sec[: hi - lo].copy_(self.param.data.reshape(-1)[lo:hi])
        self.secondary = sec
        self.secondary_exact = self.full_exact

    def drop_secondary(self) -> None:
        """The parameter's value changed (optimizer step, modifier): the secondary partition is stale."""
        self.secondary = None

    @property
    def param(self) -> nn.Parameter:
        p = self._param()
        if p is None:
            raise RuntimeError("the parameter of this ZeRO-3 shard no longer exists")
        return p

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype if self.local is not None else self.param.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device if self.local is not None else self.param.device

    def owned_range(self) -> tuple[int, int]:
        n = self.stored_numel
        lo = min(self.rank * self.shard, n)
        return lo, min(lo + self.shard, n)

    def _expect(self, *states: ShardState, action: str) -> None:
        if self.state not in states:
            raise RuntimeError(f"ZeRO-3 parameter of shape {tuple(self.shape)}: cannot {action} while "
                               f"{self.state.value} (expected {' or '.join(s.value for s in states)})")

    # --- transitions -------------------------------------------------------------------------------
    @torch.no_grad()
    def cut(self) -> None:
        """GATHERED -> SHARDED the first time: keep this rank's slice of the full data, free the rest."""
        self._expect(ShardState.GATHERED, action="partition")
        if self.persistent or self.local is not None:
            raise RuntimeError("parameter is persistent or already partitioned")
        p = self.param
        self.local = torch.zeros(self.shard, dtype=p.dtype if self.codec is None else torch.uint8, device=p.device)
        self.refresh_local()
        self._free()

    @torch.no_grad()
    def refresh_local(self) -> None:
        """Copy this rank's slice of the (gathered) full value into the local shard."""
        if self.local is not None:
            self.write_full(self.param.data)

    @torch.no_grad()
    def write_full(self, value: torch.Tensor) -> None:
        """Set the shard to this rank's slice of the full value ``value`` (encoded first with a codec)."""
        lo, hi = self.owned_range()
        full = value.reshape(-1) if self.codec is None else self.codec.encode(value)
        values = torch.zeros(self.shard, dtype=self.dtype, device=self.device)
        if hi > lo:
            values[: hi - lo].copy_(full[lo:hi])
        self.write_local(values)

    @torch.no_grad()
    def write_local(self, values: torch.Tensor) -> None:
        """Set the shard to ``values`` (flat, ``shard`` elements): in place, or written to its home."""
        assert self.local is not None, "only a partitioned parameter has a local shard"
        self.drop_secondary()
        if self.home is None:
            self.local.copy_(values.reshape(-1))
        else:
            self.home.store(self, values.reshape(-1).to(self.dtype))

    @contextmanager
    def loaded(self) -> Iterator[torch.Tensor]:
        """The local shard, read from its home for the block when it is offloaded."""
        assert self.local is not None, "only a partitioned parameter has a local shard"
        if self.home is None or self.resident:
            yield self.local
            return
        self.home.load([self])
        try:
            yield self.local
        finally:
            self.home.evict(self)

    def set_full(self, full: torch.Tensor) -> None:
        """SHARDED/GATHERING -> GATHERED with ``full`` (flat, ``numel`` elements) as the data."""
        self._expect(ShardState.SHARDED, ShardState.GATHERING, action="set the gathered value")
        self.param.data = full.view(self.shape)
        self.state = ShardState.GATHERED
        self.pending = None
        self.full_exact = True

    def release(self) -> None:
        """GATHERED -> SHARDED when nobody holds it any more (persistent parameters stay)."""
        if self.persistent or self.holders or self.state is not ShardState.GATHERED:
            return
        self._free()

    def hand_off_full(self) -> None:
        """References taken while gathered (a state dict built inside ``GatheredParameters``) keep their data:
        the current full buffer is handed to them instead of being shrunk at release; the next gather
        allocates a new one (DeepSpeed swaps ``param.data`` the same way)."""
        if self._full is not None and self.param.data.numel() and self.param.data.data_ptr() == self._full.data_ptr():
            self._full = None

    def full_buffer(self) -> torch.Tensor:
        """Where the next gather writes the full value (the previous buffer, storage grown back)."""
        buf = self._full
        if buf is None or buf.dtype != self.value_dtype or buf.device != self.device:
            self._full = empty_buffer(self.numel, self.value_dtype, self.device)
            return self._full
        if buf.untyped_storage().nbytes() == 0:
            buf.untyped_storage().resize_(self.numel * buf.element_size())
            advise_huge_pages(buf)  # fresh memory, not yet touched
        return buf

    def abandon(self) -> None:
        """After an error: no holders, no gather in flight (dropped unfinished), the full value freed."""
        self.holders.clear()
        if self.state is ShardState.GATHERING:
            self.pending = None
            self.state = ShardState.SHARDED
            if self.home is not None and self.resident:
                self.home.evict(self)  # read in for the abandoned gather
        self.release()

    def drop_buffer(self) -> None:
        """Give back the memory of the last gathered value (only while SHARDED: nothing can read it)."""
        if self.state is ShardState.SHARDED and self._full is not None:
            self._full.untyped_storage().resize_(0)

    def _free(self) -> None:
        if self.hpz is not None and self.codec is None and self.secondary is None and self.state is ShardState.GATHERED \
                and self.param.data.numel() == self.numel:
            self._cut_secondary()
        if self._full is not None and self.param.data.untyped_storage() is not None and \
                self.param.data.data_ptr() == self._full.data_ptr():
            self._full.untyped_storage().resize_(0)
        p = self.param
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.state = ShardState.SHARDED

    def cast_(self, dtype: torch.dtype, device: torch.device) -> None:
        """Move/cast the stored value (shard, or full data when persistent or gathered); with a codec the packed
        bytes only move, and later gathers decode to ``dtype``."""
        value_dtype = dtype
        if self.codec is not None:
            self.codec.dtype = dtype
            dtype = self.dtype
        if self.local is not None and self.home is not None and (self.dtype != dtype or self.device != device):
            with self.loaded() as local:
                values = local.to(device=device, dtype=dtype)
            self.local = torch.empty(0, dtype=dtype, device=device)
            self.home.store(self, values)
        elif self.local is not None:
            self.local = self.local.to(device=device, dtype=dtype)
        if self.secondary is not None:
            self.secondary = self.secondary.to(device=device, dtype=dtype)
        p = self.param
        if p.dtype != value_dtype or p.device != device:
            p.data = p.data.to(device=device, dtype=value_dtype)

    def local_bytes(self) -> int:
        """Bytes this rank keeps for the parameter between uses (hpZ: with its secondary partition)."""
        if self.local is not None:
            sec = 0 if self.secondary is None else self.secondary.numel() * self.secondary.element_size()
            return self.local.numel() * self.local.element_size() + sec
        p = self.param
        return p.numel() * p.element_size()


_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def shard_of(param: torch.Tensor) -> ParamShard | None:
    """The ZeRO-3 state of ``param``, or None when it is an ordinary (unpartitioned) tensor."""
    return _SHARDS.get(param)


def register(param: nn.Parameter, group: comm.Group | None, persistent: bool) -> ParamShard:
    state = _SHARDS.get(param)
    if state is None:
        state = ParamShard(param, group, persistent)
        _SHARDS[param] = state
        expose_ds_attributes(param)  # DeepSpeed's read-only ds_* view of this state (compat/zero_param_attrs.py)
    return state


def partition(param: nn.Parameter, group: comm.Group | None, persistent: bool) -> ParamShard:
    """Register ``param`` (its full value identical on every rank) and, unless persistent, cut it."""
    state = register(param, group, persistent)
    if not persistent and state.local is None:
        state.cut()
    return state


class GatherOp:
    """One all-gather bringing in several parameters (same dtype, device and group): a single collective."""

    def __init__(self, shards: Sequence[ParamShard], async_op: bool, quantize: str | bool = False,
                 secondary: bool = False) -> None:
        for s in shards:
            s._expect(ShardState.SHARDED, action="start a gather")
            assert s.local is not None
        if shards[0].lockstep is not None:
            shards[0].lockstep.before_gather(shards)  # raises on every rank if the ranks diverged
        self.shards = list(shards) if secondary else _storage_order(list(shards))
        for home, group in _by_home(self.shards).items():
            home.load(group)  # offloaded shards: read them in (prefetched reads are waited for)
        first = self.shards[0]
        assert not secondary or all(s.secondary is not None for s in self.shards), "hpZ gather without secondaries"
        self.quantize = quantize
        self.world = first.hpz.world if secondary and first.hpz is not None else first.world
        self.widths = [s.secondary_shard if secondary else s.shard for s in self.shards]
        self.cols = []
        col = 0
        for w in self.widths:
            self.cols.append(col)
            col += w
        self.width = col
        parts = [s.secondary if secondary else s.local for s in self.shards]
        group = first.hpz.group if secondary and first.hpz is not None else first.group
        self.fulls: list[torch.Tensor] | None = None
        self.out: torch.Tensor | None = None
        self.send: torch.Tensor | None = None
        exact = first.codec is None  # packed bytes (quantized_initialization) travel as they are, then decode
        if first.fetch_all_reduce and exact and not quantize and not secondary and len(self.shards) > 1:
            self._gather_all_reduce(parts, group, async_op)  # DeepSpeed: coalesced, exact, primary gathers only
        elif exact and not quantize and not secondary and all(s.home is None for s in self.shards) and first.levels is None \
                and comm.gathers_in_place(first.local, group):  # type: ignore[arg-type]
            self._gather_in_place(group, async_op)
        else:
            self._gather_buffered(parts, group, async_op, quantize)
        for s in self.shards:
            s.state = ShardState.GATHERING
            s.pending = self
            s.gathers += 1

    def _gather_in_place(self, group: comm.Group | None, async_op: bool) -> None:
        """Gloo: each (parameter, rank) shard broadcast straight into the parameter's full buffer (no staging
        buffer, no unpack); this rank's own shard is copied from its local shard."""
        self.fulls = [s.full_buffer() for s in self.shards]
        pieces: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        with ExitStack() as keep:  # the buffers may be saved for backward: writing them is not a modification
            for s, full in zip(self.shards, self.fulls):
                keep.enter_context(torch.autograd._unsafe_preserve_version_counter(full))
                for r in range(self.world):
                    lo, hi = min(r * s.shard, s.numel), min((r + 1) * s.shard, s.numel)
                    if hi > lo:
                        pieces[r].append(full[lo:hi])
                lo, hi = min(s.rank * s.shard, s.numel), min((s.rank + 1) * s.shard, s.numel)
                if hi > lo:
                    full[lo:hi].copy_(s.local[:hi - lo])  # type: ignore[index]
            self.handle = comm.all_gather_in_place(pieces, group, async_op=async_op)

    def _gather_buffered(self, parts: list[torch.Tensor | None], group: comm.Group | None, async_op: bool,
                         quantize: str | bool) -> None:
        first = self.shards[0]
        send = _joined(parts)  # type: ignore[arg-type]
        self.out = empty_buffer(self.width * self.world, first.dtype, first.device)
        self.send = send  # kept alive while the collective runs
        if quantize:
            codec = quantize if isinstance(quantize, str) else "int8"
            self.handle = comm.quantized_all_gather(self.out, send, group=group, async_op=async_op, codec=codec)
        elif first.levels is not None and group is first.group:
            comm.hierarchical_all_gather(self.out, send, first.levels)  # MiCS: two levels, the same rank order
            self.handle = None
        else:
            self.handle = comm.all_gather(self.out, send, group=group, async_op=async_op)

    def _gather_all_reduce(self, parts: list[torch.Tensor | None], group: comm.Group | None, async_op: bool) -> None:
        """All-reduce (sum) of a zeroed ``(world, width)`` buffer whose row ``rank`` is this rank's shards: the
        same layout an all-gather fills, so ``finish`` unpacks it alike."""
        first = self.shards[0]
        self.out = torch.zeros(self.world * self.width, dtype=first.dtype, device=first.device)
        self.out.view(self.world, self.width)[first.rank].copy_(_joined(parts))  # type: ignore[arg-type]
        self.handle = comm.all_reduce(self.out, group=group, async_op=async_op)

    def numel(self) -> int:
        return self.width * self.world

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the collective and hand every parameter its full value (idempotent)."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        self.send = None
        for s in self.shards:
            if s.home is not None and s.resident:
                s.home.evict(s)  # the shard was read for this gather only
        if self.fulls is not None:
            for s, full in zip(self.shards, self.fulls):
                if s.pending is self:
                    s.set_full(full)
            self.fulls = None
            return
        if self.out is None:
            return
        out2d = self.out.view(self.world, self.width)
        for s, col, width in zip(self.shards, self.cols, self.widths):
            if s.pending is not self:
                continue
            full = s.full_buffer()
            with torch.autograd._unsafe_preserve_version_counter(full):
                if s.codec is None:
                    gather_from(out2d, col, width, full)
                else:
                    packed = torch.empty(s.stored_numel, dtype=s.dtype, device=s.device)
                    gather_from(out2d, col, width, packed)
                    s.codec.decode(packed, full)
            s.set_full(full)
            s.full_exact = not self.quantize
        self.out = None


def _storage_order(shards: list[ParamShard]) -> list[ParamShard]:
    """Shards that are slices of one storage (fp32 shards aliased to the master) in storage order, the same on
    every rank (offsets come from the partition plan), so that their concatenation is a view; else as given."""
    locals_ = [s.local for s in shards]
    if len(shards) < 2 or any(t is None for t in locals_):
        return shards
    base = locals_[0].untyped_storage().data_ptr()  # type: ignore[union-attr]
    if any(t.untyped_storage().data_ptr() != base for t in locals_):  # type: ignore[union-attr]
        return shards
    return sorted(shards, key=lambda s: s.local.storage_offset())  # type: ignore[union-attr]


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, as a view when the parts are adjacent 1-D slices of one storage (no copy)."""
    if len(parts) == 1:
        return parts[0]
    first, end = parts[0], parts[0].storage_offset()
    for t in parts:
        if t.dim() != 1 or not t.is_contiguous() or t.storage_offset() != end \
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return torch.cat(parts)
        end += t.numel()
    return first.as_strided((end - first.storage_offset(),), (1,), first.storage_offset())


def _by_home(shards: Iterable[ParamShard]) -> dict[ShardHome, list[ParamShard]]:
    out: dict[ShardHome, list[ParamShard]] = {}
    for s in shards:
        if s.home is not None and not s.resident:
            out.setdefault(s.home, []).append(s)
    return out


def start_gather(shards: Iterable[ParamShard], async_op: bool, quantize: bool = False) -> list[GatherOp]:
    """Launch gathers for the SHARDED ones among ``shards``, one collective per (dtype, device, group, hpZ
    secondary or not); with ``quantize`` (the fetcher's forward/backward gathers) shards marked ``quantize_gather`` go
    quantised (int8 or fp8 blocks)."""
    buckets: dict[tuple[torch.dtype, torch.device, int, bool, bool, int], list[ParamShard]] = {}
    seen: set[int] = set()
    for s in shards:
        if s.state is ShardState.SHARDED and id(s) not in seen:
            seen.add(id(s))
            lossy = bool(quantize and s.quantize_gather and s.codec is None)  # packed codes are not re-quantized
            # hpZ: an exact gather (GatheredParameters, exports, no qwZ) never reads a secondary cut from a
            # dequantised value
            secondary = s.secondary is not None and (lossy or s.secondary_exact)
            alone = id(s) if s.fetch_sequential else 0  # stage3_allgather_sequential: a collective of its own
            buckets.setdefault((s.dtype, s.device, id(s.group), lossy, secondary, alone), []).append(s)
    return [GatherOp(b, async_op, key[3], key[4]) for key, b in buckets.items()]


def ensure_gathered(shards: Iterable[ParamShard], quantize: bool = False) -> None:
    """Block until every shard is GATHERED (finishing prefetches, gathering the rest now)."""
    shards = list(shards)
    for op in start_gather(shards, async_op=False, quantize=quantize):
        op.finish()
    for s in shards:
        if s.state is ShardState.GATHERING and s.pending is not None:
            s.pending.finish()
