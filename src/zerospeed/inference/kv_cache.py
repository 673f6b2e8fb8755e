"""Paged (block) KV cache: a block allocator, the cache tensors, and attention over a ragged batch.

The cache holds, per layer and kv head, ``num_blocks * block_size`` slots of ``head_dim`` keys and values
(``[layers, kv_heads, slots, head_dim]``, so a sequence's gathered keys are already ``[heads, len, dim]``).
A sequence owns a *block table* (a list of block ids); its token at position ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``. So sequences grow one block at a time, share no
slots, and give their blocks back when they finish or are cancelled — no per-sequence contiguous buffer.

A ``RaggedBatch`` is one forward's worth of work: the new tokens of several sequences concatenated, each
sequence described by ``(block table, start position, number of new tokens)``. ``attend`` writes the new
keys/values into their slots, then lets each sequence's queries see its cached positions ``<=`` their own.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .workspace import Workspace

__all__ = ["BlockAllocator", "KVCacheOutOfBlocks", "PagedKVCache", "RaggedBatch", "SeqChunk", "blocks_needed",
           "long_tensor"]


class KVCacheOutOfBlocks(RuntimeError):
    """The allocator cannot hand out the blocks asked for."""


def long_tensor(values: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.long)`` for a flat list of ints, ~3x faster (through a C array:
    ``torch.tensor`` converts a list element by element; 768 ints: ~17 us against ~56 us)."""
    t = torch.frombuffer(array.array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
    return t if torch.device(device).type == "cpu" else t.to(device)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockAllocator:
    """Hands out block ids ``0..num_blocks-1`` and takes them back; pure bookkeeping, no tensors."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise KVCacheOutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated (double free?)")
            self._used.remove(b)
            self._free.append(b)


class SeqChunk(NamedTuple):  # a named tuple: built per sequence per step, ~4x cheaper than a frozen dataclass
    """``length`` new tokens of one sequence at positions ``start .. start+length-1``."""

    block_table: tuple[int, ...]
    start: int
    length: int


@dataclass
class RaggedBatch:
    """The flat tokens of one forward and the sequences they belong to (in order)."""

    token_ids: torch.Tensor  # [T] long
    chunks: list[SeqChunk]
    positions: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        total = sum(c.length for c in self.chunks)
        if total != self.token_ids.numel():
            raise ValueError(f"{self.token_ids.numel()} tokens but the chunks cover {total}")
        pos: list[int] = []
        for c in self.chunks:
            pos += range(c.start, c.start + c.length)
        self.positions = long_tensor(pos, self.token_ids.device)

    def last_token_rows(self) -> torch.Tensor:
        """Row of each chunk's last token in the flat batch."""
        ends = torch.tensor([c.length for c in self.chunks]).cumsum(0) - 1
        return ends.to(self.token_ids.device)


class PagedKVCache:
    """Key/value slots ``[num_layers, kv_heads, num_blocks * block_size, head_dim]``."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, kv_heads, num_blocks * block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._head_rows = torch.arange(kv_heads, dtype=torch.long)[None, :, None] * num_blocks
        self.workspace = Workspace(dtype, device)  # the decode gathers' buffers, reused every forward
        # per layer, made once: its keys/values [kv heads, slots, dim] and the same as [kv heads * blocks,
        # block_size * dim] (decode gathers copy whole blocks of every head); views, no per-forward indexing
        self._layers = [(self.k[i], self.v[i], self.k[i].view(kv_heads * num_blocks, -1),
                         self.v[i].view(kv_heads * num_blocks, -1)) for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def slots(self, table: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
        """Flat slot index of positions ``start .. stop-1`` of a sequence with block table ``table``."""
        if blocks_needed(stop, self.block_size) > len(table):
            raise ValueError(f"block table of {len(table)} blocks cannot hold {stop} positions")
        pos = torch.arange(start, stop)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return (blocks * self.block_size + pos % self.block_size).to(self.k.device)

    def _slot_list(self, c: SeqChunk) -> list[int]:
        """Slots of a chunk's new tokens, as Python ints (cheaper than tensor ops for short chunks)."""
        size, table = self.block_size, c.block_table
        if blocks_needed(c.start + c.length, size) > len(table):
            raise ValueError(f"block table of {len(table)} blocks cannot hold {c.start + c.length} positions")
        out: list[int] = []
        p, stop = c.start, c.start + c.length
        while p < stop:  # a run of consecutive slots per block, not a Python step per token
            b = p // size
            end = min(stop, (b + 1) * size)
            base = (table[b] - b) * size
            out += range(base + p, base + end)
            p = end
        return out

    GROUP_COST = 16
    """What one more decode length group costs per layer (a few ops), in padded blocks read per kv head:
    a cut into two groups is made where it saves at least this many."""

    def _decode_groups(self, chunks: list[SeqChunk], idx: list[int]) -> list[tuple[list[int], int]]:
        """One-token chunks ``idx`` sorted by cached length and cut into length groups, each read padded to
        its longest (``[(members, longest)]``, shortest group first): a group is cut in two at the point that
        saves the most padded block reads, while that saves at least ``GROUP_COST`` (recursively)."""
        order = sorted(idx, key=lambda i: chunks[i].start)
        size = self.block_size
        widths = [chunks[i].start // size + 1 for i in order]  # blocks read: positions 0..start
        cuts: list[tuple[int, int]] = []
        todo = [(0, len(order))]
        while todo:
            lo, hi = todo.pop()
            top, best, at = widths[hi - 1], self.GROUP_COST - 1, 0
            for j in range(lo + 1, hi):  # members lo..j-1 read widths[j-1] blocks instead of top
                save = (j - lo) * (top - widths[j - 1])
                if save > best:
                    best, at = save, j
            if at:
                todo += [(lo, at), (at, hi)]
            else:
                cuts.append((lo, hi))
        cuts.sort()
        return [(order[lo:hi], chunks[order[hi - 1]].start + 1) for lo, hi in cuts]

    def _decode_plan(self, chunks: list[SeqChunk], groups: list[tuple[list[int], int]]
                     ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int, int]]]:
        """For decode ``groups`` (of indices into ``chunks``): the block ids to gather, in one index for all
        groups (per sequence, per kv head, its table padded to its group's width: ``[kv * blocks]`` view
        rows), the additive mask ``[sequences * kv, 1, longest span]`` (0 for cached positions ``<=`` the
        chunk's own, ``-inf`` past them; one row per (sequence, kv head)) and per group ``(first row, last
        row, first gathered block, blocks, span)`` in those (sequence, kv head) rows."""
        size, kv = self.block_size, self.k.shape[1]
        heads = self._head_rows  # kv head h's blocks are rows h * num_blocks + id
        tables: list[int] = []  # every member's table padded to its group's width, one flat list
        plan, widths, row, at = [], [], 0, 0
        for members, longest in groups:
            width = blocks_needed(longest, size)
            for i in members:
                t = chunks[i].block_table[:width]
                tables += t if len(t) == width else t + (0,) * (width - len(t))
            n = len(members) * kv
            plan.append((row, row + n, at, n * width, width * size))
            widths.append((len(members), width))
            row, at = row + n, at + n * width
        flat, ids, k = long_tensor(tables), [], 0
        for m, width in widths:  # per group: [members, kv heads, width] block ids of the [kv * blocks] rows
            ids.append((flat[k:k + m * width].view(m, 1, width) + heads).view(-1))
            k += m * width
        starts = long_tensor([chunks[i].start for members, _ in groups for i in members for _ in range(kv)])
        keep = torch.arange(plan[-1][4])[None, :] <= starts[:, None]
        mask = torch.where(keep, 0.0, float("-inf")).to(self.k.dtype)[:, None, :]
        device = self.k.device
        ids_t = ids[0] if len(ids) == 1 else torch.cat(ids)
        return (ids_t, mask, plan) if device.type == "cpu" else (ids_t.to(device), mask.to(device), plan)

    def attention(self, batch: RaggedBatch):  # -> Attend
        """The ``attend`` callable for ``batch`` (see ``adapters.Attend``).

        One-token chunks (decodes) attend together: sorted by length and cut into length groups (each padded to
        its longest, ``_decode_groups``), their cached keys/values are gathered whole blocks at a time, for all
        groups in one index per layer, into the cache's reused ``workspace`` buffers, one row per (sequence, kv
        head), and each query-head group multiplies its own key/value head (grouped-query heads are never
        copied), with an additive mask for the padding. Longer chunks (prompt pieces) attend one by
        one with PyTorch's fused causal attention (4-d inputs, float mask: the CPU flash kernel); a chunk that
        starts a sequence uses its own new keys/values directly, without reading the cache back.
        """
        bs = batch.chunks
        device = self.k.device
        size, slots = self.block_size, []
        for c in bs:  # the new tokens' slots (a decode's inline: one per sequence per step); checks every table
            if c.length == 1 and c.start // size < len(c.block_table):
                slots.append(c.block_table[c.start // size] * size + c.start % size)
            else:
                slots += self._slot_list(c)
        write = long_tensor(slots, device)
        offsets = [0]
        for c in bs:
            offsets.append(offsets[-1] + c.length)
        single = [i for i, c in enumerate(bs) if c.length == 1]
        multi = [i for i, c in enumerate(bs) if c.length > 1]
        reads = {i: self.slots(bs[i].block_table, 0, bs[i].start + bs[i].length) for i in multi if bs[i].start > 0}
        masks = {i: _chunk_mask(bs[i], self.k.dtype, device) for i in reads}
        kv, dim, bsd = self.k.shape[1], self.k.shape[3], self.block_size * self.k.shape[3]
        decode = None
        if single:  # one plan for all decodes: sorted by length, one gather, then one matmul pair per group
            groups = self._decode_groups(bs, single)
            order = [i for members, _ in groups for i in members]
            at = [offsets[i] for i in order]
            n = len(order)
            # the rows of the sorted decodes in the flat batch: a slice when consecutive (the scheduler puts
            # decodes first, sorted by length), else an index
            rows = slice(at[0], at[0] + n) if at == list(range(at[0], at[0] + n)) else long_tensor(at, device)
            ids, mask, plan = self._decode_plan(bs, groups)
            kbuf, vbuf = (self.workspace.view(name, (ids.numel(), bsd)) for name in ("k", "v"))
            # per group, made once for all layers: its rows, mask, and keys^T / values in the gather buffers
            views = [(r0, r1, mask[r0:r1, :, :span], kbuf[b0:b0 + nblk].view(r1 - r0, span, dim).transpose(1, 2),
                      vbuf[b0:b0 + nblk].view(r1 - r0, span, dim)) for r0, r1, b0, nblk, span in plan]
            decode = (rows, n, ids, kbuf, vbuf, views)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            kl, vl, kb, vb = self._layers[layer]  # kb, vb: [Hkv * blocks, size * D]
            if k.dtype == kl.dtype:
                kl.index_copy_(1, write, k.transpose(0, 1))
                vl.index_copy_(1, write, v.transpose(0, 1))
            else:
                kl.index_copy_(1, write, k.transpose(0, 1).to(kl.dtype))
                vl.index_copy_(1, write, v.transpose(0, 1).to(vl.dtype))
            heads = q.shape[1]
            gqa = heads != kv
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # never a view (compiled regions)
            if decode is not None:
                rows, n, ids, kbuf, vbuf, views = decode
                g = heads // kv
                # whole blocks of every kv head into persistent buffers: 16x fewer indices than per slot
                torch.index_select(kb, 0, ids, out=kbuf)
                torch.index_select(vb, 0, ids, out=vbuf)
                qd = q[rows] if isinstance(rows, slice) else q.index_select(0, rows)
                if qd.dtype != kl.dtype:
                    qd = qd.to(kl.dtype)
                qd = qd.reshape(n * kv, g, dim)  # one row per (sequence, kv head): its g query heads
                direct = isinstance(rows, slice) and q.dtype == kl.dtype
                od = out[rows].view(n * kv, g, dim) if direct else qd.new_empty(qd.shape)
                for r0, r1, mask, kt, vs in views:
                    p = torch.baddbmm(mask, qd[r0:r1], kt, alpha=scale)
                    if qd.dtype == torch.float32:  # scale, scores and mask in one call
                        p = p.softmax(-1)
                    else:
                        p = p.softmax(-1, dtype=torch.float32).to(vs.dtype)
                    torch.bmm(p, vs, out=od[r0:r1])  # straight into the output rows when they are a slice
                if not direct:
                    od = od.view(n, heads, dim).to(q.dtype)
                    if isinstance(rows, slice):
                        out[rows] = od
                    else:
                        out.index_copy_(0, rows, od)
            for i in multi:
                a, b = offsets[i], offsets[i + 1]
                qs = q[a:b].transpose(0, 1)[None]  # [1, H, n, D]: 4-d, so CPU takes the flash kernel, not math
                if i in reads:
                    ks, vs = kl.index_select(1, reads[i])[None], vl.index_select(1, reads[i])[None]  # [1, Hkv, S, D]
                    mask = masks[i]
                else:  # the chunk starts its sequence: its keys are exactly this forward's
                    ks, vs, mask = k[a:b].transpose(0, 1)[None], v[a:b].transpose(0, 1)[None], True
                y = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=None if isinstance(mask, bool) else mask,
                                                   is_causal=mask is True, scale=scale, enable_gqa=gqa)
                out[a:b] = y[0].transpose(0, 1)
            return out

        return attend


def _chunk_mask(c: SeqChunk, dtype: torch.dtype, device: torch.device) -> torch.Tensor | bool:
    """True: plain causal (chunk starts at 0); False: no mask (one query sees all); else an additive mask
    (a float mask keeps CPU attention on its flash kernel; a bool one is converted on every call)."""
    if c.start == 0:
        return True
    if c.length == 1:
        return False
    q_pos = torch.arange(c.start, c.start + c.length)[:, None]
    keep = torch.arange(c.start + c.length)[None, :] <= q_pos
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf")).to(device)
