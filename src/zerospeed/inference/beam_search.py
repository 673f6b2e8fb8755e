"""Beam search over the paged KV cache, with Hugging Face ``generate(num_beams=K)``'s exact selection rules.

Per prompt, ``K`` running beams (at first only beam 0 counts: the others start at -1e9). Each step every
running beam is fed its newest token (one forward for all beams), and its log-softmax plus the beam's
score ranks all ``K x vocab`` continuations; the best ``max(2, 1 + n_eos) * K`` candidates are kept. A
candidate that ends (an eos token, or the length limit) and ranks among the first ``K`` becomes a
*finished* hypothesis scored ``logprob_sum / generated_len ** length_penalty``; the best ``K`` candidates that
do not end become the next running beams. The finished list keeps its best ``K``. Search stops when no
running beam can still beat the worst finished one (``early_stopping`` False: judged at the current
length; "never": at the longest length; True: as soon as ``K`` hypotheses are finished), when ``K`` are
finished under ``early_stopping=True``, or when every candidate ends.

Cache: each running beam owns a block table; when the new running beams are chosen, each copies its
parent's cached keys/values (positions ``0 .. len-1``) into its own table (two table sets, swapped every
step), so beams never share slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .adapters import DecoderAdapter
from .kv_cache import BlockAllocator, PagedKVCache, RaggedBatch, SeqChunk, blocks_needed

__all__ = ["beam_search"]

_NEG = -1.0e9


def _gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[b, idx[b, j], ...]`` for a ``[B, N, ...]`` tensor and ``[B, M]`` indices."""
    while idx.dim() < t.dim():
        idx = idx.unsqueeze(-1)
    return torch.take_along_dim(t, idx, dim=1)


def _copy_beams(cache: PagedKVCache, sources: list[tuple[int, ...]], targets: list[tuple[int, ...]],
                length: int) -> None:
    """Copy positions ``0 .. length-1`` of each source block table's keys/values into the matching target table."""
    src = torch.cat([cache.slots(t, 0, length) for t in sources])
    dst = torch.cat([cache.slots(t, 0, length) for t in targets])
    cache.k[:, :, dst] = cache.k[:, :, src]
    cache.v[:, :, dst] = cache.v[:, :, src]


