"""A batch generate loop over the paged KV cache: prefill every prompt once, then one token per step.

The prompt is run exactly once (prefill, all prompts in one ragged batch); after that each step feeds only
the newest token of each live sequence and reads earlier keys/values from the cache. A sequence that emits
an end-of-sequence id stops; the loop ends when all have stopped or ``max_new_tokens`` are out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .adapters import DecoderAdapter
from .kv_cache import BlockAllocator, PagedKVCache, RaggedBatch, SeqChunk, blocks_needed
from .sampling import SamplingParams, sample_next

__all__ = ["generate_tokens"]


@torch.no_grad()
def generate_tokens(adapter: DecoderAdapter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    params: SamplingParams, eos_ids: frozenset[int] = frozenset(), block_size: int = 16,
                    ) -> tuple[list[list[int]], int]:
    """New tokens for each prompt (eos included, nothing after it), and the number of forwards run."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = adapter.device
    sizes = [blocks_needed(len(p) + max_new_tokens, block_size) for p in prompts]
    cache = PagedKVCache(adapter.num_layers, sum(sizes), block_size, adapter.num_kv_heads, adapter.head_dim,
                         adapter.dtype, device)
    alloc = BlockAllocator(sum(sizes))
    tables = [tuple(alloc.allocate(n)) for n in sizes]
    gens = [params.generator() for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    batch = RaggedBatch(torch.tensor([t for p in prompts for t in p], device=device),
                        [SeqChunk(tables[i], 0, len(prompts[i])) for i in live])
    forwards = 0
    while True:
        hidden = adapter.hidden(batch.token_ids, batch.positions, cache.attention(batch))
        logits = adapter.logits(hidden[batch.last_token_rows()])
        forwards += 1
        for row, i in enumerate(live):
            out[i].append(sample_next(logits[row], params, gens[i]))
        live = [i for i in live if out[i][-1] not in eos_ids and len(out[i]) < max_new_tokens]
        if not live:
            return out, forwards
        batch = RaggedBatch(torch.tensor([out[i][-1] for i in live], device=device),
                            [SeqChunk(tables[i], len(prompts[i]) + len(out[i]) - 1, 1) for i in live])
