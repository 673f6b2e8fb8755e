"""A whole token sequence through the model at once, with no KV cache: for embeddings and prompt logprobs.

The serving engine computes logits only where it samples (the last position of a sequence). Two requests want
every position of the prompt instead: ``/v1/embeddings`` (the final-norm hidden state of the last token,
L2-normalised: vLLM's default pooling for decoder models) and ``echo`` with ``logprobs`` (the log-probability
of each prompt token given the ones before it, from the raw logits, as vLLM's prompt logprobs). Both run one
dense causal forward through the adapter's own regions; nothing touches the engine's cache or scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .adapters import DecoderAdapter
from .kv_cache import long_tensor
from .logits_process import TokenLogprob, token_logprob

__all__ = ["embedding", "prompt_hidden", "prompt_logprobs"]


def _causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one whole sequence: ``q [T, H, D]``, ``k, v [T, Hkv, D]`` -> ``[T, H, D]``."""
    y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return y[0].transpose(0, 1)


@torch.inference_mode()
def prompt_hidden(adapter: DecoderAdapter, ids: Sequence[int]) -> torch.Tensor:
    """Last-block outputs ``[T, C]`` (before the final norm) of the sequence ``ids``."""
    tokens = long_tensor(list(ids), adapter.device)
    return adapter.hidden(tokens, torch.arange(len(ids), device=adapter.device), _causal)


def embedding(adapter: DecoderAdapter, ids: Sequence[int]) -> torch.Tensor:
    """The sequence's embedding: its last token's final-norm hidden state, L2-normalised (float32 ``[C]``)."""
    with torch.inference_mode():
        last = adapter.final_norm(prompt_hidden(adapter, ids)[-1:])[0].float()
        return F.normalize(last, dim=0)


def prompt_logprobs(adapter: DecoderAdapter, ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """Per prompt token its log-probability after the tokens before it and the ``top`` best there; the first
    token has none (``logprob`` and ``top`` are None)."""
    with torch.inference_mode():
        logits = adapter.logits(prompt_hidden(adapter, ids)[:-1]) if len(ids) > 1 else None
    out = [TokenLogprob(int(ids[0]), None, None)]  # OpenAI reports null for it
    for i in range(1, len(ids)):
        out.append(token_logprob(logits[i - 1], int(ids[i]), top))
    return out
