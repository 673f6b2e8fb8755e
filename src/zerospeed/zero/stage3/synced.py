"""Running per-rank-length loops (generation) under ZeRO-3: ranks that finished keep running forwards.

Every forward of a ZeRO-3 model gathers parameters collectively, so every rank must run the same
number of forwards. A loop whose length depends on the rank's data (sampling until an end token)
therefore runs as in Hugging Face's ``synced_gpus``: before each iteration one all-reduce tells whether
any rank is still going; a rank that has finished runs the forward anyway and discards the result::

    done = False
    while zerospeed.zero.any_rank_running(done):
        logits = engine(tokens)  # every rank, finished or not
        if done:
            continue
        ...
        done = bool(next_token == eos) or tokens.shape[1] >= max_len

:func:`synced_generate` is that loop for greedy decoding. A loop that does not keep the ranks in step
is named at its first differing gather (``lockstep.RanksDivergedError``), not left to hang.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import comm


def any_rank_running(done: bool, group: comm.Group | None = None) -> bool:
    """True while any rank of ``group`` (default: the world) has not finished: one all-reduce of a flag."""
    return comm.all_reduce_max_flag(not done, group=group)


@torch.no_grad()
def synced_generate(model: Any, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                    group: comm.Group | None = None) -> torch.Tensor:
    """Greedy decoding of ``input_ids`` (``[batch, time]``) with every rank of ``group`` in step.

    ``model(tokens)`` returns logits ``[batch, time, vocab]`` (or an object with ``.logits``). A rank
    stops after ``max_new_tokens`` tokens, or once every sequence of its batch produced ``eos_token_id``
    (later tokens of a finished sequence are ``eos_token_id`` too); it then keeps running forwards,
    whose results it discards, until every rank has stopped. Returns this rank's tokens.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    tokens = input_ids
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    done = max_new_tokens == 0
    while any_rank_running(done, group):
        out = model(tokens)
        if done:
            continue  # keeps the ranks' gathers in step; the result is not needed
        logits = out.logits if hasattr(out, "logits") else out
        nxt = logits[:, -1].argmax(-1)
        if eos_token_id is not None:
            nxt = torch.where(finished, torch.full_like(nxt, eos_token_id), nxt)
            finished |= nxt == eos_token_id
        tokens = torch.cat([tokens, nxt[:, None].to(tokens.dtype)], dim=1)
        done = tokens.shape[1] - input_ids.shape[1] >= max_new_tokens or bool(finished.all())
    return tokens


__all__ = ["any_rank_running", "synced_generate"]
