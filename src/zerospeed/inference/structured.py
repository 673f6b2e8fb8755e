"""Structured output: a token mask from a regular expression, via ``outlines-core`` (the ``serve`` extra).

Requests ask for structure the OpenAI way (``response_format``: ``json_object`` or ``json_schema``) or vLLM's
(``guided_json``, ``guided_regex``, ``guided_choice``); each becomes one regular expression (JSON schemas via
``outlines_core.json_schema.build_regex_from_schema``), compiled once per expression against the model's
vocabulary into an ``outlines_core.Index`` (cached). Each request walks its own ``Guide``: before every token the
logits of the tokens the guide does not allow are set to ``-inf``; the chosen token advances the guide; the
request ends ("stop") when the guide is finished. ``json_object`` is any object nested up to
``JSON_OBJECT_DEPTH`` levels (a bounded-depth regex; outlines-core compiles it in seconds, so compiled indexes
are also kept on disk per vocabulary, see ``index_cache_dir``). The vocabulary is the tokens' bytes: the byte tokenizer's
256 bytes, or a Hugging Face tokenizer's tokens decoded from byte-level BPE (GPT-2, Llama 3) or SentencePiece
(``▁`` = space, ``<0xNN>`` byte fallback, every other piece UTF-8 text; a vocabulary with either marker is read
as SentencePiece, never through GPT-2's byte alphabet, which would read "é" as the single byte 0xE9). Why outlines-core: it installs here as a wheel, is maintained, and is
what vLLM and TGI use for this; xgrammar also exists but needs a tokenizer-info build we do not have for the
byte tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["GuideSpec", "StructuredOutput", "mask_logits", "regex_for"]

_SPECIAL_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# json_object: any JSON object nested at most JSON_OBJECT_DEPTH levels (objects and arrays inside it). The
# regex grows 4x per level (a list item appears twice, objects and arrays both nest) and outlines-core's
# determinisation with it: depth 2 compiles in ~0.2 s, depth 3 in ~8 s on this CPU (load 2-13), whatever the
# vocabulary; so compiled indexes are kept on disk per vocabulary (``index_cache_dir``).
JSON_OBJECT_DEPTH = 3


def json_object_regex(depth: int = JSON_OBJECT_DEPTH) -> str:
    """Any JSON object whose values nest objects / arrays at most ``depth`` levels deep (outlines' tokens)."""
    from outlines_core.json_schema import BOOLEAN, NULL, NUMBER, STRING, WHITESPACE as WS

    if depth < 1:
        raise ValueError(f"a JSON object has depth >= 1, got {depth}")
    scalar = f"({STRING}|{NUMBER}|{BOOLEAN}|{NULL})"

    def obj(v: str) -> str:
        member = f"{STRING}{WS}:{WS}{v}"
        return rf"\{{{WS}({member}({WS},{WS}{member})*)?{WS}\}}"

    value = scalar
    for _ in range(depth - 1):
        value = f"({scalar}|{obj(value)}|\\[{WS}({value}({WS},{WS}{value})*)?{WS}\\])"
    return obj(value)


def index_cache_dir() -> Path | None:
    """Where compiled indexes are kept: ``$ZEROSPEED_STRUCTURED_CACHE`` ("" turns it off), else
    ``~/.cache/zerospeed/structured``."""
    env = os.environ.get("ZEROSPEED_STRUCTURED_CACHE")
    if env is not None:
        return Path(env) if env else None
    return Path.home() / ".cache" / "zerospeed" / "structured"


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
        if spec is None:
            return json_object_regex()
        return build_regex_from_schema(spec if isinstance(spec, str) else json.dumps(spec))
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
        self._vocab_key = ""
        self._indexes: dict[str, Any] = {}

    def _token_bytes(self) -> dict[bytes, list[int]]:
        out: dict[bytes, list[int]] = {}
        if not hasattr(self.tokenizer, "convert_ids_to_tokens"):  # the byte tokenizer
            return {bytes([i]): [i] for i in range(min(256, self.vocab_size))}
        inv = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(getattr(self.tokenizer, "all_special_ids", ()))
        tokens = self.tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        # SentencePiece pieces are text (UTF-8, "▁" for a space): "é" is two bytes, not GPT-2's byte 0xE9
        pieces = any(t is not None and ("\u2581" in t or _SPECIAL_BYTE.fullmatch(t)) for t in tokens)
        for i, t in enumerate(tokens):
            if t is None or i in special or i == self.eos:
                continue
            m = _SPECIAL_BYTE.fullmatch(t) if pieces else None
            if m:
                b = bytes([int(m.group(1), 16)])
            elif not pieces and all(ch in inv for ch in t):
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
                tokens = self._token_bytes()
                self._vocab = Vocabulary(self.eos, tokens)
                self._vocab_key = hashlib.sha256(repr((self.eos, sorted(tokens.items()))).encode()).hexdigest()
            path = self._cache_path(regex)
            if path is not None and path.exists():
                self._indexes[regex] = Index.from_binary(path.read_bytes())
                return self._indexes[regex]
            try:
                self._indexes[regex] = Index(regex, self._vocab)
            except Exception as exc:  # noqa: BLE001 - outlines' own error types
                raise ValueError(f"cannot build a token mask for this structure: {exc}") from None
            if path is not None:
                self._store(path, self._indexes[regex])
        return self._indexes[regex]

    def _cache_path(self, regex: str) -> Path | None:
        """The file of ``regex``'s index for this vocabulary and outlines-core version (None: no cache)."""
        import importlib.metadata

        root = index_cache_dir()
        if root is None:
            return None
        version = importlib.metadata.version("outlines_core")
        key = hashlib.sha256(f"{version}\0{self._vocab_key}\0{regex}".encode()).hexdigest()
        return root / f"{key}.index"

    @staticmethod
    def _store(path: Path, index: Any) -> None:
        """Write ``index`` (outlines-core's own binary form, not a pickle) atomically; a failure only warns."""
        import logging

        try:
            _, (blob,) = index.__reduce__()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(bytes(blob))
            tmp.replace(path)
        except (OSError, TypeError, ValueError) as exc:
            logging.getLogger("zerospeed.serve").warning("structured output: index cache not written: %s", exc)


def mask_logits(row: torch.Tensor, guide: Any, vocab_size: int) -> torch.Tensor:
    """``row`` with every token the guide does not allow at ``-inf``."""
    allowed = [t for t in guide.get_tokens() if t < vocab_size]
    out = torch.full_like(row, float("-inf"))
    if allowed:
        idx = torch.tensor(allowed, dtype=torch.long, device=row.device)
        out[idx] = row[idx]
    return out