@torch.no_grad()
def beam_search(adapter: DecoderAdapter, prompts: Sequence[Sequence[int]], num_beams: int, max_new_tokens: int,
                eos_ids: Sequence[int] = (), length_penalty: float = 1.0, early_stopping: bool | str = False,
                num_return_sequences: int = 1, pad_token_id: int | None = None, block_size: int = 16) -> torch.Tensor:
    """``[B * num_return_sequences, T + generated]`` token ids (prompts of equal length ``T``)."""
    B, K, T = len(prompts), num_beams, len(prompts[0])
    if any(len(p) != T for p in prompts):
        raise ValueError("beam search needs prompts of equal length (no padding)")
    if not 1 <= num_return_sequences <= K:
        raise ValueError(f"num_return_sequences={num_return_sequences} must be in [1, num_beams={K}]")
    device, L = adapter.device, T + max_new_tokens
    eos = torch.tensor(list(eos_ids), dtype=torch.long)
    keep = max(2, 1 + len(eos)) * K
    top_mask = torch.arange(keep) < K
    # Hugging Face fills unused positions with ``pad or eos[0]`` (so pad id 0 also gives eos[0]); -1 without eos
    fill = (pad_token_id or int(eos[0])) if len(eos) else -1
    run_seq = torch.full((B, K, L), fill, dtype=torch.long)
    run_seq[:, :, :T] = torch.tensor([list(p) for p in prompts])[:, None, :]
    run_score = torch.zeros(B, K)
    run_score[:, 1:] = _NEG
    run_bidx = torch.full((B, K, max_new_tokens), -1, dtype=torch.long)
    seqs, scores, bidx = run_seq.clone(), torch.full((B, K), _NEG), run_bidx.clone()
    finished = torch.zeros(B, K, dtype=torch.bool)
    unsat = torch.ones(B, 1, dtype=torch.bool)

    nb = blocks_needed(L, block_size)
    cache = PagedKVCache(adapter.num_layers, 2 * B * K * nb, block_size, adapter.num_kv_heads, adapter.head_dim,
                         adapter.dtype, device)
    alloc = BlockAllocator(2 * B * K * nb)
    tables = [tuple(alloc.allocate(nb)) for _ in range(B * K)]
    spare = [tuple(alloc.allocate(nb)) for _ in range(B * K)]
    batch = RaggedBatch(torch.tensor([t for p in prompts for t in p], device=device),
                        [SeqChunk(tables[b * K], 0, T) for b in range(B)])
    hidden = adapter.hidden(batch.token_ids, batch.positions, cache.attention(batch))
    logits = adapter.logits(hidden[batch.last_token_rows()]).float().repeat_interleave(K, dim=0)
    parent_rows = torch.arange(B * K) // K * K  # after the prefill only beam 0 of each prompt has a cache
    cur = T
    while True:
        lp = F.log_softmax(logits, dim=-1).cpu().view(B, K, -1) + run_score[:, :, None]
        vocab = lp.shape[-1]
        top_lp, top_idx = torch.topk(lp.reshape(B, -1), k=keep)
        parent, tok = top_idx // vocab, top_idx % vocab
        top_seq = _gather(run_seq, parent)
        top_seq[:, :, cur] = tok
        top_bidx = _gather(run_bidx, parent)
        top_bidx[:, :, cur - T] = parent + torch.arange(B)[:, None] * K
        hits = torch.isin(tok, eos) | (cur + 1 >= L)
        # next running beams: the best K candidates that do not end
        run_lp = top_lp + hits.float() * _NEG
        nxt = torch.topk(run_lp, k=K)[1]
        run_seq, run_score, run_bidx = _gather(top_seq, nxt), _gather(run_lp, nxt), _gather(top_bidx, nxt)
        new_parents = _gather(parent, nxt)  # [B, K] beam index within its prompt
        # finished hypotheses: ending candidates among the first K, length-normalised
        just = hits & top_mask[None, :]
        s = top_lp / ((cur + 1 - T) ** length_penalty)
        s = s + (finished.all(-1, keepdim=True) & (early_stopping is True)).float() * _NEG
        s = s + (~unsat).float() * _NEG + (~just).float() * _NEG
        best = torch.topk(torch.cat((scores, s), 1), k=K)[1]
        seqs, bidx, finished, scores = (_gather(torch.cat(pair, 1), best) for pair in (
            (seqs, top_seq), (bidx, top_bidx), (finished, just), (scores, s)))
        cur += 1
        horizon = (L - T) if early_stopping == "never" and length_penalty > 0.0 else (cur - T)
        best_running = run_score[:, :1] / (horizon**length_penalty)
        worst_done = torch.where(finished, scores.min(dim=1, keepdim=True)[0], torch.tensor(_NEG))
        unsat = unsat & (best_running > worst_done).any(-1, keepdim=True)
        if not (unsat.any() and not (finished.all() and early_stopping is True) and not hits.all()):
            break
        # each new running beam copies its parent's cache, then is fed its newest token
        rows = (torch.arange(B)[:, None] * K + new_parents).flatten().tolist()
        _copy_beams(cache, [tables[parent_rows[r]] if parent_rows is not None else tables[r] for r in rows], spare,
                    cur - 1)
        tables, spare, parent_rows = spare, tables, None
        batch = RaggedBatch(run_seq[:, :, cur - 1].flatten().to(device),
                            [SeqChunk(tables[i], cur - 1, 1) for i in range(B * K)])
        hidden = adapter.hidden(batch.token_ids, batch.positions, cache.attention(batch))
        logits = adapter.logits(hidden).float()
    seqs, bidx = seqs[:, :num_return_sequences].flatten(0, 1), bidx[:, :num_return_sequences].flatten(0, 1)
    generated = int((bidx + 1).bool().sum(dim=1).max())
    return seqs[:, : T + generated]
