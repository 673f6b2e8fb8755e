"""Continuous batching with Dynamic SplitFuse (DeepSpeed-FastGen's scheduling), as pure bookkeeping.

Every forward gets a fixed budget of ``max_ragged_batch_size`` tokens and ``max_ragged_sequence_count``
sequences. A step is filled in this order:

1. every running sequence that is *decoding* (one known token not yet in the KV cache) gets that token;
2. sequences still *prefilling* take the rest of the budget in arrival order; a prompt longer than what is
   left is split, and its next chunk goes into the next step (so long prompts never stall decodes, and
   each forward stays near the budget).

A chunk that reaches the end of a sequence's known tokens yields logits, so the engine samples a token.
Sequences join from a FIFO waiting queue while fewer than ``max_tracked_sequences`` are tracked and the KV
allocator can *reserve* blocks for their whole length (prompt + max new tokens, capped by ``max_context``):
blocks are taken as a sequence grows, but the reservation means growth never fails, so nothing needs to be
preempted. Finishing or cancelling gives the blocks back at once. No tensors here: the engine turns the
``Work`` items into a ragged batch.

With a ``PrefixCachingAllocator`` (prefix caching on), a sequence given its prompt tokens starts, when it is
admitted, with the cached blocks of its longest cached prompt prefix already computed, and its own full
prompt blocks are registered once computed (see ``prefix_cache``). Off, none of this runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from collections.abc import Sequence

from .kv_cache import BlockAllocator, blocks_needed
from .prefix_cache import PrefixCachingAllocator, block_hashes

__all__ = ["Limits", "Scheduler", "SeqState", "Work"]


@dataclass(frozen=True)
class Limits:
    """FastGen's state-manager limits (see ``StateManagerConfig``)."""

    max_ragged_batch_size: int = 768
    max_ragged_sequence_count: int = 512
    max_tracked_sequences: int = 2048
    max_context: int = 8192


@dataclass
class SeqState:
    """One sequence: ``known`` tokens (prompt + generated) of which ``computed`` are in the KV cache."""

    uid: int
    prompt_len: int
    max_new_tokens: int
    computed: int = 0
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # prefix caching: the keys of its full prompt blocks
    registered: int = 0  # prefix caching: prompt blocks registered so far

    @property
    def known(self) -> int:
        return self.prompt_len + self.generated

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.max_new_tokens

    @property
    def decoding(self) -> bool:
        return self.computed >= self.prompt_len


class Work(NamedTuple):  # immutable and cheap to build (one per sequence per step)
    """Feed tokens ``start .. start+length-1`` of sequence ``uid``; ``samples``: the chunk ends its known tokens."""

    uid: int
    start: int
    length: int
    block_table: tuple[int, ...]
    samples: bool


