"""Per-request logits processing and log-probabilities (OpenAI's and vLLM's request fields).

Applied to one request's row of logits, in this order, before greedy choice or sampling:

- ``repetition_penalty`` (vLLM / Hugging Face): every token already in the prompt or the output has its
  logit divided by the penalty when positive, multiplied when negative;
- ``frequency_penalty`` / ``presence_penalty`` (OpenAI): ``logit -= frequency * count + presence * (count > 0)``
  over the tokens generated so far;
- ``logit_bias`` (OpenAI): a bias in [-100, 100] added to named token ids;
- ``min_tokens`` (vLLM): until that many tokens are generated, eos and ``stop_token_ids`` are impossible.

Only requests that set one of them pay for it (``needs_processing``); the default decode path never calls
this module. ``logprobs`` are the log-softmax of the processed logits (before temperature), the chosen
token's and the ``top`` most likely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PLAIN", "LogitsOptions", "TokenLogprob", "process_logits", "token_logprob"]


@dataclass(frozen=True)
class LogitsOptions:
    """What to do to a request's logits (neutral values: nothing)."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's and the top k
    guided: Any = None  # structured output: a ``structured.GuideSpec`` (each request walks its own guide)

    def __post_init__(self) -> None:
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"top logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def changes_logits(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.guided is not None)


PLAIN = LogitsOptions()  # the default: decoding checks identity with it to stay on the fast path


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the ``top`` alternatives ``(token id, logprob)``; both None for
    a prompt's first token (prompt logprobs: nothing comes before it)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None


def process_logits(row: torch.Tensor, opts: LogitsOptions, prompt: Sequence[int], output: Sequence[int],
                   banned_until_min: Sequence[int]) -> torch.Tensor:
    """``row`` ``[V]`` (a float copy) with ``opts`` applied for a request that generated ``output`` so far."""
    row = row.float().clone()
    if opts.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / opts.repetition_penalty, vals * opts.repetition_penalty)
    if (opts.frequency_penalty or opts.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=row.numel()).to(row)
        row -= opts.frequency_penalty * counts + opts.presence_penalty * (counts > 0).to(row)
    for tok, bias in opts.logit_bias:
        if 0 <= tok < row.numel():
            row[tok] += bias
    if len(output) < opts.min_tokens and banned_until_min:
        row[torch.tensor(list(banned_until_min), dtype=torch.long, device=row.device)] = float("-inf")
    return row


def token_logprob(row: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """Log-probabilities of ``row`` (processed logits, before temperature): ``token``'s and the ``top`` best."""
    logp = torch.log_softmax(row.float(), -1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logp, min(top, logp.numel()))
        best = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logp[token]), best)
