"""Where a micro-step's gradients are packed before their bucket's collective: one store per transport.

Each group's buckets are either views of one *full-size* buffer (the whole padded group, rank-major:
gradients accumulate there over micro-steps and the bucket is reduced once per accumulation window) or
*transient* buffers, made when the bucket's first gradient arrives and let go once its collective is done
(reduced every micro-step, about two buckets alive at a time). Which groups get which, and whether
transient groups turn full on the first micro-step that does not communicate (``local_accumulation``),
is decided by ``zero/reducer_parts.py``; the store itself does not know the stage.

The buffers hold the accumulation dtype; each bucket is *sent* in its communication dtype
(:meth:`BucketStore.comm_dtype`): the reducer's, or the bucket's own where its group says so
(``ShardedGroup.bucket_comm_dtypes``: the gradients of ``torch_autocast``'s lower-precision-safe modules).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..accelerator.huge_pages import empty_buffer, zeros_buffer
from .layout import padding_ranges
from .sharded_group import ShardedGroup


class BucketStore:
    def __init__(self, groups: Sequence[ShardedGroup], dtype: torch.dtype, full: Sequence[bool],
                 reduces_every_micro_step: bool, promotes: bool = False, comm_dtype: torch.dtype | None = None) -> None:
        """``full[g]``: group g has a full-size buffer; ``reduces_every_micro_step``: transient buckets must be
        reduced on every micro-step; ``promotes``: the first micro-step that does not end a window makes the
        missing full-size buffers, and from then on the store accumulates locally; ``comm_dtype``: the dtype
        buckets are sent in unless their group names one (None: ``dtype``)."""
        self.groups, self.dtype = groups, dtype
        self.default_comm = dtype if comm_dtype is None else comm_dtype
        self.full: list[torch.Tensor | None] = [
            zeros_buffer(g.plan.padded_numel, dtype, g.device) if f else None for g, f in zip(groups, full)]
        self.every = reduces_every_micro_step
        self.promotes = promotes
        self.accumulates_locally = False  # promoted: every group has its full-size buffer now
        self.holding = False  # hold() .. release(): nothing is reduced before the window ends
        self.held: list[int] = []  # groups given a full-size buffer by hold(), until release()
        self.staging: dict[tuple[int, int], torch.Tensor] = {}
        # Transient buffers whose collective has completed, for the next buckets of the same micro-step (a
        # fresh host buffer costs a page fault per 4 KiB on first touch: ~10x the copy that fills it); let
        # go at the end of the micro-step, so none is held through the next forward.
        self.spare: list[torch.Tensor] = []
        self.pads: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        # A partitioned group's full buffer is not zeroed after the step (a pass over the whole group that the
        # next window's first gradients would overwrite): it is *stale* instead. Each parameter's first gradient
        # of the window is copied in, and a bucket's other columns (no gradient yet, padding) are zeroed when
        # the bucket is launched or its block is read (``zero_missing``, ``clean_block``).
        self.stale = [False] * len(groups)
        self.valued: set[tuple[int, int]] = set()  # stale-buffer blocks zeroed by clean_block this window

    @property
    def holds_window(self) -> bool:
        """Whether a bucket's contents are the whole window's sum (reduced once: the result replaces)."""
        return not self.every or self.accumulates_locally

    def begin(self, communicate: bool) -> bool:
        """A micro-step starts; returns whether its buckets are reduced (``communicate``: it ends a window)."""
        if self.promotes and not communicate and not self.accumulates_locally:
            assert not self.staging, "full buffers are made between micro-steps"
            for g, grp in enumerate(self.groups):
                if self.full[g] is None:
                    self.full[g] = torch.zeros(grp.plan.padded_numel, dtype=self.dtype, device=grp.device)
            self.accumulates_locally = True
        return communicate or not (self.holds_window or self.holding)

    def hold(self) -> None:
        """Keep gradients locally until :meth:`release` (``coalesce_grad_reduction``): transient groups get a
        full-size buffer for the time being (a store that holds the window already needs nothing)."""
        if self.holds_window or self.holding:
            return
        assert not self.staging, "full buffers are made between micro-steps"
        self.holding = True
        self.held = [g for g, full in enumerate(self.full) if full is None]
        for g in self.held:
            grp = self.groups[g]
            self.full[g] = torch.zeros(grp.plan.padded_numel, dtype=self.dtype, device=grp.device)

    def release(self) -> None:
        """After the held gradients were reduced: back to transient buffers."""
        for g in self.held:
            self.full[g] = None
        self.held, self.holding = [], False

    def comm_dtype(self, g: int, b: int) -> torch.dtype:
        """The dtype bucket (g, b) is reduced in."""
        own = getattr(self.groups[g], "bucket_comm_dtypes", ())
        return (own[b] if b < len(own) else None) or self.default_comm

    def is_transient(self, g: int) -> bool:
        return self.full[g] is None

    def uninitialised(self, g: int, key: tuple[int, int], got: set[tuple[int, int]],
                      window_got: set[tuple[int, int]]) -> bool:
        """Whether parameter ``key``'s columns hold no value yet (its gradient is copied in, not added)."""
        if key in got:
            return False
        return self.full[g] is None or (self.stale[g] and key not in window_got and key not in self.valued)

    def bucket(self, g: int, b: int) -> torch.Tensor:
        """Bucket (g, b)'s buffer (rank-major: ``view(num_partitions, shard_numel)``)."""
        grp = self.groups[g]
        bucket = grp.plan.buckets[b]
        n = grp.num_partitions
        full = self.full[g]
        if full is not None:
            return full[n * bucket.partition_offset: n * (bucket.partition_offset + bucket.shard_numel)]
        buf = self.staging.get((g, b))
        if buf is None:  # uninitialised: each gradient is copied in (not added to zeros); the padding is zeroed
            buf = self._spare(n * bucket.shard_numel, grp.device)
            view = buf.view(n, bucket.shard_numel)
            for row, lo, hi in self._padding(g, b):
                view[row:, lo:hi].zero_()
            self.staging[(g, b)] = buf
        return buf

    def _spare(self, numel: int, device: torch.device) -> torch.Tensor:
        for k, t in enumerate(self.spare):
            if t.numel() >= numel and t.device == device:
                return self.spare.pop(k)[:numel]
        return empty_buffer(numel, self.dtype, device)

    def _padding(self, g: int, b: int) -> list[tuple[int, int, int]]:
        pads = self.pads.get((g, b))
        if pads is None:
            grp = self.groups[g]
            pads = self.pads[(g, b)] = padding_ranges((grp.plan.slots[i] for i in grp.plan.buckets[b].params),
                                                      grp.num_partitions)
        return pads

    def zero_missing(self, g: int, b: int, got: set[tuple[int, int]],
                     window_got: set[tuple[int, int]]) -> None:
        """Before a bucket is reduced: zero the columns of parameters that sent no gradient (a transient bucket's
        this micro-step; a stale full buffer's this window, and its padding)."""
        if self.full[g] is not None and not self.stale[g]:
            return
        grp = self.groups[g]
        view = self.bucket(g, b).view(grp.num_partitions, grp.plan.buckets[b].shard_numel)
        stale = self.full[g] is not None
        for i in grp.plan.buckets[b].params:
            if (g, i) not in got and not (stale and ((g, i) in window_got or (g, i) in self.valued)):
                slot = grp.plan.slots[i]
                view[:, slot.offset: slot.offset + slot.shard].zero_()
        if stale:
            for row, lo, hi in self._padding(g, b):
                view[row:, lo:hi].zero_()

    def clean_block(self, g: int, i: int, got: set[tuple[int, int]], window_got: set[tuple[int, int]]) -> None:
        """Before parameter i's block of a stale full buffer is read or accumulated into: zeros if it has no
        gradient this window."""
        if self.full[g] is not None and self.uninitialised(g, (g, i), got, window_got):
            grp = self.groups[g]
            slot = grp.plan.slots[i]
            width = grp.plan.buckets[slot.bucket].shard_numel
            self.bucket(g, slot.bucket).view(grp.num_partitions, width)[:, slot.offset: slot.offset + slot.shard].zero_()
            self.valued.add((g, i))  # now a value (zero): later gradients add to it

    def retire(self, g: int, b: int) -> None:
        """Bucket (g, b)'s transient buffer is spent: keep it for the next bucket of this micro-step."""
        buf = self.staging.pop((g, b), None)
        if buf is not None:
            base = buf._base if buf._base is not None else buf
            self.spare.append(base if base.dim() == 1 and base.dtype == buf.dtype else buf)

    def end_micro_step(self) -> None:
        self.spare.clear()

    def zero(self) -> None:
        self.valued.clear()
        for g, full in enumerate(self.full):
            if full is None:
                continue
            if self.groups[g].num_partitions > 1:
                self.stale[g] = True  # see __init__: zeroed column by column as the next window needs
            else:  # one partition: the buffer is the reduced gradient itself (partition_buffer), read whole
                full.zero_()
        self.staging.clear()
        self.spare.clear()

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (t for t in self.full if t is not None)
        yield from self.staging.values()
