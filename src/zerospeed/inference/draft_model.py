"""Speculative decoding with a draft model: a smaller model of the same vocabulary proposes ``k`` tokens.

The draft keeps a paged KV cache of its own. Per request it holds a block table and ``cached``, the tokens
whose keys and values that cache holds (positions ``0 .. len(cached)-1``). One proposal round, for all the
requests that draft in a step together:

1. catch-up: each request feeds what its sequence holds past the longest prefix still cached (a new request:
   its whole prompt; afterwards: the tokens the target accepted; rejected drafts simply drop off the end);
2. then one-token forwards, each feeding the previous forward's argmax, until the request has its drafts.

Every forward is one ragged batch over all the requests still drafting. The draft is greedy, so its proposal
is a point mass and the target's ``verify`` (rejection against a point mass, see ``speculative``) keeps the
target's distribution exactly; greedy output is token-identical to decoding without speculation.
vLLM samples its drafts from the draft's distribution; a deterministic draft needs no draft probabilities and
accepts at least as often when the draft agrees with the target's argmax.

A request that is no longer served is dropped at the next round (its blocks freed). When the draft's cache has
no blocks left, a request gets no drafts for that step and decodes as usual.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .adapters import adapter_for
from .kv_cache import BlockAllocator, KVCacheOutOfBlocks, PagedKVCache, RaggedBatch, SeqChunk, blocks_needed, \
    long_tensor

__all__ = ["DraftModelProposer"]


@dataclass
class _DraftSeq:
    blocks: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)


@dataclass
class _Round:
    uid: int
    seq: _DraftSeq
    limit: int
    feed: list[int]
    out: list[int] = field(default_factory=list)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    """Greedy drafts of ``model`` (same vocabulary as the target), with its own paged KV cache."""

    def __init__(self, model: nn.Module, num_speculative_tokens: int, block_size: int, num_blocks: int,
                 target_vocab_size: int) -> None:
        self.adapter = adapter_for(model.eval())
        if self.adapter.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {self.adapter.vocab_size} "
                             f"tokens, the target's {target_vocab_size}; a draft model must share the tokenizer")
        self.adapter.fuse()
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        a = self.adapter
        self.cache = PagedKVCache(a.num_layers, num_blocks, block_size, a.num_kv_heads, a.head_dim, a.dtype, a.device)
        self.seqs: dict[int, _DraftSeq] = {}
        self.forwards = 0

    def release(self, uid: int) -> None:
        seq = self.seqs.pop(uid, None)
        if seq is not None:
            self.allocator.free(seq.blocks)

    def _start(self, uid: int, tokens: Sequence[int], limit: int) -> _Round | None:
        """The round of one request: its catch-up tokens and blocks for them and its drafts, or None."""
        if self.adapter.max_positions is not None:  # learned positions: draft no further than the table
            limit = min(limit, self.adapter.max_positions - len(tokens) + 1)
        limit = min(limit, self.k)
        if limit < 1 or not tokens:
            return None
        seq = self.seqs.setdefault(uid, _DraftSeq())
        keep = min(_common_prefix(seq.cached, tokens), len(tokens) - 1)  # feed >= 1 token: logits for the next
        need = blocks_needed(len(tokens) + limit - 1, self.block_size) - len(seq.blocks)
        try:
            if need > 0:
                seq.blocks.extend(self.allocator.allocate(need))
        except KVCacheOutOfBlocks:
            self.release(uid)
            return None
        del seq.cached[keep:]
        return _Round(uid, seq, limit, list(tokens[keep:]))

    @torch.inference_mode()
    def propose(self, items: Sequence[tuple[int, Sequence[int], int]], live: Container[int]) -> dict[int, list[int]]:
        """Drafts for ``(uid, tokens so far, most drafts wanted)``; requests not in ``live`` are released."""
        for uid in [u for u in self.seqs if u not in live]:
            self.release(uid)
        rounds = [r for r in (self._start(*item) for item in items) if r is not None]
        drafts: dict[int, list[int]] = {}
        while rounds:
            ids: list[int] = []
            chunks = []
            for r in rounds:
                chunks.append(SeqChunk(tuple(r.seq.blocks), len(r.seq.cached), len(r.feed)))
                ids += r.feed
            batch = RaggedBatch(long_tensor(ids, self.adapter.device), chunks)
            hidden = self.adapter.hidden(batch.token_ids, batch.positions, self.cache.attention(batch))
            best = self.adapter.logits(hidden[batch.last_token_rows()]).argmax(-1).tolist()
            self.forwards += 1
            going = []
            for r, token in zip(rounds, best):
                r.seq.cached.extend(r.feed)
                r.out.append(token)
                if len(r.out) < r.limit:
                    r.feed = [token]
                    going.append(r)
                else:
                    drafts[r.uid] = r.out
            rounds = going
        return drafts
