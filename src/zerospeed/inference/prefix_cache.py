"""Prefix caching: full KV blocks of prompts, keyed by a hash of their tokens and of everything before them.

Block ``i`` of a prompt has the key ``h_i = hash((h_{i-1}, tokens of block i))``, so equal keys mean equal
prefixes (up to a hash collision of Python's 64-bit tuple hash, as vLLM accepts with its own hash). When a
prompt's blocks are computed, the scheduler registers them; a later request whose prompt starts with the
same blocks takes those blocks instead of recomputing them (the last prompt token is always recomputed, so
the request still gets its first logits). Shared blocks are reference-counted and never written again
(writes only happen past a sequence's computed length, and shared blocks lie wholly before it). A block
whose last user finished keeps its keys/values and its key, on a least-recently-used list: it counts as
free, and is reused (its key forgotten) only when no never-used block is left.

``PrefixCachingAllocator`` has the ``BlockAllocator`` interface (``allocate``, ``free``, ``num_free``,
``num_blocks``), so the scheduler's reservation arithmetic is unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from .kv_cache import KVCacheOutOfBlocks

__all__ = ["PrefixCachingAllocator", "block_hashes"]


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained keys of every *full* block of ``tokens``."""
    out: list[int] = []
    h = 0
    for i in range(len(tokens) // block_size):
        h = hash((h, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


class PrefixCachingAllocator:
    """Block ids with reference counts, a key -> block map of cached prompt blocks, and an LRU of idle ones."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # never used (or forgotten): pop() gives the lowest id
        self._refs: dict[int, int] = {}
        self._by_key: dict[int, int] = {}
        self._key_of: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # prompt tokens found

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._idle)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise KVCacheOutOfBlocks(f"asked for {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # evict the least recently used cached block
                b, _ = self._idle.popitem(last=False)
                del self._by_key[self._key_of.pop(b)]
            self._refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            refs = self._refs.get(b, 0)
            if refs < 1:
                raise ValueError(f"block {b} is not allocated (double free?)")
            if refs > 1:
                self._refs[b] = refs - 1
                continue
            del self._refs[b]
            if b in self._key_of:
                self._idle[b] = None  # keeps its keys/values: most recently used at the end
            else:
                self._free.append(b)

    def match(self, keys: Sequence[int]) -> tuple[list[int], int]:
        """The cached blocks of the longest prefix of ``keys`` and how many of them are idle (not taken yet)."""
        blocks: list[int] = []
        for k in keys:
            b = self._by_key.get(k)
            if b is None:
                break
            blocks.append(b)
        return blocks, sum(1 for b in blocks if b in self._idle)

    def take(self, blocks: Sequence[int], looked_up_tokens: int, block_size: int) -> None:
        """Reference ``blocks`` (from ``match``) for a new sequence; count the lookup."""
        for b in blocks:
            if b in self._idle:
                del self._idle[b]
                self._refs[b] = 1
            else:
                self._refs[b] += 1
        self.queries += looked_up_tokens
        self.hits += len(blocks) * block_size

    def register(self, block: int, key: int) -> None:
        """``block`` now holds the prompt prefix with ``key`` (first holder wins; a duplicate stays private)."""
        if key not in self._by_key and block not in self._key_of:
            self._by_key[key] = block
            self._key_of[block] = key
