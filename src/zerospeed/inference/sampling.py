"""Choosing the next token: greedy, or sampling with temperature, top-k and top-p (nucleus), seeded.

``temperature == 0`` means greedy (``argmax``, first index on ties, as Hugging Face and OpenAI do).
Otherwise logits, shifted so their maximum is 0, are divided by the temperature (a temperature so small that
this overflows leaves only the maximum finite: greedy, never NaN), cut to the ``top_k`` largest (0 = all), then to the
smallest set whose probability reaches ``top_p`` (the most likely token is always kept), and one token is
drawn from the renormalised distribution with the request's own ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .logits_process import PLAIN, LogitsOptions

__all__ = ["SEED_MAX", "SEED_MIN", "SamplingParams", "filter_logits", "sample_next", "target_probs"]

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (OpenAI's names); ``stop`` strings are checked on decoded text."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # vLLM's: the model's eos tokens do not end the request (stop_token_ids still do)
    process: LogitsOptions = PLAIN  # penalties, logit_bias, min_tokens, logprobs (see logits_process)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator | None:
        """A fresh generator for this request (seeded when ``seed`` is set), or None for greedy."""
        if self.greedy:
            return None
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` ``[V]`` with everything outside top-k / top-p set to ``-inf``."""
    out = logits.clone()
    if 0 < top_k < out.numel():
        kth = torch.topk(out, top_k).values[-1]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # mass before this token already reaches top_p
        drop[0] = False
        out[order[drop]] = float("-inf")
    return out


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution ``[V]`` (float32, CPU) of one row of logits under ``params`` (not greedy)."""
    row = logits.float()
    scaled = filter_logits((row - row.max()) / params.temperature, params.top_k, params.top_p)
    probs = scaled.softmax(-1)
    if not bool(torch.isfinite(probs).all()):  # NaN logits from the model: fail this request, not the server
        raise ValueError("the model produced non-finite logits; cannot sample")
    return probs.cpu()


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token id from one row of logits ``[V]``."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(target_probs(logits, params), 1, generator=generator))