class Scheduler:
    """Admission, KV-block accounting and the per-step token plan."""

    def __init__(self, limits: Limits, allocator: BlockAllocator | PrefixCachingAllocator, block_size: int) -> None:
        self.limits = limits
        self.allocator = allocator
        self.prefix = allocator if isinstance(allocator, PrefixCachingAllocator) else None
        self._computing: dict[int, int] = {}  # prefix caching: block key -> uid of the running seq computing it
        self.block_size = block_size
        self.waiting: deque[SeqState] = deque()
        self.running: dict[int, SeqState] = {}  # insertion order = arrival order

    def add(self, uid: int, prompt_len: int, max_new_tokens: int, prompt: Sequence[int] | None = None) -> None:
        """Queue a sequence; ValueError if it can never fit. ``prompt``: its tokens, for prefix caching."""
        if uid in self.running or any(s.uid == uid for s in self.waiting):
            raise ValueError(f"sequence {uid} is already tracked")
        if prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(f"need a prompt and at least one new token, got {prompt_len} and {max_new_tokens}")
        seq = SeqState(uid, prompt_len, max_new_tokens)
        if seq.max_len > self.limits.max_context:
            raise ValueError(f"prompt ({prompt_len}) + max new tokens ({max_new_tokens}) exceed "
                             f"max_context={self.limits.max_context}")
        if self._blocks_for(seq) > self.allocator.num_blocks:
            raise ValueError(f"sequence needs {self._blocks_for(seq)} KV blocks, the cache has "
                             f"{self.allocator.num_blocks}")
        if self.prefix is not None and prompt is not None:
            seq.keys = block_hashes(prompt, self.block_size)
        self.waiting.append(seq)

    def _blocks_for(self, seq: SeqState) -> int:
        return blocks_needed(seq.max_len, self.block_size)

    def _reserved(self) -> int:
        return sum(self._blocks_for(s) - len(s.blocks) for s in self.running.values())

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.limits.max_tracked_sequences:
            seq = self.waiting[0]
            if self.prefix is not None and seq.keys:
                if not self._admit_cached(seq):
                    return
            elif self.allocator.num_free - self._reserved() < self._blocks_for(seq):
                return  # FIFO: later arrivals do not overtake
            self.running[self.waiting.popleft().uid] = seq

    def _admit_cached(self, seq: SeqState) -> bool:
        """Prefix caching: start ``seq`` on its cached prompt blocks if the rest fits; False if it must wait."""
        assert self.prefix is not None
        usable = seq.keys[:(seq.prompt_len - 1) // self.block_size]  # the last prompt token is recomputed
        blocks, idle = self.prefix.match(usable)
        if len(blocks) < len(usable) and usable[len(blocks)] in self._computing:
            return False  # a running sequence is computing our next prompt block: wait a step or two for it
        if self.allocator.num_free - idle - self._reserved() < self._blocks_for(seq) - len(blocks):
            return False
        self.prefix.take(blocks, seq.prompt_len, self.block_size)
        seq.blocks = list(blocks)
        seq.computed, seq.registered = len(blocks) * self.block_size, len(blocks)
        for key in seq.keys[len(blocks):]:
            self._computing.setdefault(key, seq.uid)
        return True

    def schedule(self) -> list[Work]:
        """The next forward's work: decodes first, then prefill chunks, within both budgets."""
        self._admit()
        tokens, seqs = self.limits.max_ragged_batch_size, self.limits.max_ragged_sequence_count
        decodes = [s for s in self.running.values() if s.decoding]
        prefills = [s for s in self.running.values() if not s.decoding]
        work = []
        for seq in decodes + prefills:
            if tokens == 0 or len(work) == seqs:
                break
            length = min(seq.known - seq.computed, tokens)
            need = blocks_needed(seq.computed + length, self.block_size) - len(seq.blocks)
            if need > 0:
                seq.blocks.extend(self.allocator.allocate(need))  # covered by the admission reservation
            work.append(Work(seq.uid, seq.computed, length, tuple(seq.blocks), seq.computed + length == seq.known))
            tokens -= length
        k = min(len(decodes), len(work))  # the decodes, sorted by length: the attention's length groups are
        work[:k] = sorted(work[:k], key=lambda w: w.start)  # then consecutive rows of the batch (no index)
        return work

    def commit(self, work: list[Work]) -> None:
        """Record that ``work`` ran: its tokens are cached; each sampling chunk produced one token."""
        for w in work:
            seq = self.running[w.uid]
            if w.start != seq.computed:
                raise AssertionError(f"sequence {w.uid}: work starts at {w.start}, cache holds {seq.computed}")
            seq.computed += w.length
            if w.samples:
                seq.generated += 1
        if self.prefix is not None:
            for w in work:
                seq = self.running[w.uid]
                done = min(seq.computed // self.block_size, len(seq.keys))
                for i in range(seq.registered, done):
                    self.prefix.register(seq.blocks[i], seq.keys[i])
                    if self._computing.get(seq.keys[i]) == seq.uid:
                        del self._computing[seq.keys[i]]
                seq.registered = max(seq.registered, done)

    def widen(self, w: Work, extra: int) -> Work:
        """Speculation: ``w`` (a decode) with ``extra`` drafted tokens after it (blocks from its reservation)."""
        seq = self.running[w.uid]
        length = w.length + extra
        if seq.computed + length > seq.max_len:
            raise ValueError(f"sequence {w.uid}: {extra} drafts run past its reserved length")
        need = blocks_needed(seq.computed + length, self.block_size) - len(seq.blocks)
        if need > 0:
            seq.blocks.extend(self.allocator.allocate(need))
        return w._replace(length=length, block_table=tuple(seq.blocks))

    def rollback(self, uid: int, rejected: int, accepted: int) -> None:
        """Speculation, after ``commit``: ``rejected`` drafted tokens are not cached after all, and the
        sequence generated ``accepted`` tokens more than the one ``commit`` counted."""
        seq = self.running[uid]
        seq.computed -= rejected
        seq.generated += accepted

    def finish(self, uid: int) -> None:
        """Drop a sequence (finished or cancelled, running or waiting) and free its blocks."""
        seq = self.running.pop(uid, None)
        if seq is None:
            for s in self.waiting:
                if s.uid == uid:
                    self.waiting.remove(s)
                    return
            raise KeyError(f"sequence {uid} is not tracked")
        self.allocator.free(seq.blocks)
        seq.blocks = []
        for key in seq.keys[seq.registered:]:  # prefix caching: blocks it will no longer compute
            if self._computing.get(key) == uid:
                del self._computing[key]

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting
