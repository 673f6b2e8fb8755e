"""Structured output: a token mask from a regular expression, via ``outlines-core`` (the ``serve`` extra).

Requests ask for structure the OpenAI way (``response_format``: ``json_object`` or ``json_schema``) or vLLM's
(``guided_json``, ``guided_regex``, ``guided_choice``); each becomes one regular expression (JSON schemas via
``outlines_core.json_schema.build_regex_from_schema``), compiled once per expression against the model's
vocabulary into an ``outlines_core.Index`` (cached). Each request walks its own ``Guide``: before every token the
logits of the tokens the guide does not allow are set to ``-inf``; the chosen token advances the guide; the
request ends ("stop") when the guide is finished. The vocabulary is the tokens' bytes: the byte tokenizer's
256 bytes, or a Hugging Face tokenizer's tokens decoded from byte-level BPE (GPT-2, Llama 3) or SentencePiece
(``▁`` = space, ``<0xNN>`` byte fallback). Why outlines-core: it installs here as a wheel, is maintained, and is
what vLLM and TGI use for this; xgrammar also exists but needs a tokenizer-info build we do not have for the
byte tokenizer.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

__all__ = ["GuideSpec", "StructuredOutput", "mask_logits", "regex_for"]

_SPECIAL_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# json_object: an object of scalar values. outlines-core's regex for *any* JSON value nests deeply and took
# 26 s to compile for a 256-token vocabulary here; nested objects need response_format json_schema.
_ANY_FLAT_OBJECT = {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean", "null"]}}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every byte as one character)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def regex_for(kind: str, spec: Any) -> str:
    """The regular expression for ``json`` (a schema dict/str, or None for any object), ``regex``, ``choice``."""
    from outlines_core.json_schema import build_regex_from_schema

    if kind == "json":
        schema = _ANY_FLAT_OBJECT if spec is None else spec
        return build_regex_from_schema(schema if isinstance(schema, str) else json.dumps(schema))
    if kind == "regex":
        return str(spec)
    if kind == "choice":
        return "(" + "|".join(re.escape(str(c)) for c in spec) + ")"
    raise ValueError(f"unknown structured-output kind {kind!r}")


class GuideSpec:
    """A compiled structure for requests: ``new()`` is a request's own guide; ``finished`` says it is done.

    With a real eos token the model chooses when to stop (eos is allowed once the text is complete); with the
    virtual eos of a vocabulary without one, the request ends as soon as the text is complete.
    """

    def __init__(self, index: Any, eos: int, virtual_eos: bool) -> None:
        self.index, self.eos, self.virtual_eos = index, eos, virtual_eos

    def new(self) -> Any:
        from outlines_core import Guide

        return Guide(self.index)

    def finished(self, guide: Any) -> bool:
        return bool(guide.is_finished()) or (self.virtual_eos and self.eos in guide.get_tokens())


class StructuredOutput:
    """Compiles regular expressions to ``Index`` objects for one tokenizer and vocabulary size (cached)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos = eos_token_ids[0] if eos_token_ids else vocab_size  # a virtual eos past the vocabulary
        self._vocab: Any = None
        self._indexes: dict[str, Any] = {}

    def _token_bytes(self) -> dict[bytes, list[int]]:
        out: dict[bytes, list[int]] = {}
        if not hasattr(self.tokenizer, "convert_ids_to_tokens"):  # the byte tokenizer
            return {bytes([i]): [i] for i in range(min(256, self.vocab_size))}
        inv = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        for i, t in enumerate(self.tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))):
            if t is None or i in special or i == self.eos:
                continue
            m = _SPECIAL_BYTE.fullmatch(t)
            if m:
                b = bytes([int(m.group(1), 16)])
            elif all(ch in inv for ch in t):
                b = bytes(inv[ch] for ch in t)
            else:
                b = t.replace("\u2581", " ").encode()
            if b:
                out.setdefault(b, []).append(i)
        return out

    def spec(self, regex: str) -> GuideSpec:
        """The ``GuideSpec`` of ``regex`` (ValueError if outlines-core rejects it)."""
        return GuideSpec(self.index(regex), self.eos, self.eos >= self.vocab_size)

    def index(self, regex: str) -> Any:
        """The compiled ``Index`` of ``regex`` (ValueError if outlines-core rejects it)."""
        from outlines_core import Index, Vocabulary

        if regex not in self._indexes:
            if self._vocab is None:
                self._vocab = Vocabulary(self.eos, self._token_bytes())
            try:
                self._indexes[regex] = Index(regex, self._vocab)
            except Exception as exc:  # noqa: BLE001 - outlines' own error types
                raise ValueError(f"cannot build a token mask for this structure: {exc}") from None
        return self._indexes[regex]


def mask_logits(row: torch.Tensor, guide: Any, vocab_size: int) -> torch.Tensor:
    """``row`` with every token the guide does not allow at ``-inf``."""
    allowed = [t for t in guide.get_tokens() if t < vocab_size]
    out = torch.full_like(row, float("-inf"))
    if allowed:
        idx = torch.tensor(allowed, dtype=torch.long, device=row.device)
        out[idx] = row[idx]
    return out
