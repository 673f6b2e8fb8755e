"""Speculative decoding by prompt lookup (n-gram drafting), verified so the target distribution is kept exactly.

For a decoding request, the *proposer* looks for the most recent earlier occurrence of the last ``n`` tokens
(prompt + output, ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and drafts the ``k`` tokens
that followed it (a match that overlaps the suffix repeats its period, as a copy in LZ77 does). The engine then feeds the request's pending token and the ``k`` drafts in one chunk of the
ordinary ragged forward, which gives the target model's logits at every one of those positions, and
``verify`` turns them into 1 .. k+1 tokens:

- greedy: drafts are accepted while each equals the argmax at its position; the argmax at the first mismatch
  (or after the last draft) is appended, so the output is token-identical to decoding without speculation;
- sampling: a drafted token ``d`` (a point mass: the proposer is deterministic) is accepted with probability
  ``p(d)`` under the target's temperature / top-k / top-p distribution ``p``; on rejection the token is drawn
  from ``p`` with ``d`` removed and renormalised (``max(0, p - q)`` for ``q`` = the point mass), and after
  ``k`` acceptances one more token is drawn from the last position. This is the standard rejection rule, so
  each emitted token has exactly the target's distribution.

The KV entries of rejected drafts are left in place past the request's computed length and overwritten later.
vLLM's config keys: ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
"prompt_lookup_min": 1}``, or a draft model: ``{"model": DIR, "num_speculative_tokens": k}`` (method
``draft_model``; see ``draft_model``: its greedy drafts are point masses too, verified by the same rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .sampling import SamplingParams, target_probs

__all__ = ["SpeculativeConfig", "propose_ngram", "verify"]


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` drafts per step: by prompt lookup (n-grams of ``prompt_lookup_min..max``), or
    from a draft model when ``model`` is set (a model directory, or an ``nn.Module`` of the same vocabulary)."""

    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: Any = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def parse(cls, cfg: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's ``--speculative-config`` dict; ValueError for an unknown key or method."""
        if cfg is None or isinstance(cfg, SpeculativeConfig):
            return cfg
        cfg = dict(cfg)
        model = cfg.pop("model", None)
        if model in ("ngram", "[ngram]"):
            model = None
        method = cfg.pop("method", "ngram" if model is None else "draft_model")
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method={method!r} is not supported yet by zerospeed "
                             "(ngram and draft_model are)")
        if (method == "draft_model") != (model is not None):
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the draft's directory), "
                             "and 'ngram' takes none")
        tp = cfg.pop("draft_tensor_parallel_size", None)
        if tp not in (None, 1):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp!r}: a tensor-parallel draft is "
                             "not supported yet by zerospeed (1 is)")
        known = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = set(cfg) - known
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} (known: method, model, "
                             f"draft_tensor_parallel_size, {', '.join(sorted(known))})")
        return cls(**cfg, model=model)


def propose_ngram(tokens: Sequence[int], cfg: SpeculativeConfig, limit: int) -> list[int]:
    """Up to ``limit`` drafted tokens: what followed the latest earlier match of the longest matching suffix."""
    n_tok = len(tokens)
    if limit < 1:
        return []
    for n in range(min(cfg.prompt_lookup_max, n_tok - 1), cfg.prompt_lookup_min - 1, -1):
        pattern = list(tokens[n_tok - n:])
        last = pattern[-1]
        for j in range(n_tok - n - 1, -1, -1):  # the newest occurrence first (j: start of the match)
            if tokens[j + n - 1] == last and list(tokens[j:j + n]) == pattern:
                ext = list(tokens[j + n:])  # what followed; a match overlapping the suffix continues its own
                want = min(limit, cfg.num_speculative_tokens)  # period (as an LZ77 copy does)
                while len(ext) < want:
                    ext.append(ext[len(ext) - (n_tok - j - n)])
                return ext[:want]
    return []


def verify(rows: torch.Tensor, drafts: Sequence[int], params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """The tokens to emit from target logits ``rows`` ``[len(drafts) + 1, V]`` (see module docstring)."""
    if params.greedy:
        best = rows.argmax(-1).tolist()
        out = []
        for i, d in enumerate(drafts):
            if best[i] != d:
                return out + [best[i]]
            out.append(d)
        return out + [best[len(drafts)]]
    out = []
    for i, d in enumerate(drafts):
        p = target_probs(rows[i], params)
        if float(torch.rand((), generator=generator)) < float(p[d]):
            out.append(d)
            continue
        p[d] = 0.0
        if float(p.sum()) <= 0.0:  # p was the point mass on d: nothing else is possible
            return out + [d]
        return out + [int(torch.multinomial(p / p.sum(), 1, generator=generator))]
    p = target_probs(rows[len(drafts)], params)
    return out + [int(torch.multinomial(p, 1, generator=generator))]
