"""One continuous-batching forward with speculative drafts (see ``speculative``): the engine's step, widened.

``spec_step`` runs when at least one decode of the step got drafts (``ServingEngine._draft`` widened its
``Work`` to the pending token + drafts). Drafted sequences get logits at every fed position and ``verify``
chooses 1 .. k+1 tokens; the others are sampled as in the plain step. The scheduler is told how many drafts
were rejected (their KV slots are past the computed length, so they are simply overwritten later), and the
tokens are emitted one by one, stopping at the first that finishes the request.
"""

from __future__ import annotations

from typing import Any

import torch

from .kv_cache import RaggedBatch, SeqChunk, long_tensor
from .logits_process import PLAIN
from .sampling import sample_next
from .speculative import verify

__all__ = ["spec_step"]


def _ids(req: Any, w: Any, drafts: list[int] | None) -> list[int]:
    n = len(req.prompt)
    if drafts is not None:  # a decode: its pending (last generated) token, then the drafts
        return [req.output[-1], *drafts]
    if w.start + w.length <= n:
        return req.prompt[w.start:w.start + w.length]
    if w.start >= n:
        return req.output[w.start - n:w.start - n + w.length]
    return req.prompt[w.start:] + req.output[:w.start + w.length - n]


def spec_step(eng: Any, work: list[Any], drafts: dict[int, list[int]]) -> list[Any]:
    """The events of one forward over ``work`` in which the sequences in ``drafts`` verify their drafts."""
    ids: list[int] = []
    for w in work:
        ids += _ids(eng.requests[w.uid], w, drafts.get(w.uid))
    batch = RaggedBatch(long_tensor(ids, eng.adapter.device), [SeqChunk(w.block_table, w.start, w.length)
                                                               for w in work])
    hidden = eng.adapter.hidden(batch.token_ids, batch.positions, eng.cache.attention(batch))
    rows: list[int] = []
    spans = []
    end = 0
    for w in work:
        end += w.length
        if w.samples:
            take = w.length if w.uid in drafts else 1
            spans.append((w, len(rows), take))
            rows.extend(range(end - take, end))
    logits = eng.adapter.logits(hidden[torch.tensor(rows, device=hidden.device)])
    eng.scheduler.commit(work)
    eng.forwards += 1
    eng.tokens_forwarded += len(ids)
    events = []
    for w, at, take in spans:
        req = eng.requests[w.uid]
        d = drafts.get(w.uid)
        lp = None
        try:
            if d is not None:
                tokens = verify(logits[at:at + take], d, req.params, req.generator)
            elif req.params.process is not PLAIN:
                token, lp = eng._processed(req, logits[at])
                tokens = [token]
            else:
                tokens = [sample_next(logits[at], req.params, req.generator)]
        except Exception as exc:  # noqa: BLE001 - this request only
            events.append(eng.fail(req.uid, f"sampling failed: {exc}"))
            continue
        if d is not None:
            eng.scheduler.rollback(w.uid, len(d) - (len(tokens) - 1), len(tokens) - 1)
            eng.drafted += len(d)
            eng.accepted += len(tokens) - 1
            if len(tokens) == 1:  # every draft rejected: draft less often for a while
                req.spec_skip, req.spec_backoff = req.spec_backoff, min(16, 2 * req.spec_backoff)
            else:
                req.spec_backoff = 1
        for t in tokens:
            ev = eng._emit(req, t, lp)
            events.append(ev)
            if ev.finish_reason is not None:
                break
    return events
